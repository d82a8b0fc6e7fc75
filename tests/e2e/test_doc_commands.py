"""Every shell command in README.md and docs/*.md is run by a test, or says why it cannot run
here. Each command line is listed below with who runs it: this file (against live servers,
with one edit where it would take a fixed port), another test (which must mention it), or
nobody here, with the reason (no Docker, no cluster, no network). A new command in the docs
fails this test until it is placed."""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.discovery.conftest import etcd  # noqa: F401  (the fixture: a real etcd)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

HERE = "run by this file"
NO_DOCKER = "no Docker here: tests/unit/test_deploy_kit.py and test_deploy_vllm.py check the Dockerfiles"
NO_CLUSTER = "no cluster here: the kits are rendered with kubectl kustomize and checked (test_deploy_kit, test_deploy_vllm)"

DEMOS = [
    ".venv/bin/kvsvc demo --prefill-tp 4 --decode-tp 2 --kv-heads 8 --layers 8 --blocks 128",
    ".venv/bin/kvsvc demo --prefill-tp 2 --decode-tp 1 --mla --layers 4",
    ".venv/bin/kvsvc demo --prefill-tp 1 --decode-tp 4 --kv-heads 2 --block-size 32",
    ".venv/bin/kvsvc demo --prefill-tp 4 --decode-tp 2 --prefill-servers 2 --decode-servers 2",
    ".venv/bin/kvsvc demo --mla --prefill-tp 4 --prefill-dcp 4 --decode-tp 2 --decode-dcp 2 --blocks 9",
]
INSPECT = [
    ".venv/bin/kvsvc serve",
    ".venv/bin/kvsvc info 127.0.0.1:50051",
    ".venv/bin/kvsvc leases 127.0.0.1:50051",
    ".venv/bin/kvsvc health 127.0.0.1:50051",
    ".venv/bin/grpcurl -plaintext localhost:50051 list",
]
ETCD = [
    ".venv/bin/kvsvc engines --etcd http://127.0.0.1:2379",
    ".venv/bin/kvsvc engines --etcd http://127.0.0.1:2379 --engine prefill-0 --json",
    ".venv/bin/kvsvc engines --etcd http://127.0.0.1:2379 --watch",
]

# docs/SGLANG.md's commands, as tests/sglang/served.py runs them (free ports, CPU settings added;
# no --base-gpu-id, which picks the GPU each server starts at, on a machine without one)
SGLANG = {
    "python -m sglang.launch_server --model-path MODEL --disaggregation-mode prefill --disaggregation-transfer-backend "
    "kvsvc --disaggregation-bootstrap-port 8998 --port 30000 --base-gpu-id 0":
        '"--disaggregation-bootstrap-port", str(bootstrap)',
    "python -m sglang.launch_server --model-path MODEL --disaggregation-mode decode --disaggregation-transfer-backend "
    "kvsvc --port 30001 --base-gpu-id 1": '"--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend',
    "python -m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:30000 8998 --decode "
    "http://127.0.0.1:30001 --port 8000": '"sglang_router.launch_router", "--pd-disaggregation"',
}

# command -> HERE, ("test", path, text the test holds), or ("not here", reason)
WHO: dict[str, object] = {
    "make demo": ("test", ".ci/run", "make demo"),
    "make test": ("test", ".ci/run", "make test"),
    "make vllm-venv": ("test", "Makefile", "test-vllm: $(VLLM_STAMP)"),  # make test builds it first
    ".venv-vllm/bin/python examples/tiny_model.py /tmp/tiny-llama": ("test", "tests/vllm/test_quickstart.py",
                                                                     "examples/tiny_model.py"),
    "examples/vllm_pd.sh /tmp/tiny-llama": ("test", "tests/vllm/test_quickstart.py", "str(SCRIPT), str(tiny_model)"),
    "examples/vllm_pd.sh Qwen/Qwen3-0.6B": ("not here", "downloads a model from Hugging Face; the same script runs "
                                                       "in tests/vllm/test_quickstart.py on a local model"),
    ".venv/bin/python -m build --outdir dist .": ("test", "tests/e2e/test_package.py", '"-m", "build"'),
    '.venv-vllm/bin/pip install "dist/kvsvc-0.1.0-py3-none-any.whl[vllm]"': ("test", "tests/e2e/test_package.py",
                                                                             "[vllm]"),
    ".venv/bin/kvsvc serve --config node.toml": ("test", "tests/clients/test_readme_snippets.py",
                                                 'snippet("### Config\\n", "toml")'),
    "make sglang-venv": ("test", "Makefile", "sglang-venv: $(SGLANG_STAMP)"),
    "make test-sglang": ("test", "Makefile", "test-sglang: $(SGLANG_STAMP)"),
    'python -c \'from vllm import LLM; LLM("MODEL", enforce_eager=True, block_size=32, dtype="bfloat16").generate('
    '{"prompt_token_ids": [1]})\'': ("not here", "reproduces vLLM's own crash on a CPU with AMX (it dies there, "
                                     "whatever the connector); tests/vllm/test_quickstart.py checks kvsvc's "
                                     "workaround in each engine where the CPU has AMX"),
    'pip install "nixl==1.5.1" ".[sglang]"': ("test", "Makefile", '"nixl==1.5.1"\n\t$(SGLANG_VENV)/bin/pip install '
                                                                  '-q -c $(SGLANG_PIN) -e ".[sglang,dev]"'),
    "make bench-sglang": ("not here", "about 6 minutes of real SGLang servers; benchmarks/sglang.json holds its last run"),
    **{cmd: ("test", "tests/sglang/served.py", text) for cmd, text in SGLANG.items()},
    **{d: HERE for d in DEMOS + INSPECT + ETCD},
}


