"""`vllm serve` P and D engines with KvsvcConnector behind kvsvc's router, over HTTP.

What docs/VLLM.md tells a user to run: two OpenAI-compatible servers
and `python -m kvsvc.integrations.vllm.router`. Answers equal the aggregated run (greedy
token ids and logprobs). Aborts are real client disconnects, which vLLM turns into
request aborts; after each, P's blocks come back (kvsvc released the lease) and D holds
no block (POST /reset_prefix_cache succeeds only then), and D keeps serving.
"""

from __future__ import annotations

import signal
import time

import pytest
import requests

from tests.vllm.engines import kvsvc
from tests.vllm.prompts import PROMPTS
from tests.vllm.releases import Releases, p_servers
from tests.vllm.served import (
    Served,
    completion,
    router,
    streamed_events,
    streamed_token_ids,
    tokens_and_logprobs,
    vllm_serve,
)
from tests.vllm.test_connector import CONSUMED

pytestmark = pytest.mark.timeout(1200)

# P's leases live this long unread: long enough for every D here to come, short enough to
# watch one expire.
LEASE_TTL_S = 40



@pytest.fixture(scope="module")
def served(engines, reference, tmp_path_factory):
    logs = tmp_path_factory.mktemp("served")
    p = vllm_serve("serve-p", engines.model, logs, kvsvc("kv_producer", lease_ttl_s=LEASE_TTL_S))
    d = vllm_serve("serve-d", engines.model, logs, kvsvc("kv_consumer"))
    procs: list[Served] = [p, d]
    try:
        p.wait_ready()
        d.wait_ready()
        r = router(logs, p, d)
        procs.append(r)
        r.wait_ready(60)
        yield p, d, r
    finally:
        for s in procs:
            s.stop()


