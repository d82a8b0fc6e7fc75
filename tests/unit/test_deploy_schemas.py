"""Every Kubernetes object the kits ship, validated against Kubernetes' own OpenAPI schemas
(the kubernetes-validate package, strict: an unknown field is an error, as
`kubectl apply --validate=strict` makes it), since no cluster is at hand. Rendered the way
the kits are applied (tests/unit/test_deploy_vllm.render: kustomize's features the kits use),
plus the manifests applied on their own. Objects of the Prometheus operator's CRDs are not in
Kubernetes' schemas: their fields are checked by hand below."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.unit.test_deploy_vllm import render

ROOT = Path(__file__).resolve().parents[2]
# The oldest Kubernetes minor still supported upstream when the kits were last checked, and the
# newest the package knows: an object must hold under both.
VERSIONS = ["1.31", "1.37"]
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def shipped() -> list[tuple[str, dict]]:
    out = []
    for kit in (ROOT / "deploy/k8s", ROOT / "deploy/vllm/overlays/cpu", ROOT / "deploy/vllm/overlays/cuda",
                ROOT / "deploy/vllm/overlays/rdma", ROOT / "deploy/sglang"):
        out += [(str(kit.relative_to(ROOT)), o) for o in render(kit)]
    for alone in (ROOT / "deploy/k8s/sidecar.yaml", ROOT / "deploy/k8s/servicemonitor.yaml",
                  ROOT / "deploy/vllm/monitoring/podmonitor.yaml", ROOT / "deploy/sglang/monitoring/podmonitor.yaml",
                  ROOT / "deploy/monitoring/prometheusrule.yaml"):
        out += [(str(alone.relative_to(ROOT)), o) for o in yaml.safe_load_all(alone.read_text()) if o]
    return out


OBJECTS = shipped()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("where", "obj"), [o for o in OBJECTS if o[1]["kind"] not in OPERATOR_KINDS],
                         ids=lambda x: x if isinstance(x, str) else f"{x['kind']}-{x['metadata']['name']}")
def test_every_object_is_valid_against_kubernetes_schemas(where, obj, version):
    kubernetes_validate.validate(obj, version, strict=True)


def test_the_check_can_fail_on_a_misspelt_field_and_a_wrong_type():
    deployment = next(o for _, o in OBJECTS if o["kind"] == "Deployment")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, VERSIONS[0], strict=True)
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, VERSIONS[0], strict=True)


def test_prometheus_operator_objects_name_what_exists():
    operator = [o for _, o in OBJECTS if o["kind"] in OPERATOR_KINDS]
    assert {o["kind"] for o in operator} == OPERATOR_KINDS
    services = {(o["metadata"].get("namespace"), tuple(sorted(o["metadata"].get("labels", {}).items())),
                 tuple(p.get("name") for p in o["spec"].get("ports", [])))
                for _, o in OBJECTS if o["kind"] == "Service"}
    for o in operator:
        assert o["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(o) == {"apiVersion", "kind", "metadata", "spec"}
        if o["kind"] == "ServiceMonitor":
            assert set(o["spec"]) <= {"selector", "endpoints", "namespaceSelector"}
            wanted = o["spec"]["selector"]["matchLabels"].items()
            ports = [e["port"] for e in o["spec"]["endpoints"]]
            assert any(ns == o["metadata"]["namespace"] and set(wanted) <= set(labels) and set(ports) <= set(names)
                       for ns, labels, names in services), "its selector and port match a shipped Service"

        if o["kind"] == "PodMonitor":
            assert set(o["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector"}
            (expr,) = o["spec"]["selector"]["matchExpressions"]
            assert expr["operator"] == "In"
            pods = [d["spec"]["template"] for _, d in OBJECTS if d["kind"] == "Deployment"
                    and d["metadata"].get("namespace") == o["metadata"]["namespace"]
                    and d["spec"]["template"]["metadata"]["labels"].get(expr["key"]) in expr["values"]]
            selected = {p["metadata"]["labels"][expr["key"]] for p in pods}
            assert selected == set(expr["values"])  # each engine it names is shipped
            for pod in pods:
                names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                assert {e["port"] for e in o["spec"]["podMetricsEndpoints"]} <= names


def test_the_prometheus_rule_holds_exactly_the_alert_rules():
    """deploy/monitoring/prometheusrule.yaml is made from alerts.yaml (prometheusrule.py)."""
    (rule,) = [o for _, o in OBJECTS if o["kind"] == "PrometheusRule"]
    alerts = yaml.safe_load((ROOT / "deploy/monitoring/alerts.yaml").read_text())
    assert rule["spec"] == {"groups": alerts["groups"]}
    assert rule["metadata"]["namespace"] == "kvsvc"
