"""Requests that wait in D's queue longer than P's lease still load, with vLLM's defaults.

D runs one request at a time (max_num_seqs=1), so of a batch P prefilled at once the last
ones wait in D's queue for more than one of P's 10-second lease lifetimes (each request
decodes its 400 tokens, or up to the model's length, whatever it samples: ignore_eos. Left
to stop at the random model's end-of-text, the batch took 4.5 s on a CPU with AMX and the
scenario did not happen; the test checks it did); D's connector
heartbeats their leases meanwhile. With the default kv_load_failure_policy ("fail") an
expired lease would fail the request; here every one must load (P releases each
CONSUMED, none EXPIRED) and answer as the aggregated engine does.
"""

from __future__ import annotations

import time

import pytest

from tests.vllm.engines import KVSVC, PATIENT, Engine, Engines, kvsvc, kvsvc_servers
from tests.vllm.prompts import PROMPTS
from tests.vllm.releases import Releases, p_servers

pytestmark = pytest.mark.timeout(900)

TTL_S = 10.0  # above P's batch time (a request's lease runs from P's finishing it, heartbeats start at D)
# and above the stalls of P's kvsvc loop seen on two busy cores (up to 7 s: vLLM's worker spins on
# the GIL while D decodes; leases/table.py LOOP_STALL_S gives one stall its grace, not several)
TOKENS = 400  # long enough that each request holds D for a while (vLLM stops at max_model_len)
PAIRS = 8  # of prompts: 16 requests, the last consumed 2-5 TTLs after D got them


def test_requests_queued_on_d_longer_than_the_lease_all_load(engines: Engines, reference):
    P = Engine("queue-p", engines.model, engines.logs, connector=kvsvc("kv_producer", lease_ttl_s=TTL_S))
    d_conf = dict(KVSVC, kv_role="kv_consumer",  # kv_load_failure_policy left at vLLM's default
                  kv_connector_extra_config={**PATIENT, "lease_heartbeat_s": 0.3})
    D = Engine("queue-d", engines.model, engines.logs, connector=d_conf, engine_args={"max_num_seqs": 1, "num_gpu_blocks_override": 17})
    try:
        P.wait_ready()
        D.wait_ready()
        prompts = [PROMPTS[5], PROMPTS[9]] * PAIRS
        # Subscribe before P prefills: between P's batch and D's first heartbeat only the
        # engines' own time passes (a subscription made in between once took long enough
        # on busy cores that the first leases expired before D had seen their requests).
        releases = Releases(kvsvc_servers(P.log))
        try:
            outs = P.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
            params = [o["kv_transfer_params"] for o in outs]
            assert {a for p in params for a in p_servers(p)} <= set(releases.addresses)
            t0 = time.monotonic()
            got = D.generate(prompts, TOKENS, params, ignore_eos=True)
            waited = time.monotonic() - t0
            ids = [p["remote_request_id"] for p in params]
            released = releases.wait(ids)
            assert all(released.get(r) == ["RELEASE_REASON_CONSUMED"] for r in ids), (released, D.tail())
            # The scenario happened: every lease was granted before t0, and the last one was
            # consumed more than a lease lifetime later, so it outlived its TTL in D's queue.
            outlived = releases.last_release_at() - t0
        finally:
            releases.close()
        assert outlived > TTL_S, f"D answered in {waited:.1f} s, last release after {outlived:.1f} s: no request outlived its lease"
        print(f"D answered in {waited:.1f} s; the last lease was consumed {outlived:.1f} s after D got the batch")
        for o, alone in zip(got, [reference["alone-5"][0], reference["alone-9"][0]] * PAIRS, strict=True):
            n = len(alone["token_ids"])  # up to 8: the aggregated run stops at end-of-text, D goes on
            assert o["token_ids"][:n] == alone["token_ids"]
            assert o["logprobs"][:n] == alone["logprobs"]
    finally:
        for e in (D, P):
            e.stop()
