"""vLLM itself, prefill/decode disaggregated through kvsvc (KvsvcConnector), token for token.

Real vLLM 0.32 engines on a random-weight Llama (K = 2 KV heads, head 64, blocks of
32 tokens). Oracles: the aggregated run for equal TP (greedy tokens exact, logprobs exact one
prompt at a time and within bf16 rounding when batched: tests/vllm/compare.py), vLLM's own NixlConnector for different TP sizes (it moves the same bytes into
the same places). Independently of the outputs, every P server must report each request
CONSUMED exactly once on its release stream, with no lease left: a D that silently
recomputed instead of loading would show ABORTED or nothing there.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvsvc.client import Client
from kvsvc.errors import KvsvcError
from tests.vllm.compare import same
from tests.vllm.engines import Engine, Engines, kvsvc, kvsvc_servers, side_channel_ports
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


def failures_logged(D: Engine) -> Counter[str]:
    """The typed reasons D's kvsvc worker logged for its failed transfers so far."""
    return Counter(re.findall(r"kvsvc: transfer of \S+ failed: ([A-Z_]+)", D.log.read_text(errors="replace")))


def test_params_given_twice_load_once_and_a_retry_of_used_params_recomputes(tp1, reference):
    """A router that retries, or sends one request's params to D twice: the lease is read
    by one D request alone, every other attempt fails typed and vLLM recomputes it; every
    answer is the aggregated run's and P releases the lease CONSUMED once."""
    P, D = tp1
    assert D.blocks_free()  # an empty prefix cache on D: every attempt below must load
    (params,) = prefill(P, [PROMPTS[5]])
    releases = Releases(p_servers(params))
    try:
        before, reasons_before = D.kvsvc_totals(), failures_logged(D)
        same(D.generate([PROMPTS[5]] * 2, 8, [params, params]), reference["alone-5"] * 2, batched=True)
        got = releases.wait([params["remote_request_id"]])[params["remote_request_id"]]
        assert got == [CONSUMED] * len(releases.addresses)
        assert D.blocks_free()
        # A retry with the same params, after the lease was used: refused, recomputed.
        same(D.generate([PROMPTS[5]], 8, [params]), reference["alone-5"])
        after = D.kvsvc_totals()
        assert after["loaded"] - before["loaded"] == 1, (before, after)
        refused = failures_logged(D) - reasons_before
        assert sum(refused.values()) == after["failed"] - before["failed"] >= 1, (refused, before, after)
        assert set(refused) <= {"LEASE_CLAIMED", "LEASE_CONSUMED", "LEASE_EXPIRED"}, refused
        assert releases.live_leases() == 0
    finally:
        releases.close()
    assert P.blocks_free() and D.blocks_free()


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


@pytest.mark.full
def test_a_p_replaced_at_the_same_address_is_never_read_through_the_old_runs_params(engines: Engines, tp1,
                                                                                    reference):
    """P killed and started again on the same kvsvc port under the same engine id (a pod
    rescheduled with a fixed port and id): params the first run handed out name the same
    address and engine and, often, the same block ids the second run now leases for another
    prompt. D must refuse them by the server's epoch, typed, and recompute -- never load the
    new run's KV under the old request. (With vLLM's default engine id, new at each start,
    D refuses them UNKNOWN_ENGINE before it gets that far.)"""
    _, D = tp1
    port = side_channel_ports(1)
    conn = {**kvsvc("kv_producer", listen_port=port), "engine_id": f"kvsvc-p-fixed-{port}"}
    (first,) = engines.get(("kvsvc-p-fixed-1", 1, conn))
    (old,) = prefill(first, [PROMPTS[5]])
    first.kill()
    engines.drop("kvsvc-p-fixed-1")
    (second,) = engines.get(("kvsvc-p-fixed-2", 1, conn))
    (new,) = prefill(second, [PROMPTS[9]])
    assert p_servers(old) == p_servers(new), (old, new)  # the same address
    assert D.blocks_free()
    before, reasons_before = D.kvsvc_totals(), failures_logged(D)
    same(D.generate([PROMPTS[5]], 8, [old]), reference["alone-5"])
    after = D.kvsvc_totals()
    assert (after["failed"] - before["failed"], after["loaded"] - before["loaded"]) == (1, 0), (before, after)
    assert failures_logged(D) - reasons_before == Counter({"LEASE_EXPIRED": 1})
    same(D.generate([PROMPTS[9]], 8, [new]), reference["alone-9"])  # the new run's own params load
    assert D.kvsvc_totals()["loaded"] - after["loaded"] == 1
    assert second.blocks_free() and D.blocks_free()
    engines.drop("kvsvc-p-fixed-2")
