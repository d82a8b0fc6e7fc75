"""A hybrid model through kvsvc: a small random-weight Granite-4-style model whose layers
alternate Mamba2 mixers and attention, P TP1 -> D TP1, token for token.

vLLM keeps such a model's Mamba state in a group of its own, one state page per request
(padded to the attention page), beside the attention blocks. P leases both; D reads the
attention blocks and the request's state, and computes the prompt's last token from that
state -- so P prefills all but that token (a state of the whole prompt would take it in
twice). Oracle: the aggregated run (greedy tokens exact, logprobs within rounding: the
prompts go as one batch). The model runs in float32: the scan over P's tokens and then D's
last one sums in another order than the aggregated run's single pass, and in bf16 that
difference flips a greedy token where this random model's flat distribution has a near tie
(in float32 the answers agree to 5e-7). Besides the tokens: every P server reports each
request CONSUMED once, and D read the state's bytes (a D that recomputed would match the
tokens too). Without P leaving the last token, every answer differs from its first token.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvsvc.errors import FailedPrecondition
from kvsvc.integrations.vllm import params as kvparams
from kvsvc.integrations.vllm.scheduler import KvsvcScheduler, leave_last_token
from kvsvc.layout.regions import build_pool_layout
from kvsvc.memory.pools import RegionBuffersPool
from tests.vllm.compare import same
from tests.vllm.engines import Engines, kvsvc
from tests.vllm.prompts import PROMPTS
from tests.vllm.served import completion, router, tokens_and_logprobs, vllm_serve
from tests.vllm.test_connector import disaggregated
from tests.vllm.test_hetero_tp import against_nixl_connector

pytestmark = pytest.mark.timeout(900)

LAYERS = ["mamba", "attention", "mamba", "attention"]
HIDDEN, MAMBA_HEADS, HEAD_DIM, STATE, CONV = 256, 8, 32, 16, 4


def write_hybrid_model(path: Path) -> None:
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    cfg = GraniteMoeHybridConfig(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=2, layer_types=LAYERS, mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=HEAD_DIM, mamba_n_groups=1, mamba_d_state=STATE, mamba_d_conv=CONV, mamba_expand=1,
        mamba_chunk_size=64, num_local_experts=0, shared_intermediate_size=512, max_position_embeddings=1024,
        position_embedding_type="rope", tie_word_embeddings=False)
    GraniteMoeHybridForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def state_bytes_per_request() -> int:
    """A request's Mamba state, every Mamba layer: the conv state (CONV - 1 columns of x, B
    and C, bf16) and the SSM state (heads x head dim x state, fp32 as vLLM keeps it on CPU)."""
    conv = (CONV - 1) * (HIDDEN + 2 * STATE) * 2
    ssm = MAMBA_HEADS * HEAD_DIM * STATE * 4
    return LAYERS.count("mamba") * (conv + ssm)


@pytest.fixture(scope="module")
def hybrid_engines(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("hybrid")
    write_hybrid_model(base / "model")
    # No prefix caching: vLLM keeps a hybrid's state per request then (mamba_cache_mode
    # "none"), the mode kvsvc moves; vLLM picks the block size that fits the state page;
    # float32 (above).
    pool = Engines(base / "model", base, {"enable_prefix_caching": False, "block_size": None, "dtype": "float32"})
    yield pool
    pool.stop_all()


def test_a_hybrid_model_equals_the_aggregated_run(hybrid_engines: Engines):
    prompts = PROMPTS
    (agg,) = hybrid_engines.get(("hy-agg", 1, None))
    reference = agg.generate(prompts, 8)
    hybrid_engines.drop("hy-agg")
    P, D = hybrid_engines.get(("hy-p", 1, kvsvc("kv_producer")), ("hy-d", 1, kvsvc("kv_consumer")))
    before = D.kvsvc_totals()
    same(disaggregated(P, D, prompts), reference)
    after = D.kvsvc_totals()
    assert after["loaded"] - before["loaded"] == len(prompts) and after["failed"] == before["failed"], after
    # Each load read its request's state (and attention blocks): none was recomputed instead.
    assert after["bytes"] - before["bytes"] >= len(prompts) * state_bytes_per_request(), (before, after)


@pytest.mark.full  # make test-full: two more pairs of engines
def test_a_hybrid_model_equals_vllms_nixl_connector_one_request_at_a_time(hybrid_engines: Engines):
    # The exact oracle: NixlConnector splits the prompt as kvsvc does (P all but the last
    # token, D that one from P's state), so one request at a time the logprobs are equal.
    against_nixl_connector(hybrid_engines, 1, 1, [[p] for p in PROMPTS[3:9]])


@pytest.mark.full  # make test-full: two served engines and the router
def test_a_hybrid_served_through_the_router_pulled_and_asked_to_stream(hybrid_engines: Engines, tmp_path: Path):
    # Served as a user would (vllm serve, kvsvc's router): pulled, D reads P's state; with
    # --progressive the router sends the request to P and D at once, P does not stream a
    # hybrid, and D recomputes it and gives P's lease up -- the answers are the same.
    prompts = PROMPTS[4:7]
    (agg,) = hybrid_engines.get(("hy-agg", 1, None))
    want = [agg.generate([p], 8)[0]["token_ids"] for p in prompts]
    hybrid_engines.drop("hy-agg")
    args = ("--no-enable-prefix-caching", "--dtype", "float32")
    p = vllm_serve("hy-serve-p", hybrid_engines.model, tmp_path, kvsvc("kv_producer"), extra_args=args)
    d = vllm_serve("hy-serve-d", hybrid_engines.model, tmp_path, kvsvc("kv_consumer"), extra_args=args)
    procs = [p, d]
    try:
        p.wait_ready()
        d.wait_ready()
        pulled = router(tmp_path, p, d)
        streamed = router(tmp_path, p, d, "--progressive")
        procs += [pulled, streamed]
        pulled.wait_ready(60)
        streamed.wait_ready(60)
        got = [tokens_and_logprobs(pulled.post("/v1/completions", completion(q, 8)))["token_ids"] for q in prompts]
        assert got == want
        read = d.metrics().get("vllm:kvsvc_bytes_transferred_sum", 0.0)
        assert read >= len(prompts) * state_bytes_per_request(), (read, d.tail())
        # The streaming router's first request to P goes pulled (it learns P's servers); the rest ask to stream.
        got = [tokens_and_logprobs(streamed.post("/v1/completions", completion(q, 8)))["token_ids"] for q in prompts]
        assert got == want
        assert "recomputes its prompt" in d.tail(400), d.tail()
        assert p.blocks_all_free() and d.blocks_all_free(), (p.tail(), d.tail())
    finally:
        for s in procs:
            s.stop()


# ---- the rules, on fakes (each a failure path the engines above do not take) -----------------

Mamba = type("MambaSpec", (SimpleNamespace,), {})  # named as vLLM's: the connector reads spec types by name
Attention = type("FullAttentionSpec", (SimpleNamespace,), {})
CONV_SHAPE, SSM_SHAPE = (CONV - 1, HIDDEN + 2 * STATE), (MAMBA_HEADS, HEAD_DIM, STATE)


def _caches(blocks: int = 6, page: int = 65536, mode: str = "none", spec_blocks: int = 0):
    """A hybrid worker's caches as vLLM hands them to a connector: one raw buffer per pair of
    layers, viewed as attention blocks [blocks, heads, tokens, K+V] (bf16) by one and as the
    Mamba layer's raw state pages [blocks, 1, 1, state bytes] (page apart) by the other."""
    import torch

    state = math.prod(CONV_SHAPE) * 2 + math.prod(SSM_SHAPE) * 4
    raws = [torch.zeros(blocks * page, dtype=torch.int8) for _ in range(2)]
    caches = {}
    for i, raw in enumerate(raws):
        caches[f"m{i}"] = raw.as_strided((blocks, 1, 1, state), (page, state, state, 1))
        caches[f"a{i}"] = raw.view(torch.bfloat16).view(blocks, 2, page // (2 * 2 * 128), 128)
    mamba = Mamba(shapes=(CONV_SHAPE, SSM_SHAPE), dtypes=(torch.bfloat16, torch.float32), block_size=512,
                  mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)
    attention = Attention(block_size=page // (2 * 2 * 128), num_kv_heads=2, head_size=64, head_size_v=64)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=mamba, layer_names=["m0", "m1"]),
                                              SimpleNamespace(kv_cache_spec=attention, layer_names=["a0", "a1"])])
    return caches, config, raws


