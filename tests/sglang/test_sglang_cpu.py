"""SGLang's prefill/decode disaggregation, as this machine runs it, with SGLang's own NIXL
backend: greedy tokens through P, D and SGLang's router equal SGLang's aggregated server's
(logprobs to within bfloat16 rounding: concurrent requests batch as they happen to), over
concurrent requests including shared prefixes. The baseline the
kvsvc backend is compared with (issue: SGLang uses kvsvc too), and the proof that the CPU
fixtures (tests/sglang/cpu_fixtures) change nothing SGLang computes."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.sglang.served import ROUTER_READY_S, generate, greedy, sglang_router, sglang_server
from tests.vllm.engines import ROOT
from tests.vllm.served import Served

pytestmark = [pytest.mark.timeout(900), pytest.mark.full]

# Lengths around SGLang's page boundaries, and pairs that share a prefix (a radix-cache hit on P).
BASE = "Prefill computes the KV cache of a prompt; decode continues from it, one token at a time. "
PROMPTS = ["The capital of France is", BASE, BASE * 3, BASE * 3 + "kvsvc moves KV blocks", "abc " * 40,
           "abc " * 40 + "def", "The capital of Italy is Rome. The capital of France is"]


def write_model(path: Path) -> None:
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "examples" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_model(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sglang") / "tiny-llama"
    write_model(path)
    return path


def answers(server: Served, prompts: list[str], tokens: int = 8,
            timeout_s: float = 120) -> list[tuple[list[int], list[float]]]:
    """Every prompt at once: (token ids, logprobs rounded to 4 places) of each."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda p: generate(server, greedy(p, tokens), timeout_s), prompts))
    return [(o["output_ids"], [round(lp[0], 4) for lp in o["meta_info"]["output_token_logprobs"]]) for o in out]


def test_sglang_pd_with_its_nixl_backend_equals_its_aggregated_server(model, tmp_path):
    agg, _ = sglang_server("sglang-agg", model, tmp_path)
    try:
        agg.wait_ready(300)
        reference = answers(agg, PROMPTS)
    finally:
        agg.stop()
    (p, bootstrap), (d, _) = sglang_server("sglang-p", model, tmp_path, mode="prefill"), \
        sglang_server("sglang-d", model, tmp_path, mode="decode")
    procs = [p, d]
    try:
        p.wait_ready(300)
        d.wait_ready(300)
        router = sglang_router(tmp_path, p, bootstrap, d)
        procs.append(router)
        router.wait_ready(ROUTER_READY_S)
        got = answers(router, PROMPTS)
        assert [ids for ids, _ in got] == [ids for ids, _ in reference]
        # Logprobs to within bfloat16 rounding: these requests run concurrently, and SGLang's
        # decode numerics depend on how they happen to batch, in either server (a 0.0001
        # difference in one logprob was seen; the token ids are exact).
        for (_, lps), (_, ref) in zip(got, reference, strict=True):
            assert lps == pytest.approx(ref, abs=0.02)
        # P prefilled; D never did, so the KV it decoded from came from P.
        p_log, d_log = p.log.read_text(errors="replace"), d.log.read_text(errors="replace")
        assert "Prefill batch" in p_log and "Prefill batch" not in d_log
    finally:
        for s in procs:
            s.stop()
