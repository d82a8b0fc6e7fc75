"""deploy/sglang holds together: it renders (kubectl kustomize agrees with the renderer the
vLLM kit's checks use), P and D run on GPUs of their own with the kvsvc backend and the same
model and TP from one ConfigMap, every KVSVC_SGLANG_* setting is one the backend takes, the
router finds the pods it should (labels, the bootstrap port's annotation, the API port, a
Role to watch pods), and the image installs what the manifests run. Schemas:
tests/unit/test_deploy_schemas.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from kvsvc.config import server_settings
from kvsvc.integrations.settings import EngineSettings
from tests.unit.test_deploy_vllm import render

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "deploy" / "sglang"
OBJS = render(KIT)


def named(kind: str, name: str) -> dict:
    return next(o for o in OBJS if o["kind"] == kind and o["metadata"]["name"] == name)


def engine(role: str) -> dict:
    return named("Deployment", f"sglang-{role}")["spec"]["template"]


def args_of(role: str) -> dict[str, str]:
    c = engine(role)["spec"]["containers"][0]
    return dict(a[2:].split("=", 1) for a in c["args"])


def test_the_kit_renders_the_objects_expected_in_one_namespace():
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in OBJS)
    assert kinds == sorted([("Namespace", "kvsvc"), ("ConfigMap", "sglang-pd"), ("ConfigMap", "sglang-kvsvc"),
                            ("NetworkPolicy", "sglang-engines"),
                            ("ServiceAccount", "sglang-router"), ("Role", "sglang-router"),
                            ("RoleBinding", "sglang-router"), ("Service", "sglang-router"),
                            *[(k, f"sglang-{r}") for r in ("prefill", "decode", "router")
                              for k in ("Deployment", "PodDisruptionBudget")]])
    assert all(o["metadata"]["namespace"] == "kvsvc" for o in OBJS if o["kind"] != "Namespace")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_engine_runs_the_kvsvc_backend_on_gpus_of_its_own(role):
    a = args_of(role)
    assert a["disaggregation-mode"] == role and a["disaggregation-transfer-backend"] == "kvsvc"
    assert a["model-path"] == "$(MODEL)" and a["tp-size"] == "$(TP)"  # one place: the ConfigMap
    pod = engine(role)["spec"]
    c = pod["containers"][0]
    tp = int(named("ConfigMap", "sglang-pd")["data"]["TP"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == tp  # a pod's own GPUs: P and D never share one
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(a["port"]) and ports["kvsvc-0"] == 50051 and ports["metrics-0"] == 9400
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    env = {e["name"]: e.get("value", "from-field") for e in c["env"]}
    env |= {k: str(v) for k, v in named("ConfigMap", "sglang-pd")["data"].items() if k.startswith("KVSVC_")}
    settings = EngineSettings.from_environment(env, "KVSVC_SGLANG_")  # strict: a misspelt key raises
    assert (settings.listen_host, settings.listen_port) == ("0.0.0.0", 50051)
    assert env["KVSVC_SGLANG_ADVERTISE_HOST"] == "$(POD_IP)" == env["SGLANG_HOST_IP"]
    # The settings file the backend reads is mounted where the setting says, and kvsvc takes it.
    mount = next(m for m in c["volumeMounts"] if m["name"] == "kvsvc-config")
    volume = next(v for v in pod["volumes"] if v["name"] == "kvsvc-config")
    path = Path(settings.config)
    assert str(path.parent) == mount["mountPath"]
    toml = named("ConfigMap", volume["configMap"]["name"])["data"][path.name]
    server = server_settings("kvsvc.toml", tomllib.loads(toml)["server"])  # strict, as the server reads it
    assert server["metrics_listen"].endswith(f":{ports['metrics-0']}")


def test_the_router_finds_p_d_and_ps_bootstrap_port():
    router = named("Deployment", "sglang-router")["spec"]["template"]["spec"]
    argv = router["containers"][0]["args"]
    opts = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")
            and not argv[i + 1].startswith("--")}
    assert "--pd-disaggregation" in argv and "--service-discovery" in argv
    for role in ("prefill", "decode"):
        key, value = opts[f"--{role}-selector"].split("=")
        assert engine(role)["metadata"]["labels"][key] == value
        assert opts["--service-discovery-port"] == args_of(role)["port"]
    p = engine("prefill")
    bootstrap = p["metadata"]["annotations"]["sglang.ai/bootstrap-port"]
    assert bootstrap == args_of("prefill")["disaggregation-bootstrap-port"]
    assert {"name": "bootstrap", "containerPort": int(bootstrap)} in p["spec"]["containers"][0]["ports"]
    assert opts["--service-discovery-namespace"] == "kvsvc"
    rules = named("Role", "sglang-router")["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)
    binding = named("RoleBinding", "sglang-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router["serviceAccountName"],
                                    "namespace": "kvsvc"}]


def test_only_the_kits_pods_reach_the_engines_other_ports():
    policy = named("NetworkPolicy", "sglang-engines")["spec"]
    ours, anyone = policy["ingress"]
    assert ours["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvsvc-sglang"}}}]
    assert "from" not in anyone and {p["port"] for p in anyone["ports"]} == {"http", "metrics-0"}
    for role in ("prefill", "decode"):
        assert engine(role)["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvsvc-sglang"


def test_the_image_installs_what_the_manifests_run():
    text = (KIT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python3", "-m", "sglang.launch_server"]' in text
    assert '".[sglang]"' in text and "nixl==1.5.1" in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "sglang" in extras
    assert {"30000", "8998", "50051", "9400"} <= set(re.findall(r"^EXPOSE (.+)$", text, re.M)[0].split())
    for o in OBJS:
        for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert c["image"] == "kvsvc-sglang:cuda"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_what_the_checks_saw():
    out = subprocess.run(["kubectl", "kustomize", str(KIT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda d: (d["kind"], d["metadata"]["name"]))
    assert real == sorted(OBJS, key=lambda d: (d["kind"], d["metadata"]["name"]))
