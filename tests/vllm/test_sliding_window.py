"""A sliding-window model through kvsvc: a small random-weight Mistral-style model whose
every layer attends to the last 48 tokens only, P TP1 -> D TP1, token for token.

vLLM keeps such a model's KV in a sliding-window group: the blocks that fell out of the
window may already be freed (and given as the null block) when P finishes, so P leases
and D reads only the window's blocks. Oracle: the aggregated run (greedy tokens exact,
logprobs within bf16 rounding: the prompts go as one batch, tests/vllm/compare.py); every P server reports each request CONSUMED once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.compare import same
from tests.vllm.engines import Engines, kvsvc
from tests.vllm.prompts import PROMPTS
from tests.vllm.test_connector import disaggregated

pytestmark = pytest.mark.timeout(900)

WINDOW = 48


def write_sliding_window_model(path: Path) -> None:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                        sliding_window=WINDOW)
    MistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module")
def sw_engines(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("sliding")
    write_sliding_window_model(base / "model")
    pool = Engines(base / "model", base)
    yield pool
    pool.stop_all()


def test_a_sliding_window_model_equals_the_aggregated_run(sw_engines: Engines):
    prompts = PROMPTS[4:]  # 64 to 200 tokens: all past the window
    (agg,) = sw_engines.get(("sw-agg", 1, None))
    reference = agg.generate(prompts, 8)
    sw_engines.drop("sw-agg")
    P, D = sw_engines.get(("sw-p", 1, kvsvc("kv_producer")), ("sw-d", 1, kvsvc("kv_consumer")))
    same(disaggregated(P, D, prompts), reference)