def test_the_state_pages_are_described_in_place():
    from kvsvc.integrations.vllm.layout import describe

    caches, config, raws = _caches()
    d = describe(caches, config, model_id="hy", total_num_kv_heads=2)
    mamba = d.layout.groups[0].spec
    assert mamba.page_bytes == 65536 and mamba.shapes == (CONV_SHAPE, SSM_SHAPE)
    conv = math.prod(CONV_SHAPE) * 2
    # Region order: each Mamba layer's conv then SSM state, then the attention layers.
    assert [b.data_ptr() for b in d.buffers[:4]] == [raws[0].data_ptr(), raws[0].data_ptr() + conv,
                                                   raws[1].data_ptr(), raws[1].data_ptr() + conv]
    assert [b.stride(0) for b in d.buffers[:4]] == [65536] * 4
    RegionBuffersPool(0, build_pool_layout(d.layout).regions, d.buffers)  # the server takes them as they are


@pytest.mark.parametrize(("kw", "says"), [({"mode": "align"}, "mamba_cache_mode"),
                                          ({"spec_blocks": 2}, "speculative")])
def test_state_kept_other_than_per_request_is_refused_at_start(kw, says):
    from kvsvc.integrations.vllm.layout import describe

    caches, config, _ = _caches(**kw)
    with pytest.raises(FailedPrecondition) as e:
        describe(caches, config, model_id="hy", total_num_kv_heads=2)
    assert e.value.reason == "UNSUPPORTED_KV_LAYOUT" and says in e.value.message


