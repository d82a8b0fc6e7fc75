"""The SGLang check every submission runs (`make test-sglang-smoke`, part of `make test`): real
SGLang 0.5.23 servers on this CPU, kvsvc as their transfer backend, SGLang's own router.

- P TP1 -> D TP1 through kvsvc answers three prompts, one at a time from empty caches,
  exactly as SGLang's aggregated server does (token ids and logprobs); D ran a kvsvc
  transfer for each and prefilled nothing, P released each lease CONSUMED, none is left.
- A request aborted on D while it decodes ends as an abort, leaves no lease on P and no
  transfer on D, and D still answers as before.

The whole matrix (TP pairs against SGLang's NIXL backend, aborts on P, a killed P, the
sliding-window model) is in the other files here, run by `make test-full`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from tests.sglang.served import generate, greedy, kvsvc_servers, metric, sglang_server
from tests.sglang.test_kvsvc_backend import (
    CHUNKED,
    NO_RETRIES,
    PD,
    _d_is_clean,
    _generate_in_background,
    _settled,
    _was_aborted,
    abort,
    leases_left,
    one_by_one,
)
from tests.sglang.test_sglang_cpu import PROMPTS, write_model
from tests.vllm.served import Served

pytestmark = pytest.mark.timeout(900)

SMOKE = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]  # no shared prefix: no radix hit in either run


def flush_when_idle(*servers: Served, timeout_s: float = 120) -> None:
    """Empty the radix caches as soon as each server takes it: SGLang refuses a flush (400)
    while a request is still in it (a fresh server's own warm-up, a router's first probe)."""
    for server in servers:
        deadline = time.monotonic() + timeout_s
        while (r := requests.post(server.url + "/flush_cache", timeout=60)).status_code != 200:
            assert time.monotonic() < deadline, (server.name, r.status_code, r.text)
            time.sleep(0.5)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sglang-smoke") / "tiny-llama"
    write_model(path)
    return path


def test_p1_d1_through_kvsvc_equals_the_aggregated_server_and_an_abort_leaves_nothing(model, kvsvc_env, tmp_path):
    agg, _ = sglang_server("sglang-agg", model, tmp_path, extra_args=CHUNKED)
    try:
        agg.wait_ready(300)
        flush_when_idle(agg)
        reference = one_by_one(agg, SMOKE)
    finally:
        agg.stop()
    with PD(model, tmp_path, "kvsvc", env=kvsvc_env, router_args=NO_RETRIES) as pd:
        flush_when_idle(pd.p, pd.d)
        assert one_by_one(pd.router, SMOKE) == reference
        (_, d_metrics), = kvsvc_servers(pd.d).values()
        (_, p_metrics), = kvsvc_servers(pd.p).values()
        assert metric(d_metrics, "kvsvc_transfers_total", outcome="ok") == len(SMOKE)
        # (P hears the CONSUMED of a held claim just after D's answer: waited for, not raced)
        _settled(pd.p, "P did not release every lease CONSUMED",
                 lambda: metric(p_metrics, "kvsvc_lease_releases_total", reason="consumed") == len(SMOKE))
        assert leases_left(pd) == 0
        assert "Prefill batch" not in pd.d.log.read_text(errors="replace")  # D decoded from P's KV

        t, out = _generate_in_background(pd.router, {**greedy(PROMPTS[1], 1500), "rid": "smoke-abort"})
        _settled(pd.d, "the long request never reached decode",
                 lambda: metric(d_metrics, "kvsvc_transfers_total", outcome="ok") >= len(SMOKE) + 1)
        abort(pd.d, "smoke-abort")
        t.join(120)
        _was_aborted(out)
        _settled(pd.p, "P still holds leases", lambda: leases_left(pd) == 0)
        _d_is_clean(pd)
        assert generate(pd.router, greedy(SMOKE[0], 8))["output_ids"] == reference[0][0]
