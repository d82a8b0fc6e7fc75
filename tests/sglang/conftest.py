"""SGLang tests run in .venv-sglang (make sglang-venv); elsewhere there is nothing to collect."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["test_*.py"]
