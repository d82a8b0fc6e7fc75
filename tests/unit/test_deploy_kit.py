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


def config_map(name: str) -> dict:
    return next(d for ds in docs().values() for d in ds if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)


def config_file(tmp_path: Path, name: str = "kvsvc-config") -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(config_map(name)["data"]["kvsvc.toml"])
    return str(path)


def mounted_config(obj: dict) -> str:
    """The ConfigMap a pod mounts at /etc/kvsvc/kvsvc.toml."""
    volume = next(m["name"] for m in kvsvc_container(obj)["volumeMounts"] if m["mountPath"] == "/etc/kvsvc/kvsvc.toml")
    return next(v["configMap"]["name"] for v in pod_spec(obj)["volumes"] if v["name"] == volume)


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
    assert kinds == ["ConfigMap", "ConfigMap", "DaemonSet", "Kustomization", "Namespace", "Pod",
                     "PodDisruptionBudget", "Service", "ServiceMonitor"]


def test_the_config_loads_and_shutdown_fits_the_grace_period(tmp_path):
    cfg = load_config(config_file(tmp_path), engine_id="prefill-0")
    ds = kind("DaemonSet")
    for obj in (ds, kind("Pod")):
        # SIGTERM: claimed leases get drain_timeout_s, RPCs shutdown_grace_s, before the kubelet kills.
        own = load_config(config_file(tmp_path, mounted_config(obj)), engine_id="prefill-0")
        assert pod_spec(obj)["terminationGracePeriodSeconds"] > own.drain_timeout_s + own.shutdown_grace_s
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


def test_the_daemonset_leaves_the_gpus_to_the_engines_and_shares_its_pools():
    ds = kind("DaemonSet")
    spec, container = pod_spec(ds), kvsvc_container(ds)
    assert "nvidia.com/gpu" not in str(container.get("resources")), "the engine pods would get no GPU"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"  # the node's GPUs through the runtime, not the device plugin
    assert spec["hostIPC"] is True
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm.get("hostPath", {}).get("path") == "/dev/shm", shm  # not a pod-private emptyDir
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def pool_bytes(cfg_path: str) -> int:
    """Every rank's pool, from the [layout] as written (an independent sum, not kvsvc's)."""
    import tomllib

    raw = tomllib.loads(Path(cfg_path).read_text())
    layout, server = raw["layout"], raw["server"]
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}[layout["dtype"]]
    per_token = sum(g["num_layers"] * 2 * layout["total_num_kv_heads"] * g["head_size"] for g in layout["groups"])
    assert server["tp_size"] <= layout["total_num_kv_heads"]
    return layout["num_blocks"] * layout["block_size"] * per_token * itemsize


def to_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for unit, scale in units.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * scale)
    return int(quantity)


def test_the_sidecar_serves_dram_pools_that_fit_its_shm_and_memory(tmp_path):
    pod = kind("Pod")
    container = kvsvc_container(pod)
    assert "nvidia.com/gpu" not in str(container.get("resources"))
    path = config_file(tmp_path, mounted_config(pod))
    cfg = load_config(path, engine_id="prefill-0")
    assert cfg.memory.name.lower() == "dram"  # it has no GPU to put VRAM pools on
    need = pool_bytes(path)
    shm = next(v for v in pod_spec(pod)["volumes"] if v["name"] == "shm")
    assert to_bytes(shm["emptyDir"]["sizeLimit"]) >= need
    assert to_bytes(container["resources"]["limits"]["memory"]) >= need  # /dev/shm pages count against the pod


@pytest.mark.parametrize("where", ["DaemonSet", "Pod"])
def test_every_container_requests_resources_and_every_probe_has_time(where):
    for container in pod_spec(kind(where))["containers"]:
        assert container.get("resources", {}).get("requests"), container["name"]
        for key in ("startupProbe", "readinessProbe", "livenessProbe"):
            if key in container and "exec" in container[key]:
                # `kvsvc health` starts a Python process (about 0.5 s): the default 1 s is too tight.
                assert container[key].get("timeoutSeconds", 1) >= 3, (container["name"], key)


def test_the_disruption_budget_covers_the_daemonset():
    pdb, ds = kind("PodDisruptionBudget"), kind("DaemonSet")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 1


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
    assert {d["kind"] for d in rendered} == {"Namespace", "ConfigMap", "DaemonSet", "Service", "PodDisruptionBudget"}
    assert all(d["metadata"].get("namespace") == "kvsvc" for d in rendered if d["kind"] != "Namespace")
