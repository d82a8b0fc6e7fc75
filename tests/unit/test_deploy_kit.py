"""The deployment kit holds together: the manifests parse (and render with kustomize where
kubectl exists), kvsvc accepts the config and every command line they run, ports, mounts
and timeouts agree, and the Dockerfile copies what exists and runs what the manifests expect."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvsvc.cli.main import build_parser
from kvsvc.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def docs() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}


def kind(name: str) -> dict:
    return next(d for ds in docs().values() for d in ds if d["kind"] == name)


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]


def kvsvc_container(obj: dict) -> dict:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == "kvsvc")


def config_file(tmp_path: Path) -> str:
    path = tmp_path / "kvsvc.toml"
    path.write_text(kind("ConfigMap")["data"]["kvsvc.toml"])
    return str(path)


def expand(args: list[str]) -> list[str]:
    """The pod's $(VAR) references, as the kubelet fills them in."""
    values = {"POD_NAME": "prefill-0", "NODE_IP": "10.0.0.5", "POD_IP": "10.1.0.7"}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


def probe_argv(probe: dict) -> list[str]:
    cmd = probe["exec"]["command"]
    if cmd[:2] == ["sh", "-c"]:
        cmd = shlex.split(cmd[2].replace('"$POD_NAME"', "prefill-0"))
        assert cmd[0] == "exec"
        cmd = cmd[1:]
    return cmd


def test_every_manifest_parses_with_the_kinds_expected():
    kinds = sorted(d["kind"] for ds in docs().values() for d in ds)
    assert kinds == ["ConfigMap", "DaemonSet", "Kustomization", "Namespace", "Pod", "Service", "ServiceMonitor"]


def test_the_config_loads_and_shutdown_fits_the_grace_period(tmp_path):
    cfg = load_config(config_file(tmp_path), engine_id="prefill-0")
    ds = kind("DaemonSet")
    for obj in (ds, kind("Pod")):
        # SIGTERM: claimed leases get drain_timeout_s, RPCs shutdown_grace_s, before the kubelet kills.
        assert pod_spec(obj)["terminationGracePeriodSeconds"] > cfg.drain_timeout_s + cfg.shutdown_grace_s
    ports = {p["name"]: p["containerPort"] for p in kvsvc_container(ds)["ports"]}
    assert ports == {"grpc": int(cfg.listen.rsplit(":", 1)[1]), "metrics": int(cfg.metrics_listen.rsplit(":", 1)[1])}
    svc = kind("Service")
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    mounts = {m["name"]: m["mountPath"] for m in kvsvc_container(ds)["volumeMounts"]}
    for path in (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file, cfg.peer_tls_ca_file):
        assert path.startswith(mounts["tls"] + "/"), path


@pytest.mark.parametrize("where", ["DaemonSet", "Pod"])
def test_kvsvc_accepts_every_command_line_the_manifests_run(where, tmp_path):
    container = kvsvc_container(kind(where))
    args = build_parser().parse_args(expand(container["args"]))
    assert args.func.__name__ == "_serve" and args.config == "/etc/kvsvc/kvsvc.toml"
    assert args.engine_id == "prefill-0" and args.advertise.endswith(":50051")
    defined = {v["name"] for v in pod_spec(kind(where))["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= defined
    probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
    assert probes
    for probe in probes:
        argv = probe_argv(probe)
        assert argv[0] == "kvsvc"
        health = build_parser().parse_args(argv[1:])
        assert health.func.__name__ == "_health" and health.ca and health.cert and health.key
        assert health.server_name == "prefill-0"  # the certificate names the engine id


def test_the_dockerfile_copies_what_exists_and_runs_the_manifests_command():
    text = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
    assert 'ENTRYPOINT ["kvsvc"]' in text
    assert 'CMD ["serve", "--config", "/etc/kvsvc/kvsvc.toml"]' in text
    assert set(re.findall(r"^EXPOSE (.+)$", text, re.M)[0].split()) == {"50051", "9464"}
    for variant in re.findall(r"AS base-(\w+)", text):
        assert variant in ("cpu", "cuda")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "kvsvc" not in ignored and ".venv" in ignored


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_kit():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in rendered} == {"Namespace", "ConfigMap", "DaemonSet", "Service"}
    assert all(d["metadata"].get("namespace") == "kvsvc" for d in rendered if d["kind"] != "Namespace")
