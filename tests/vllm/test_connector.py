"""vLLM itself, prefill/decode disaggregated through kvsvc (KvsvcConnector), token for token.

Real vLLM 0.32 engines on a random-weight Llama (K = 2 KV heads, head 64, blocks of
32 tokens). Oracles: the aggregated run for equal TP (greedy tokens exact, logprobs exact one
prompt at a time and within bf16 rounding when batched: tests/vllm/compare.py), vLLM's own NixlConnector for different TP sizes (it moves the same bytes into
the same places). Independently of the outputs, every P server must report each request
CONSUMED exactly once on its release stream, with no lease left: a D that silently
recomputed instead of loading would show ABORTED or nothing there.
"""

from __future__ import annotations

import pytest

from kvsvc.client import Client
from kvsvc.errors import KvsvcError
from tests.vllm.compare import same
from tests.vllm.engines import Engine, Engines, kvsvc, kvsvc_servers
from tests.vllm.prompts import HEAD, LONGER, PROMPTS
from tests.vllm.releases import Releases, p_servers

pytestmark = pytest.mark.timeout(900)

CONSUMED = "RELEASE_REASON_CONSUMED"


def prefill(P: Engine, prompts: list[list[int]]) -> list[dict]:
    outs = P.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in outs]
    assert all(p and p.get("do_remote_prefill") and "kvsvc" in p for p in params), params
    return params


def disaggregated(P: Engine, D: Engine, prompts: list[list[int]], max_tokens: int = 8, *,
                  keep_cache: bool = False) -> list[dict]:
    """P prefills, D decodes with P's params; asserts P released every request CONSUMED, once per server,
    and (unless keep_cache: the check empties both prefix caches) that neither engine holds a KV block."""
    params = prefill(P, prompts)
    releases = Releases([a for p in params for a in p_servers(p)])
    assert set(releases.addresses) == set(kvsvc_servers(P.log)), (releases.addresses, kvsvc_servers(P.log))
    try:
        outs = D.generate(prompts, max_tokens, params)
        ids = [p["remote_request_id"] for p in params]
        got = releases.wait(ids)
        for rid in ids:
            assert got.get(rid) == [CONSUMED] * len(releases.addresses), (rid, got.get(rid), D.tail())
        assert releases.live_leases() == 0
    finally:
        releases.close()
    if not keep_cache:
        assert P.blocks_free(), ("P still holds KV blocks", P.tail())
        assert D.blocks_free(), ("D still holds KV blocks", D.tail())
    return outs


@pytest.fixture(scope="module")
def tp1(engines: Engines, reference):
    yield engines.get(("kvsvc-p1", 1, kvsvc("kv_producer")), ("kvsvc-d1", 1, kvsvc("kv_consumer")))
    for name in ("kvsvc-p1", "kvsvc-d1"):
        engines.drop(name)


def test_tp1_pd_equals_the_aggregated_run(tp1, reference):
    P, D = tp1
    same(disaggregated(P, D, PROMPTS), reference["all"])  # twelve requests at once


def test_prefix_hit_on_d_reads_only_the_tail(tp1, reference):
    P, D = tp1
    disaggregated(P, D, [HEAD], keep_cache=True)
    before = D.kvsvc_totals()
    (out,) = disaggregated(P, D, [LONGER])
    assert out["num_cached_tokens"] >= 96  # the first three blocks came from D's own cache
    same([out], reference["longer"])
    # Only the tail moved: LONGER's 136 tokens are 5 blocks of 32, D held the first 3. A
    # block is 2 layers x 2 KV heads x 32 tokens x 64 x (K + V) x 2 bytes = 32 KiB.
    after = D.kvsvc_totals()
    assert (after["loaded"] - before["loaded"], after["bytes"] - before["bytes"]) == (1, 2 * 32 * 1024)


def test_a_dead_prefill_engine_fails_the_load_and_d_recomputes(engines: Engines, tp1, reference):
    P, D = tp1
    params = prefill(P, PROMPTS[:2])
    addresses = [a for p in params for a in p_servers(p)]
    P.kill()
    engines.drop("kvsvc-p1")
    with pytest.raises(KvsvcError):  # its kvsvc server died with it
        with Client(addresses[0]) as c:
            c.get_info(timeout_s=2)
    # D's loads fail (kv_load_failure_policy "recompute"): it prefills itself, same tokens.
    before = D.kvsvc_totals()
    same(D.generate(PROMPTS[:2], 8, params), reference["first-two"])
    after = D.kvsvc_totals()
    assert (after["failed"] - before["failed"], after["loaded"] - before["loaded"]) == (2, 0), (before, after)
    same(D.generate(PROMPTS[2:4], 8), reference["next-two"])  # and keeps serving
    assert D.blocks_free(), ("D still holds KV blocks after the failed loads", D.tail())
