"""MLA through kvsvc: a small random-weight DeepSeek-V2-style model, P TP2 -> D TP1.

The seed's own case: with MLA every P rank holds the whole latent, D's one rank reads
it from one P rank and P's other rank must still be released (both P servers report
CONSUMED). The oracle is vLLM's NixlConnector on the same pair, one request at a time.
The aggregated run is not one: on CPU, MLA computes a prompt's last token with the
prefill kernel when aggregated but with the decode kernel when D continues from loaded
KV, so logprobs differ in the last digits.
"""

from __future__ import annotations

import pytest

from tests.vllm.engines import Engines, kernel_block_size, write_mla_model
from tests.vllm.prompts import PROMPTS
from tests.vllm.test_hetero_tp import against_nixl_connector

# Four engines (about 3.5 minutes on two cores): in make test-full. make test covers MLA's
# pairing with real servers (tests/e2e) and the mapping's spread of MLA ranks (tests/unit).
pytestmark = [pytest.mark.timeout(900), pytest.mark.full]


@pytest.fixture(scope="module")
def mla_engines(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("mla")
    write_mla_model(base / "model")
    # What vLLM's MLA backend here takes: CPU_MLA blocks of 16, AMX_MLA multiples of 32.
    pool = Engines(base / "model", base, {"block_size": kernel_block_size(mla=True)})
    yield pool
    pool.stop_all()


def test_mla_p_tp2_to_d_tp1_equals_vllms_nixl_connector(mla_engines: Engines):
    # One request at a time: vLLM's CPU MLA decode is not batch-invariant (see against_nixl_connector).
    against_nixl_connector(mla_engines, 2, 1, [[p] for p in PROMPTS[:6]])
