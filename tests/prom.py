"""A real Prometheus (Debian's build, unpacked by `make prometheus` into .prometheus/) scraping
live servers, and what the checks of deploy/monitoring need from PromQL: the metric names and
label names an expression uses. The parsing here is the tests' own, not kvsvc's."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.procs import stop

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
_UNPACKED = ROOT / ".prometheus" / "root" / "usr" / "bin"


def binary(name: str) -> str:
    """prometheus or promtool: from .prometheus/ (make prometheus) or PATH; skips the test where
    neither has it, unless KVSVC_REQUIRE_PROMETHEUS is set (CI), where it fails."""
    path = _UNPACKED / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        message = f"{name} is not installed: `make prometheus` unpacks Debian's build into .prometheus/"
        if os.environ.get("KVSVC_REQUIRE_PROMETHEUS"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def alert_rules(group: str) -> list[dict]:
    groups = yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"]
    return next(g for g in groups if g["name"] == group)["rules"]


def dashboard_exprs() -> list[str]:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


# Words of PromQL that are not metric names when not followed by "(".
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (identifiers that are neither functions nor
    keywords, outside label matchers, groupings and durations)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def label_names(expr: str) -> set[str]:
    """Labels an expression matches on or groups by."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set()
    for m in re.finditer(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(1)))
    for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    return labels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """An instant query; raises on a PromQL error."""
        qs = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def series_labels(self, name: str) -> set[str]:
        qs = urllib.parse.urlencode({"match[]": name})
        with urllib.request.urlopen(f"{self.url}/api/v1/series?{qs}", timeout=10) as r:
            return {k for s in json.loads(r.read())["data"] for k in s}

    def scrapes(self) -> float:
        """Samples of `up` scraped so far over every target."""
        result = self.query("sum(count_over_time(up[1h]))")
        return float(result[0]["value"][1]) if result else 0.0

    def wait_scrapes(self, more: int, timeout_s: float = 30) -> None:
        """Until every target has been scraped `more` more times."""
        targets = max(1, len(self.query("up")))
        goal = self.scrapes() + more * targets
        deadline = time.monotonic() + timeout_s
        while self.scrapes() < goal:
            assert time.monotonic() < deadline, "Prometheus did not scrape in time"
            time.sleep(0.25)


@contextmanager
def prometheus(targets: dict[str, list[str]], tmp_path: Path) -> Iterator[Prometheus]:
    """A Prometheus scraping each job's host:port targets every second."""
    exe = binary("prometheus")
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = _free_port()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
                time.sleep(0.2)
        prom.wait_scrapes(1)
        yield prom
    finally:
        stop(proc)
        log.close()


def check_exprs_against(prom: Prometheus, exprs: list[str]) -> None:
    """Each expression is valid PromQL to a real Prometheus, and every metric and label it
    names exists in what that Prometheus scraped."""
    for expr in exprs:
        prom.query(expr.replace("$__rate_interval", "1m"))
        names = metric_names(expr)
        assert names, expr
        labels: set[str] = set()
        for name in names:
            got = prom.series_labels(name)
            assert got, f"{name} (in {expr!r}) is in no series scraped"
            labels |= got
        missing = label_names(expr) - labels - {"__name__"}
        assert not missing, f"labels {missing} of {expr!r} are on none of {sorted(names)}"
