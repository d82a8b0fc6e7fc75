"""P and D of different TP sizes through kvsvc, against vLLM's own NixlConnector on the same pair.

With different TP sizes the aggregated run differs by bf16 reduction order; the exact
oracle is NixlConnector, which moves the same bytes into the same places. One pair of
engines runs at a time (two cores).
"""

from __future__ import annotations

import pytest

from tests.vllm.engines import NIXL, Engines, kvsvc
from tests.vllm.test_connector import PROMPTS, disaggregated, same

pytestmark = pytest.mark.timeout(900)


@pytest.mark.xfail(strict=False, reason="open: on this 2-core machine the oracle, vLLM's NixlConnector with a TP-2 "
                   "engine, sometimes hangs (its workers stop answering the engine core); README, Use with vLLM")
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_hetero_tp_equals_vllms_nixl_connector(engines: Engines, p_tp: int, d_tp: int):
    prompts = PROMPTS[:6]
    kp, kd = engines.get((f"kvsvc-p{p_tp}", p_tp, kvsvc("kv_producer"), "0"),
                         (f"kvsvc-d{d_tp}", d_tp, kvsvc("kv_consumer"), "1"))
    ours = disaggregated(kp, kd, prompts)
    engines.drop(kp.name)
    engines.drop(kd.name)
    np_, nd = engines.get((f"nixl-p{p_tp}", p_tp, NIXL, "0"), (f"nixl-d{d_tp}", d_tp, NIXL, "1"))
    params = [o["kv_transfer_params"] for o in np_.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))]
    theirs = nd.generate(prompts, 8, params)
    engines.drop(np_.name)
    engines.drop(nd.name)
    same(ours, theirs)
