"""The vLLM tests' answer comparison (tests/vllm/compare.py) fails where it must."""

from __future__ import annotations

import pytest

from tests.vllm.compare import same


def answer(ids: list[int], lps: list[float]) -> dict:
    return {"token_ids": ids, "logprobs": lps}


def test_one_at_a_time_is_exact():
    same([answer([1, 2], [-5.266201, -0.5])], [answer([1, 2], [-5.266201, -0.5])])
    with pytest.raises(AssertionError, match="one at a time"):
        same([answer([1, 2], [-5.266201, -0.5])], [answer([1, 2], [-5.266212, -0.5])])


def test_batched_logprobs_agree_within_one_bf16_rounding():
    want = [answer([1, 2], [-5.266212, -0.5]), answer([3], [-0.0001])]
    same([answer([1, 2], [-5.266201, -0.5]), answer([3], [-0.0002])], want)  # the batching difference seen
    with pytest.raises(AssertionError, match="bf16 rounding"):
        same([answer([1, 2], [-5.35, -0.5]), answer([3], [-0.0001])], want)  # 0.08 off: not rounding


def test_token_ids_are_exact_in_either_case():
    with pytest.raises(AssertionError):
        same([answer([1, 3], [-1.0, -1.0]), answer([3], [-1.0])], [answer([1, 2], [-1.0, -1.0]), answer([3], [-1.0])])
    with pytest.raises(AssertionError):
        same([answer([1, 2], [-1.0, -1.0])], [answer([1, 2], [-1.0, -1.0]), answer([3], [-1.0])])
