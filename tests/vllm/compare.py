"""How a PD answer is compared with its oracle (the aggregated run, or NixlConnector's).

Token ids are always exact: a wrong KV byte changes them. Logprobs are exact when each run
answered its prompts one at a time (the same kernels over the same numbers). When the runs
batched several prompts together, vLLM's bf16 CPU kernels are not batch-invariant: the
order of bf16 reductions depends on the batch's shape (on CPUs with AMX a logprob of
-5.266201 came back as -5.266212). Those logprobs must agree to within one bf16 rounding
of their value: bf16 keeps 8 significant bits, so its unit roundoff is 2^-8 relative
(LOGPROB_REL_TOL), with 2^-8 absolute for logprobs near 0. That is far inside what a wrong
KV block does to an answer (its token ids change, or its logprobs by tenths).
"""

from __future__ import annotations

import math

BF16_UNIT_ROUNDOFF = 2.0 ** -8
LOGPROB_REL_TOL = BF16_UNIT_ROUNDOFF
LOGPROB_ABS_TOL = BF16_UNIT_ROUNDOFF


def same(got: list[dict], want: list[dict], *, batched: bool | None = None) -> None:
    """got's answers equal want's: token ids exactly; logprobs exactly when both runs went
    one prompt at a time, within LOGPROB_*_TOL when they batched (batched=None: a run of
    more than one prompt was batched)."""
    assert len(got) == len(want), (len(got), len(want))
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    if batched is None:
        batched = len(got) > 1
    if not batched:
        assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want], "one at a time: logprobs exact"
        return
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g["logprobs"]) == len(w["logprobs"]), i
        far = [(j, a, b) for j, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"], strict=True))
               if not math.isclose(a, b, rel_tol=LOGPROB_REL_TOL, abs_tol=LOGPROB_ABS_TOL)]
        assert not far, (f"batched: prompt {i}'s logprobs differ by more than one bf16 rounding "
                         f"(rel {LOGPROB_REL_TOL}, abs {LOGPROB_ABS_TOL}): (position, got, want) {far}")