def doc_commands() -> list[tuple[str, str]]:
    """(document, command) for every command line of every sh block: continuation lines
    joined, comments dropped, blank lines skipped."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```(?:sh|bash|shell)\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                cmd = re.split(r"\s+#\s", " " + line.strip(), maxsplit=1)[0].strip()
                if cmd and not cmd.startswith("#"):
                    out.append((doc.name, " ".join(cmd.split())))
    return out


def who(cmd: str) -> object:
    if cmd in WHO:
        return WHO[cmd]
    if cmd.startswith(".venv/bin/grpcurl "):
        return ("test", "tests/clients/test_grpcurl_readme.py", "<!-- grpcurl:begin -->")
    if cmd.startswith("docker "):
        return ("not here", NO_DOCKER)
    if cmd.startswith("kubectl "):
        return ("not here", NO_CLUSTER)
    return None


def test_every_doc_command_is_run_somewhere_or_says_why_not():
    commands = doc_commands()
    assert len(commands) >= 30, commands
    unplaced = [(doc, cmd) for doc, cmd in commands if who(cmd) is None]
    assert not unplaced, f"commands in the docs that no test runs: {unplaced}"
    for _, cmd in commands:
        placed = who(cmd)
        if isinstance(placed, tuple) and placed[0] == "test":
            _, path, text = placed
            assert text in (ROOT / path).read_text(), f"{path} does not run {cmd!r}"
    documented = {cmd for _, cmd in commands}
    stale = sorted(c for c, w in WHO.items() if c not in documented)
    assert not stale, f"listed here but in no doc any more: {stale}"


def run(cmd: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(shlex.split(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("cmd", DEMOS, ids=[f"demo{i}" for i in range(len(DEMOS))])
def test_the_readme_demos(cmd):
    out = run(cmd)
    assert out.returncode == 0 and "VERIFIED" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_serve_then_inspect_it_as_the_docs_say():
    # The one edit: a free port instead of 50051.
    with subprocess.Popen([*shlex.split(INSPECT[0]), "--listen", "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as serve:
        try:
            address = None
            for line in serve.stdout:
                m = re.search(r"kvsvc listening on (\S+?),? ", line + " ")
                if m:
                    address = m.group(1).rstrip(",")
                    break
            assert address, "kvsvc serve printed no address"
            port = address.rsplit(":", 1)[1]
            expect = {"info": "engine", "leases": "lease", "health": "SERVING", "grpcurl": "kvsvc.v1.KvTransferService"}
            for cmd in INSPECT[1:]:
                out = run(cmd.replace(":50051", f":{port}"), 60)
                key = next(k for k in expect if k in cmd)
                assert out.returncode == 0 and expect[key] in out.stdout, (cmd, out.stdout, out.stderr)
        finally:
            serve.terminate()
            serve.wait(30)


def test_the_discovery_commands_against_a_real_etcd(etcd, tmp_path):  # noqa: F811
    from kvsvc.cli.procs import start_server
    from tests.e2e.harness import layout_table

    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[server]\netcd_endpoints = ["{etcd}"]\n')
    sp = start_server(engine_id="prefill-0", role="prefill", tp_size=1, layout=layout_table(k=4), memory="none",
                      config_file=str(cfg))
    try:
        # The one edit: the test's etcd instead of 127.0.0.1:2379.
        listing, as_json, watch = (c.replace("http://127.0.0.1:2379", etcd) for c in ETCD)
        out = run(listing, 60)
        assert out.returncode == 0 and "prefill-0" in out.stdout and sp.address in out.stdout, out
        out = run(as_json, 60)
        assert out.returncode == 0 and '"engine_id": "prefill-0"' in out.stdout.replace('":"', '": "'), out
        with subprocess.Popen(shlex.split(watch), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as w:
            try:
                seen, deadline = "", time.monotonic() + 30
                while sp.address not in seen and time.monotonic() < deadline:
                    seen += w.stdout.readline()
                assert sp.address in seen, seen
            finally:
                w.terminate()
                w.wait(30)
    finally:
        assert sp.stop() == 0


def test_the_front_pages_stay_short():
    """The README is a front page and PERFORMANCE a report: details live in the other docs
    and the run history in benchmarks/history.jsonl."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()) <= 150
    import json

    runs = [json.loads(line) for line in (ROOT / "benchmarks" / "history.jsonl").read_text().splitlines()]
    assert runs and all({"bench", "label", "overhead_p50_ms"} <= r.keys() for r in runs)
