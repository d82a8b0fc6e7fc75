"""Write a tiny random-weight Llama with a tokenizer: a model for trying kvsvc with vLLM on a
machine without a GPU or a network (2 layers, 512-token vocabulary, about 2 MB). Its answers are
noise; P -> D through kvsvc gives the same noise the model gives on one engine.

    .venv-vllm/bin/python examples/tiny_model.py /tmp/tiny-llama
"""

from __future__ import annotations

import sys
from pathlib import Path

# Text the tokenizer learns its merges from: any will do, the model's weights are random.
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Prefill computes the KV cache of a prompt; decode continues from it, one token at a time.",
    "kvsvc moves KV blocks from a prefill engine to a decode engine over NIXL.",
] * 50 + [" ".join(a + b for b in "abcdefghijklmnopqrstuvwxyz") for a in "abcdefghijklmnopqrstuvwxyz"]


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # <unk>, <s>, </s> get ids 0, 1, 2: LlamaConfig's default pad/bos/eos ids.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()  # every id the model can emit decodes
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


def write_model(path: Path, vocab_size: int = 512, max_positions: int = 2048) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=max_positions)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path, vocab_size)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: examples/tiny_model.py DIR")
    write_model(Path(sys.argv[1]))
    print(sys.argv[1])
