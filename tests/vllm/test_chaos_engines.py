"""The engine-level fault matrix, vLLM's rows: a real vLLM P/D pair through kvsvc with faults
injected at exact points of kvsvc's data plane and lease table (service/faults.py), every
answer compared token for token with the aggregated engine.

One request at a time, so that the n-th request is the D server's n-th transfer and the P
server's n-th lease: the fault cycle (tests/fault_cycles.py) gives each request at most
one fault, in turn at every point, and leaves some requests untouched. Every answer must equal the
aggregated run's tokens (a failed load is recomputed by vLLM, kv_load_failure_policy
"recompute"); every fault must end its transfer as a typed failure (D's failed count); and
at the end neither engine holds a KV block (P got every lease back, D every block).

Content digests are on: two of the points (a byte flipped where a READ landed, a leased
block the engine rewrites) can only be caught by them. KVSVC_CHAOS_ENGINE_REQUESTS sets
the number of requests (make test-full runs more).
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from tests.fault_cycles import ENV, REASONS, expected_faults
from tests.vllm.compare import same
from tests.vllm.engines import Engine, Engines, kvsvc
from tests.vllm.prompts import PROMPTS
from tests.vllm.test_connector import prefill

pytestmark = pytest.mark.timeout(1800)

REQUESTS = int(os.environ.get("KVSVC_CHAOS_ENGINE_REQUESTS", "16"))
NO_PREFIX_CACHE = {"enable_prefix_caching": False}  # a rewritten block must not outlive its request


@pytest.fixture(scope="module")
def faulty(engines: Engines, reference):
    started = [
        Engine("chaos-p", engines.model, engines.logs, connector=kvsvc("kv_producer", content_digest=True),
               engine_args=NO_PREFIX_CACHE, extra_env={"KVSVC_FAULTS": ENV}),
        Engine("chaos-d", engines.model, engines.logs, connector=kvsvc("kv_consumer", content_digest=True),
               engine_args=NO_PREFIX_CACHE, extra_env={"KVSVC_FAULTS": ENV})]
    try:
        for e in started:
            e.wait_ready()
        yield started
    finally:
        for e in started:
            e.stop()


def test_every_fault_ends_typed_every_answer_is_token_exact_and_nothing_is_held(faulty, reference):
    P, D = faulty
    before = D.kvsvc_totals()
    for i in range(REQUESTS):
        k = i % len(PROMPTS)
        (params,) = prefill(P, [PROMPTS[k]])
        (out,) = D.generate([PROMPTS[k]], 8, [params])
        same([out], [reference["all"][k]], batched=True)  # token ids exact (a failed load was recomputed)
    after = D.kvsvc_totals()
    faults = expected_faults(REQUESTS)
    failed = after["failed"] - before["failed"]
    assert failed + after["loaded"] - before["loaded"] == REQUESTS, (before, after)
    # Each fault ends its transfer with its own typed error (the D worker logs each failure's
    # reason). One exception: a leased block rewritten after D already read it (params are
    # handed out before P's worker makes the lease, and D reads first) leaves nothing to
    # catch -- D holds the right bytes, which the token check above confirms.
    reasons = Counter(re.findall(r"kvsvc: transfer of \S+ failed: ([A-Z_]+)", D.log.read_text(errors="replace")))
    assert sum(reasons.values()) == failed, (reasons, failed)
    for point, reason in REASONS.items():
        assert reasons[reason] == faults.get(point, 0), (point, reasons, faults)
    late_rewrites = faults.get("corrupt_landed", 0) + faults.get("block_rewritten", 0) - reasons["DIGEST_MISMATCH"]
    assert 0 <= late_rewrites <= faults.get("block_rewritten", 0), (reasons, faults)
    assert P.blocks_free(), ("P still holds KV blocks", P.tail())
    assert D.blocks_free(), ("D still holds KV blocks", D.tail())
    print(f"\nvLLM fault matrix: {REQUESTS} requests, faults {faults} ({sum(faults.values())}), 0 wrong answers, "
          f"{failed} typed failures recomputed {dict(reasons)}, {late_rewrites} blocks rewritten after D had read "
          "them, no block held")
