"""SGLang tests run in .venv-sglang (make sglang-venv); elsewhere there is nothing to collect.

Tests that import SGLang in the test process itself get the CPU fixtures the servers get
(tests/sglang/served.py), and SGLang's import-time warnings about GPU-only features are
not errors here."""

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["test_*.py"]

if not collect_ignore_glob:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu_fixtures"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.disaggregation.common.staging_buffer  # noqa: F401  (its warnings, once, here)


@pytest.fixture(scope="module")
def kvsvc_env(tmp_path_factory) -> dict[str, str]:
    """The embedded kvsvc servers serve their metrics (KVSVC_SGLANG_CONFIG: a kvsvc TOML)."""
    config = tmp_path_factory.mktemp("kvsvc-config") / "kvsvc.toml"
    config.write_text('[server]\nmetrics_listen = "127.0.0.1:0"\n')
    return {"KVSVC_SGLANG_CONFIG": str(config)}
