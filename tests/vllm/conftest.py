"""vLLM tests run in .venv-vllm (make vllm-venv); elsewhere there is nothing to collect."""

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory):
    """Engines started on demand and stopped at the end of the session (with the model they serve)."""
    from tests.vllm.engines import Engines, write_model

    base = tmp_path_factory.mktemp("vllm")
    write_model(base / "model")
    pool = Engines(base / "model", base)
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def reference(engines) -> dict[str, list[dict]]:
    """The aggregated run's answers (greedy token ids and logprobs) to every named batch,
    computed first and alone (two cores: few engines at a time)."""
    from tests.vllm.prompts import BATCHES

    (agg,) = engines.get(("agg-1", 1, None))
    out = {name: [{"token_ids": o["token_ids"], "logprobs": o["logprobs"]} for o in agg.generate(batch, 8)]
           for name, batch in BATCHES.items()}
    engines.drop("agg-1")
    return out
