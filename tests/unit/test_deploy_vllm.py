"""deploy/vllm holds together: both overlays render (with a small renderer of the kustomize
features they use: resources, namespace, images, JSON 6902 patches), and in the rendered
objects ports, probes, TLS paths, services, disruption budgets and GPU requests agree with the
connector config each engine runs. The connector and vLLM accept that config and those
arguments: tests/vllm/test_deploy_args.py."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from kvsvc.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "deploy" / "vllm"
OVERLAYS = ["cpu", "cuda"]
CLUSTER_SCOPED = {"Namespace"}  # the cluster-scoped kinds the kits ship


def _pointer(doc, path: str):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc, parts[-1]


def _apply(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        parent, key = _pointer(doc, op["path"])
        if op["op"] == "add" and isinstance(parent, list):
            parent.append(op["value"]) if key == "-" else parent.insert(int(key), op["value"])
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace":
                assert (int(key) < len(parent)) if isinstance(parent, list) else key in parent, op["path"]
            parent[int(key) if isinstance(parent, list) else key] = op["value"]
        else:
            raise AssertionError(f"op {op['op']} is not used by the kit")


def render(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        objs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for image in k.get("images", []):
        for obj in objs:
            for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in k.get("patches", []):
        target, hits = patch["target"], 0
        for obj in objs:
            if obj["kind"] == target["kind"] and re.fullmatch(target["name"], obj["metadata"]["name"]):
                _apply(obj, yaml.safe_load(patch["patch"]))
                hits += 1
        assert hits, f"patch target {target} matches nothing"
    if "namespace" in k:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:  # kustomize leaves those without one
                obj["metadata"]["namespace"] = k["namespace"]
    return objs


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(KIT / "overlays" / request.param)


def named(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def engine_args(objs: list[dict], role: str) -> dict[str, str]:
    c = named(objs, "Deployment", f"vllm-{role}")["spec"]["template"]["spec"]["containers"][0]
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in c["args"])


def transfer_config(objs: list[dict], role: str) -> dict:
    return json.loads(engine_args(objs, role)["kv-transfer-config"])


def test_both_overlays_render_the_same_objects(rendered):
    variant, objs = rendered
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([("Namespace", "kvsvc"), ("ConfigMap", "vllm-pd"),
                            *[(k, f"vllm-{r}") for r in ("prefill", "decode", "router")
                              for k in ("Deployment", "Service", "PodDisruptionBudget")]])
    assert all(o["metadata"].get("namespace") == "kvsvc" for o in objs if o["kind"] != "Namespace")
    for o in objs:
        if o["kind"] == "Deployment":
            assert o["spec"]["template"]["spec"]["containers"][0]["image"] == f"kvsvc-vllm:{variant}"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_engine_runs_kvsvc_with_a_consistent_config(rendered, role):
    _, objs = rendered
    dep = named(objs, "Deployment", f"vllm-{role}")
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    ktc = transfer_config(objs, role)
    assert ktc["kv_connector"] == "KvsvcConnector" and ktc["kv_connector_module_path"] == "kvsvc.integrations.vllm"
    assert ktc["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert ktc["engine_id"] == "$(POD_NAME)"  # the name its certificate carries
    extra = ktc["kv_connector_extra_config"]
    env = {e["name"] for e in c["env"]}
    for ref in re.findall(r"\$\((\w+)\)", json.dumps(ktc) + " ".join(c["args"])):
        cm = named(objs, "ConfigMap", "vllm-pd")["data"]
        assert ref in env or ref in cm, f"$({ref}) is defined nowhere"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    tp = int(named(objs, "ConfigMap", "vllm-pd")["data"]["TP"])
    assert [ports[f"kvsvc-{r}"] for r in range(tp)] == [extra["listen_port"] + r for r in range(tp)]
    assert extra["listen_host"] == "0.0.0.0" and extra["advertise_host"] == "$(POD_IP)"
    assert int(engine_args(objs, role)["port"]) == ports["http"]
    # TLS: every file the connector reads lies in the tls mount, which is the cert-manager volume.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "peer_tls_ca_file"):
        assert extra[key].startswith(mounts["tls"] + "/"), key
    tls = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert tls["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"] == "${POD_NAME}"
    assert c["resources"]["requests"]
    # Ready only when vLLM answers and rank 0's kvsvc server does, over the engine's own mTLS identity.
    ready = c["readinessProbe"]
    assert ready["timeoutSeconds"] >= 5
    script = ready["exec"]["command"][2]
    http, health = script.split(" && exec ")
    assert f"127.0.0.1:{ports['http']}/health" in http and "-m" in http.split()  # curl with its own time limit
    argv = shlex.split(health.replace('"$POD_NAME"', "prefill-0"))
    args = build_parser().parse_args(argv[1:])
    assert argv[0] == "kvsvc" and args.func.__name__ == "_health"
    assert args.address == f"127.0.0.1:{extra['listen_port']}"
    assert (args.ca, args.cert, args.key) == (extra["peer_tls_ca_file"], extra["tls_cert_file"], extra["tls_key_file"])
    assert args.timeout < ready["timeoutSeconds"]
    for key in ("startupProbe", "livenessProbe"):
        assert c[key]["httpGet"]["port"] == "http" and c[key]["timeoutSeconds"] >= 3


def test_p_outlives_its_leases_and_d_heartbeats_them_in_time(rendered):
    _, objs = rendered
    p_extra = transfer_config(objs, "prefill")["kv_connector_extra_config"]
    d_extra = transfer_config(objs, "decode")["kv_connector_extra_config"]
    grace = named(objs, "Deployment", "vllm-prefill")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > p_extra["lease_ttl_s"]
    assert 0 < d_extra["lease_heartbeat_s"] < p_extra["lease_ttl_s"] / 3


def test_the_router_reaches_both_engines_through_their_services(rendered):
    _, objs = rendered
    c = named(objs, "Deployment", "vllm-router")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python3", "-m", "kvsvc.integrations.vllm.router"]
    assert (ROOT / "kvsvc/integrations/vllm/router.py").exists()
    args = c["args"]
    for role in ("prefill", "decode"):
        url = args[args.index(f"--{role}") + 1]
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", url).groups()
        svc = named(objs, "Service", host)
        assert any(p["port"] == int(port) for p in svc["spec"]["ports"])
        dep = named(objs, "Deployment", host)
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["resources"]["requests"]


def test_every_pod_has_a_disruption_budget(rendered):
    _, objs = rendered
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        pdb = named(objs, "PodDisruptionBudget", dep["metadata"]["name"])
        assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_gpu_engines_get_their_gpus_and_cpu_engines_a_bounded_kv_cache(rendered):
    variant, objs = rendered
    tp = int(named(objs, "ConfigMap", "vllm-pd")["data"]["TP"])
    for role in ("prefill", "decode"):
        spec = named(objs, "Deployment", f"vllm-{role}")["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        gpus = int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        if variant == "cuda":
            assert gpus == tp and "hostIPC" not in spec  # CUDA IPC does not cross pods: nothing to share
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        else:
            assert gpus == 0 and "--enforce-eager" in c["args"]
            kv = int(env["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
            limit = c["resources"]["limits"]["memory"]
            assert limit.endswith("Gi") and kv < int(limit[:-2]) * 2**30  # vLLM's default would take the node
            assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_the_image_installs_what_the_manifests_run():
    text = (KIT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
    assert 'ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]' in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert '".[vllm]"' in text and "vllm" in extras
    assert set(re.findall(r"AS base-(\w+)", text)) == set(OVERLAYS)
    assert {"8000", "50051"} <= set(re.findall(r"^EXPOSE (.+)$", text, re.M)[0].split())
    assert "nixl==1.5.1" in text


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("variant", OVERLAYS)
def test_kustomize_renders_what_the_checks_saw(variant):
    out = subprocess.run(["kubectl", "kustomize", str(KIT / "overlays" / variant)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    real = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda d: (d["kind"], d["metadata"]["name"]))
    ours = sorted(render(KIT / "overlays" / variant), key=lambda d: (d["kind"], d["metadata"]["name"]))
    assert real == ours


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_run_unprivileged_with_a_model_cache_a_token_and_spread_over_nodes(rendered, role):
    variant, objs = rendered
    spec = named(objs, "Deployment", f"vllm-{role}")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if variant == "cuda" else [])
    assert "memory" in c["resources"]["limits"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    cache = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")
    assert env["HF_HOME"]["value"].startswith(cache["mountPath"] + "/")
    assert any(v["name"] == "model-cache" for v in spec["volumes"])
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"


def test_the_rdma_overlay_is_the_cuda_one_with_the_nics_and_rdma_required():
    """overlays/rdma: each engine gets the RDMA device plugin's resource and its connector
    config requires RDMA between nodes; nothing else differs from overlays/cuda (the config
    was copied into the patch: a change to the base's shows here as a difference)."""
    from kvsvc.integrations.settings import EngineSettings

    cuda = sorted(render(KIT / "overlays" / "cuda"), key=lambda d: (d["kind"], d["metadata"]["name"]))
    rdma = sorted(render(KIT / "overlays" / "rdma"), key=lambda d: (d["kind"], d["metadata"]["name"]))
    assert [(o["kind"], o["metadata"]["name"]) for o in rdma] == [(o["kind"], o["metadata"]["name"]) for o in cuda]
    for before, after in zip(cuda, rdma, strict=True):
        if before["kind"] != "Deployment" or before["metadata"]["name"] == "vllm-router":
            assert before == after
            continue
        role = before["metadata"]["name"].removeprefix("vllm-")
        was, now = transfer_config([before], role), transfer_config([after], role)
        assert now["kv_connector_extra_config"].pop("require_rdma_between_nodes") is True
        assert now == was
        EngineSettings.from_mapping(transfer_config([after], role)["kv_connector_extra_config"], "rdma")  # strict
        limits = after["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits.pop("rdma/rdma_shared_device_a") == 1
        after_c = after["spec"]["template"]["spec"]["containers"][0]
        before_c = before["spec"]["template"]["spec"]["containers"][0]
        assert {k: v for k, v in after_c.items() if k != "args"} == {k: v for k, v in before_c.items() if k != "args"}
