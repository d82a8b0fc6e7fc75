"""The prompts of the vLLM tests, and the batches the aggregated run answers (the oracle).

Lengths sit around block boundaries (blocks of 32 tokens). A batch's composition is part
of the oracle, so every batch a test compares with is named here and run as is.
"""

from __future__ import annotations

import random

rng = random.Random(11)
# Lengths around block boundaries (32): shorter than a block, exactly 1 and 2 blocks, more.
LENGTHS = [10, 31, 32, 33, 64, 69, 95, 100, 128, 150, 200, 45]
PROMPTS = [[rng.randrange(1, 500) for _ in range(n)] for n in LENGTHS]
HEAD = [rng.randrange(1, 500) for _ in range(96)]  # three whole blocks
LONGER = HEAD + [rng.randrange(1, 500) for _ in range(40)]
# Two prompts P's cache cannot hold side by side (tests/vllm/test_progressive.py: preemption).
PREEMPTED = [[rng.randrange(1, 500) for _ in range(400)] for _ in range(2)]
BATCHES = {"all": PROMPTS, "longer": [LONGER], "first-two": PROMPTS[:2], "next-two": PROMPTS[2:4],
           "alone-5": [PROMPTS[5]], "alone-9": [PROMPTS[9]], "alone-10": [PROMPTS[10]],
           "preempted": PREEMPTED}