def prefill(p: Served, prompt: list[int]) -> dict:
    params = p.post("/v1/completions", completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    kv = params["kv_transfer_params"]
    assert kv and kv.get("do_remote_prefill") and "kvsvc" in kv, params
    return kv


def nothing_held(p: Served, d: Served) -> None:
    assert p.blocks_all_free(), ("P still holds blocks", p.tail())
    assert d.blocks_all_free(), ("D still holds blocks", d.tail())


def test_pd_over_http_and_the_router_equal_the_aggregated_run(served, reference):
    p, d, r = served
    kv = prefill(p, PROMPTS[5])
    releases = Releases(p_servers(kv))
    try:
        # P then D by hand, as a router does ...
        direct = d.post("/v1/completions", completion(PROMPTS[5], 8, kv_transfer_params=kv))
        assert tokens_and_logprobs(direct) == reference["alone-5"][0]
        # ... and through the router, whole and streamed.
        routed = r.post("/v1/completions", completion(PROMPTS[9], 8))
        assert tokens_and_logprobs(routed) == reference["alone-9"][0]
        ids = streamed_token_ids(streamed_events(r.url, completion(PROMPTS[9], 8, stream=True)))
        assert ids == reference["alone-9"][0]["token_ids"]
        # Three leases, each read by D: every one released CONSUMED, none left.
        got = releases.wait([kv["remote_request_id"]])
        deadline = time.monotonic() + 30
        while len(releases.events) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(reason for _, _, reason, _at in releases.events) == [CONSUMED] * 3, (got, releases.events)
        assert releases.live_leases() == 0
    finally:
        releases.close()
    nothing_held(p, d)
    # The connector's figures in vLLM's own /metrics and KV-transfer log line.
    assert d.wait_metric("vllm:kvsvc_xfer_time_seconds_count", 3) >= 3
    assert d.metrics()["vllm:kvsvc_bytes_transferred_sum"] >= 3 * 32 * 1024  # at least a 32 KiB block each
    assert p.wait_metric("vllm:kvsvc_num_kv_consumed_reqs_total", 3) >= 3
    assert wait_for_log(d, "KV Transfer metrics: Num successful transfers="), d.tail()


def wait_for_log(s: Served, text: str, timeout_s: float = 40) -> bool:
    """vLLM logs its stats every 10 s while it has work, and once more when it goes idle."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in s.log.read_text(errors="replace"):
            return True
        time.sleep(1)
    return False


def test_a_request_aborted_on_d_before_its_transfer_gives_p_its_blocks_back(served, reference):
    p, d, r = served
    kv = prefill(p, PROMPTS[3])
    releases = Releases(p_servers(kv))
    try:
        d.post("/pause?mode=keep")  # D takes requests in but schedules none
        try:
            with pytest.raises(requests.Timeout):  # the client gives up before D scheduled it
                requests.post(d.url + "/v1/completions", json=completion(PROMPTS[3], 8, kv_transfer_params=kv),
                              timeout=2)
            # The abort goes from D's API server to its engine core on its own time; resumed
            # before it arrived, D schedules the request and its transfer (a few ms) consumes
            # the lease first: the case of the next test, not this one.
            time.sleep(2)
        finally:
            d.post("/resume")
        got = releases.wait([kv["remote_request_id"]], timeout_s=60)
        assert got.get(kv["remote_request_id"]) == ["RELEASE_REASON_ABORTED"], (got, d.tail())
        assert releases.live_leases() == 0
    finally:
        releases.close()
    nothing_held(p, d)
    assert p.wait_metric("vllm:kvsvc_num_kv_aborted_reqs_total", 1) >= 1
    assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[5], 8))) == reference["alone-5"][0]


def test_a_request_aborted_on_d_during_its_transfer_frees_both_sides(served, reference):
    p, d, r = served
    kv = prefill(p, PROMPTS[7])
    releases = Releases(p_servers(kv))
    try:
        p.signal(signal.SIGSTOP)  # P's servers stop answering: D's transfer waits on them
        try:
            with pytest.raises(requests.Timeout):
                requests.post(d.url + "/v1/completions", json=completion(PROMPTS[7], 8, kv_transfer_params=kv),
                              timeout=3)
            time.sleep(1)  # D aborts the request and cancels its transfer
        finally:
            p.signal(signal.SIGCONT)
        got = releases.wait([kv["remote_request_id"]], timeout_s=120)
        reasons = got.get(kv["remote_request_id"])
        # ABORTED (D's abort reached P first) or EXPIRED; or CONSUMED: a stopped P's memory
        # still reads (cma), so D's READ may have completed and its claim-and-consume message
        # have been on its way before D gave up -- P, resumed, grants that first. Either way
        # D reported the transfer cancelled and P's blocks are back.
        assert reasons in (["RELEASE_REASON_ABORTED"], ["RELEASE_REASON_EXPIRED"],
                           ["RELEASE_REASON_CONSUMED"]), (got, d.tail())
        assert releases.live_leases() == 0
    finally:
        releases.close()
    nothing_held(p, d)
    assert d.wait_metric("vllm:kvsvc_num_cancelled_transfers_total", 1) >= 1
    assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[5], 8))) == reference["alone-5"][0]


def test_a_request_d_never_asks_for_expires_and_p_gets_its_blocks_back(served):
    p, d, _ = served
    kv = prefill(p, PROMPTS[8])  # and no decode engine ever comes
    releases = Releases(p_servers(kv))
    try:
        got = releases.wait([kv["remote_request_id"]], timeout_s=LEASE_TTL_S + 60)
        assert got.get(kv["remote_request_id"]) == ["RELEASE_REASON_EXPIRED"], got
        assert releases.live_leases() == 0
    finally:
        releases.close()
    nothing_held(p, d)
    assert p.wait_metric("vllm:kvsvc_num_kv_expired_reqs_total", 1) >= 1


def test_the_connector_alerts_and_panels_against_a_real_scrape(served, tmp_path):
    """deploy/monitoring's vLLM half: a real Prometheus scraping these engines' /metrics (after
    the transfers, aborts and the expiry above) evaluates every rule and panel on vllm:kvsvc_*
    and finds each metric and label they name."""
    from tests.prom import alert_rules, check_exprs_against, dashboard_exprs, prometheus

    p, d, _ = served
    targets = [s.url.removeprefix("http://") for s in (p, d)]
    with prometheus({"vllm": targets}, tmp_path) as prom:
        exprs = [r["expr"] for r in alert_rules("kvsvc-vllm")] + [e for e in dashboard_exprs() if "vllm:" in e]
        assert len(exprs) >= 8
        check_exprs_against(prom, exprs)
