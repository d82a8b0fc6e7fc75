"""The engine-level fault matrix, SGLang's rows: a real SGLang P/D pair (kvsvc as its
transfer backend, SGLang's own router in front) with the faults of tests/fault_cycles.py
injected at exact points of kvsvc's data plane and lease table, content digests on.

SGLang does not recompute a request whose KV failed to load: it ends the request as
failed. So here every faulted request must end failed -- never answered with tokens --
with its fault's own typed reason in D's log, and every request without a fault must
answer exactly the aggregated server's tokens and logprobs (one request at a time, radix
caches off, so both sides compute alike). At the end P holds no lease, D runs no
transfer, and SGLang's own idle check of its pools found no leak.

SGLang's D reads only after P's READY, sent once P's lease is made, so a leased block P
rewrites is always caught (vLLM's D may read before P's lease exists: its test allows for
that). KVSVC_CHAOS_ENGINE_REQUESTS sets the number of requests.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from tests.fault_cycles import DIGEST_POINTS, ENV, REASONS, expected_faults, fault_of
from tests.sglang.served import kvsvc_servers, metric, sglang_server
from tests.sglang.test_kvsvc_backend import CHUNKED, MORE, NO_RETRIES, PD, _d_is_clean, _settled, leases_left
from tests.sglang.test_sglang_cpu import write_model

pytestmark = [pytest.mark.timeout(1800), pytest.mark.full]

REQUESTS = int(os.environ.get("KVSVC_CHAOS_ENGINE_REQUESTS", "24"))
NO_RADIX = ("--disable-radix-cache",)  # a rewritten page must not be served again from P's cache
# The router would take P out of service after a run of failed requests (its circuit
# breaker): here failures are what is asked for, and every one must show.
ROUTER_ARGS = (*NO_RETRIES, "--disable-circuit-breaker")
FAILED_LINE = re.compile(r"kvsvc: loading request \S+ failed: kvsvc: ([A-Z_]+):")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sglang-chaos") / "tiny-llama"
    write_model(path)
    return path


def ask(server, text: str, timeout_s: float = 300) -> tuple[int, dict | str]:
    """POST /generate, whatever the answer; a router still registering its workers (503,
    before any engine saw the request) is asked again, as tests/sglang/served.py does."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = requests.post(server.url + "/generate", timeout=timeout_s, json={
            "text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True})
        try:
            body = r.json()
        except ValueError:
            return r.status_code, r.text
        not_yet = r.status_code == 503 and "No available servers" in str(body)
        if not not_yet or time.monotonic() > deadline:
            return r.status_code, body
        time.sleep(0.5)


def tokens(body: dict) -> tuple[list[int], list[float]]:
    return body["output_ids"], [round(lp[0], 4) for lp in body["meta_info"]["output_token_logprobs"]]


def failed(status: int, body: dict | str) -> bool:
    """Ended without an answer: a server error, or SGLang's abort finish reason."""
    return status != 200 or (isinstance(body, dict) and body["meta_info"]["finish_reason"]["type"] == "abort")


def test_every_fault_fails_its_request_typed_and_every_other_answer_is_exact(model, kvsvc_env, tmp_path):
    prompts = MORE
    agg, _ = sglang_server("sglang-agg", model, tmp_path, extra_args=(*CHUNKED, *NO_RADIX))
    try:
        agg.wait_ready(300)
        reference = [tokens(body) for status, body in (ask(agg, p) for p in prompts) if status == 200]
    finally:
        agg.stop()
    assert len(reference) == len(prompts)
    env = {**kvsvc_env, "KVSVC_FAULTS": ENV, "KVSVC_SGLANG_CONTENT_DIGEST": "true"}
    with PD(model, tmp_path, "kvsvc", env=env, router_args=ROUTER_ARGS, server_args=NO_RADIX) as pd:
        wrong, unfailed, answered = [], [], Counter()
        for i in range(REQUESTS):
            k = i % len(prompts)
            status, body = ask(pd.router, prompts[k])
            if fault_of(i) == "-":
                if failed(status, body) or tokens(body) != reference[k]:
                    wrong.append((i, status, body))
            elif not failed(status, body):
                unfailed.append((i, fault_of(i), tokens(body) == reference[k]))
            else:
                answered[status] += 1
        assert not wrong, f"requests without a fault answered wrong or failed: {wrong[:3]}"
        assert not unfailed, f"faulted requests answered (fault, tokens right): {unfailed}"
        faults = expected_faults(REQUESTS)
        reasons = Counter(FAILED_LINE.findall(pd.d.log.read_text(errors="replace")))
        for point, reason in REASONS.items():
            assert reasons[reason] == faults.get(point, 0), (point, reasons, faults)
        assert reasons["DIGEST_MISMATCH"] == sum(faults.get(p, 0) for p in DIGEST_POINTS), (reasons, faults)
        assert sum(reasons.values()) == sum(faults.values()), (reasons, faults)
        injected = {}
        for server in (pd.p, pd.d):
            for _, url in kvsvc_servers(server).values():
                for point in faults:
                    injected[point] = injected.get(point, 0) + metric(url, "kvsvc_injected_faults_total", point=point)
        assert injected == faults, (injected, faults)
        _settled(pd.p, "P still holds leases", lambda: leases_left(pd) == 0)
        _d_is_clean(pd)
        print(f"\nSGLang fault matrix: {REQUESTS} requests, faults {faults} ({sum(faults.values())}), 0 wrong "
              f"answers, every faulted request failed typed {dict(reasons)} (HTTP {dict(answered)}), no lease, transfer or page left")
