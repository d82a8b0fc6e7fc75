"""deploy/sglang's engine and router arguments, parsed by SGLang's own parsers (with kvsvc's
plugin registered, as SGLang does before it parses): a flag SGLang does not take, or a value of
the wrong kind, fails here rather than in a pod. (tests/unit/test_deploy_sglang.py checks the
kit's objects; this checks that SGLang accepts what they run.)"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tests.unit.test_deploy_sglang import OBJS, named

pytestmark = pytest.mark.timeout(120)


def _argv(name: str) -> list[str]:
    c = named("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
    data = named("ConfigMap", "sglang-pd")["data"]
    return [a.replace("$(MODEL)", data["MODEL"]).replace("$(TP)", data["TP"]) for a in c["args"]]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_takes_each_engines_arguments(role):
    from sglang.srt.server_args import ServerArgs

    from kvsvc.integrations.sglang import register

    register()  # what SGLang's plugin loading does first in each of its processes
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(_argv(f"sglang-{role}"))
    assert (ns.disaggregation_mode, ns.disaggregation_transfer_backend) == (role, "kvsvc")
    assert ns.tp_size == int(named("ConfigMap", "sglang-pd")["data"]["TP"])
    with pytest.raises(SystemExit):  # the parser refuses what it does not know
        parser.parse_args([*_argv(f"sglang-{role}"), "--disaggregation-transfer-backend=kvsvcc"])


# In a process of its own: sglang_router's native module crashes its interpreter's teardown,
# so the child leaves with os._exit once it printed what the parser made of the arguments.
ROUTER_PARSE = """
import json, os, sys
from sglang_router.launch_router import parse_router_args
r = parse_router_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(r, k) for k in ("pd_disaggregation", "service_discovery", "prefill_selector",
                  "decode_selector", "service_discovery_namespace", "service_discovery_port", "port")}))
sys.stdout.flush()
os._exit(0)
"""


def test_sglang_router_takes_the_routers_arguments():
    c = named("Deployment", "sglang-router")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][-1] == "sglang_router.launch_router"
    done = subprocess.run([sys.executable, "-c", ROUTER_PARSE, json.dumps(c["args"])], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["pd_disaggregation"] and r["service_discovery"]
    assert r["prefill_selector"] == {"app.kubernetes.io/name": "sglang-prefill"}
    assert r["decode_selector"] == {"app.kubernetes.io/name": "sglang-decode"}
    assert (r["service_discovery_namespace"], r["service_discovery_port"], r["port"]) == ("kvsvc", 30000, 8000)
    assert len(OBJS) > 0
