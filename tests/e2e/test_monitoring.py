"""deploy/monitoring against the real thing: promtool checks the alert rules and runs their unit
tests, the Grafana dashboard is well formed, and a real Prometheus scraping real P and D servers
evaluates every rule and panel expression, finds every metric and label they name, and sees the
failure alerts' conditions once transfers fail and leases expire. The connector's half runs
against real vLLM engines in tests/vllm/test_serve.py."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from kvsvc.client import AsyncClient
from kvsvc.errors import FailedPrecondition
from tests.e2e.test_observability import metrics_url, start
from tests.prom import (
    MONITORING,
    alert_rules,
    binary,
    check_exprs_against,
    dashboard_exprs,
    label_names,
    metric_names,
    prometheus,
)


def test_the_checkers_find_names_and_labels():
    expr = ('histogram_quantile(0.99, sum by (engine, le) (rate(kvsvc_transfer_seconds_bucket{phase="a{b}"}[5m])))'
            ' / on (engine) group_left sum without (x) (vllm:kvsvc_x_total offset 5m) > bool 1')
    assert metric_names(expr) == {"kvsvc_transfer_seconds_bucket", "vllm:kvsvc_x_total"}
    assert label_names(expr) == {"engine", "le", "phase", "x"}


def test_promtool_accepts_the_rules_and_their_unit_tests_pass():
    promtool = binary("promtool")
    for argv in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        out = subprocess.run([promtool, *argv], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboard_is_well_formed():
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"] for t in panel["targets"]), panel["title"]
    # No two panels overlap.
    cells = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine


def server_exprs() -> list[str]:
    return [r["expr"] for r in alert_rules("kvsvc-server")] + [e for e in dashboard_exprs() if "vllm:" not in e]


async def test_rules_and_panels_against_a_real_scrape(tmp_path):
    p, d = start("mon-p", "prefill", tmp_path), start("mon-d", "decode", tmp_path)
    try:
        targets = [metrics_url(s).removeprefix("http://").removesuffix("/metrics") for s in (p, d)]
        with prometheus({"kvsvc": targets}, tmp_path) as prom:
            async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
                # Two rounds, a scrape after each: rate() sees a counter grow only between samples.
                for i in range(2):
                    pub = await pc.publish_blocks(f"ok{i}", [[1 + i, 5 + i]])
                    await dc.transfer(f"d-ok{i}", pub.params, [[10 + i, 20 + i]])
                    short = await pc.publish_blocks(f"short{i}", [[9 + i]], lease_ttl_ms=200)
                    await asyncio.sleep(0.6)
                    with pytest.raises(FailedPrecondition):
                        await dc.transfer(f"d-short{i}", short.params, [[30 + i]])
                    await asyncio.to_thread(prom.wait_scrapes, 2)
            check_exprs_against(prom, server_exprs())
            rules = {r["alert"]: r["expr"] for r in alert_rules("kvsvc-server")}
            # Half the transfers failed and two leases expired: those alerts' conditions hold...
            failing = prom.query(rules["KvsvcTransferFailures"])
            assert [r["metric"]["engine"] for r in failing] == ["mon-d"], failing
            expiring = prom.query(rules["KvsvcLeasesExpire"])
            assert [r["metric"]["engine"] for r in expiring] == ["mon-p"], expiring
            # ...and those of the others do not.
            for quiet in ("KvsvcServerDown", "KvsvcDataPlaneErrors", "KvsvcHandshakeFailures", "KvsvcSlowTransfers",
                          "KvsvcQuarantinedTransfers", "KvsvcTransportDegraded", "KvsvcRdmaUnavailable"):
                assert prom.query(rules[quiet]) == [], quiet
    finally:
        p.stop()
        d.stop()