def test_p_leaves_the_prompts_last_token_to_d_once():
    req = SimpleNamespace(prompt_token_ids=[5, 6, 7, 8], _all_token_ids=[5, 6, 7, 8], num_prompt_tokens=4,
                          max_tokens=1)
    params = {"do_remote_decode": True}
    leave_last_token(req, params)
    leave_last_token(req, params)  # a preempted request comes back: cut once
    assert (req.prompt_token_ids, req._all_token_ids, req.num_prompt_tokens) == ([5, 6, 7], [5, 6, 7], 3)
    one = SimpleNamespace(prompt_token_ids=[5], _all_token_ids=[5], num_prompt_tokens=1, max_tokens=1)
    leave_last_token(one, {"do_remote_decode": True})
    assert one.num_prompt_tokens == 1 and one.prompt_token_ids == [5]


@pytest.mark.parametrize(("remote", "remote_tp", "loads"), [(9, 1, 9), (10, 1, 0), (9, 2, 0), (4, 1, 4), (0, 1, 0)])
def test_d_continues_only_from_a_state_of_tokens_it_does_not_compute(remote, remote_tp, loads):
    sched = KvsvcScheduler(engine_id="d", tp_size=1, dcp_size=1, is_producer=False, lease_heartbeat_s=0,
                           carries_state=True)
    req = SimpleNamespace(request_id="r", num_prompt_tokens=10, kv_transfer_params={
        "do_remote_prefill": True, "remote_num_tokens": remote, "tp_size": remote_tp,
        kvparams.KEY: {"remote_tp_size": remote_tp}})
    assert sched.get_num_new_matched_tokens(req, 0) == ((loads, True) if loads else (0, False))
    # A state D cannot use is never read: P's lease is given up at once, and asked again, nothing loads.
    assert ("r" in sched.build_connector_meta(SimpleNamespace()).abandon) == (not loads)
    assert sched.get_num_new_matched_tokens(req, 0) == ((loads, True) if loads else (0, False))
