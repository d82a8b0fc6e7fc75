"""A hybrid sliding-window model through kvsvc: SGLang keeps its window layers in a pool of
their own (its SWA state), and D must get the window's pages from P's window pool beside the
full pages, or its window layers attend to nothing.

The model is a small random-weight Mellum (SGLang's hybrid-SWA list) with dense MLPs: layers
alternate between a sliding window of 32 tokens and full attention, and most prompts here
are longer than the window. P TP1 -> D TP1 through kvsvc equals SGLang's aggregated server
(token ids, and logprobs exactly one request at a time); P TP2 -> D TP1 equals SGLang's own
NIXL backend on the same pair. Requests that wait on a full D for many times P's lease all
arrive, and no lease expires (checked to fail with leases of 2 ms: LEASE_EXPIRED).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from tests.sglang.served import generate, greedy, kvsvc_servers, metric
from tests.sglang.test_kvsvc_backend import PD, against_aggregated, flush, leases_left, one_by_one
from tests.sglang.test_sglang_cpu import answers
from tests.vllm.engines import ROOT

pytestmark = [pytest.mark.timeout(900), pytest.mark.full]

WINDOW = 32
PROMPTS = [
    "The capital of France is",  # inside the window
    "Prefill computes the KV cache of a prompt; decode continues from it, one token at a time. " * 3,
    "one two three four five six seven eight nine ten " * 9,  # over two 64-token prefill chunks
    "Prefill computes the KV cache of a prompt; decode continues from it, one token at a time. " * 3
    + "The window slides on.",  # shares a prefix with the second (a radix hit on P)
    "abc " * 40 + "def",
]


def write_swa_model(path: Path) -> None:
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "examples" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    cfg = MellumConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                       sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                       mlp_layer_types=["dense"] * 4, num_local_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    MellumForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    module.write_tokenizer(path, 512)


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sglang-swa") / "tiny-mellum"
    write_swa_model(path)
    return path


def test_a_sliding_window_model_through_kvsvc_equals_the_aggregated_server(swa_model, kvsvc_env, tmp_path):
    against_aggregated(swa_model, tmp_path, kvsvc_env, PROMPTS, PROMPTS, "Use sliding window memory pool")


def test_a_sliding_window_model_across_tp_sizes_equals_sglangs_nixl_backend(swa_model, kvsvc_env, tmp_path):
    results = {}
    for backend in ("nixl", "kvsvc"):
        logs = tmp_path / backend
        logs.mkdir()
        with PD(swa_model, logs, backend, 2, 1, env=kvsvc_env) as pd:
            results[backend] = one_by_one(pd.router, PROMPTS)
            if backend == "kvsvc":
                for _, url in kvsvc_servers(pd.p).values():  # every P rank's lease was consumed
                    assert metric(url, "kvsvc_lease_releases_total", reason="consumed") == len(PROMPTS)
                assert leases_left(pd) == 0
    assert results["kvsvc"] == results["nixl"]


LEASE_TTL_S = 1.0


def test_requests_that_wait_on_d_longer_than_the_lease_all_arrive(swa_model, kvsvc_env, tmp_path):
    """D has room for three requests at a time (2,048 tokens; SGLang reserves 512 decode
    tokens a request beside its prompt) and P's leases last a second: twelve requests sent
    at once wait on D far longer than a lease. (SGLang's own decode server does not finish
    its start-up warmup here with --max-running-requests 2, with either backend.) In SGLang D takes a
    request (allocates its full and window pages, sends its METADATA) before P prefills
    it, and P leases only after its last chunk, so the wait is before the lease: every
    request arrives, every lease is consumed, none expires, and the answers are those of
    the same prompts one at a time."""
    prompts = [f"{i} " + PROMPTS[i % len(PROMPTS)] for i in range(12)]
    env = {**kvsvc_env, "KVSVC_SGLANG_LEASE_TTL_MS": str(int(LEASE_TTL_S * 1000))}
    with PD(swa_model, tmp_path, "kvsvc", env=env, d_args=("--max-total-tokens", "2048")) as pd:
        started = time.monotonic()
        together = [ids for ids, _ in answers(pd.router, prompts, tokens=24, timeout_s=600)]
        waited_s = time.monotonic() - started
        assert waited_s > 5 * LEASE_TTL_S, f"the requests did not wait long enough to test this ({waited_s:.1f} s)"
        (_, p_metrics), = kvsvc_servers(pd.p).values()
        assert metric(p_metrics, "kvsvc_lease_releases_total", reason="consumed") == len(prompts)
        assert metric(p_metrics, "kvsvc_lease_releases_total", reason="expired") == 0
        flush(pd.p, pd.d)
        # The first tokens: a wrong KV shows there, and later ones may flip with how the
        # requests batched (bf16 numerics), which differs between the two runs.
        alone = [generate(pd.router, greedy(p, 8))["output_ids"] for p in prompts[:4]]
        assert [ids[:8] for ids in together[:4]] == alone
        assert leases_left(pd) == 0
