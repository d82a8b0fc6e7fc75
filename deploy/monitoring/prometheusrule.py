"""Write prometheusrule.yaml: alerts.yaml's rules as a Prometheus operator PrometheusRule.

    python deploy/monitoring/prometheusrule.py

alerts.yaml stays the one place the rules are written (promtool checks it, alerts_test.yaml
tests it); run this after changing it (tests/unit/test_deploy_schemas.py fails until then).
"""

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
HEAD = """\
# deploy/monitoring/alerts.yaml's rules as a Prometheus operator object (not in a
# kustomization: apply it where the CRD exists, e.g. kubectl apply -f this file).
# Written by deploy/monitoring/prometheusrule.py from alerts.yaml: change that, then run it.
"""


def main() -> None:
    groups = yaml.safe_load((HERE / "alerts.yaml").read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "kvsvc", "namespace": "kvsvc", "labels": {"app.kubernetes.io/name": "kvsvc"}},
            "spec": {"groups": groups}}
    (HERE / "prometheusrule.yaml").write_text(HEAD + yaml.safe_dump(rule, sort_keys=False, width=120))


if __name__ == "__main__":
    main()
