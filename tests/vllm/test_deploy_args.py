"""vLLM and kvsvc's connector accept what deploy/vllm runs: each engine's command line, with
the kubelet's $(VAR) expansion, parses with vLLM's own server parser into the transfer config
the connector expects, and the connector's start-up check accepts its extra config."""

from __future__ import annotations

import re

import pytest

from kvsvc.integrations.vllm.connector import _checked_extra
from tests.unit.test_deploy_vllm import KIT, OVERLAYS, named, render

POD = {"POD_NAME": "vllm-prefill-7d9c-x2k4q", "POD_IP": "10.1.0.7"}


def vllm_parser():
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # where older vLLMs kept it
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("variant", OVERLAYS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_and_the_connector_accept_the_engine_command_line(variant, role):
    objs = render(KIT / "overlays" / variant)
    values = {**named(objs, "ConfigMap", "vllm-pd")["data"], **POD}
    c = named(objs, "Deployment", f"vllm-{role}")["spec"]["template"]["spec"]["containers"][0]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in c["args"]]
    args = vllm_parser().parse_args(argv)
    assert args.model == values["MODEL"] and args.tensor_parallel_size == int(values["TP"])
    ktc = args.kv_transfer_config
    assert ktc.kv_connector == "KvsvcConnector" and ktc.kv_connector_module_path == "kvsvc.integrations.vllm"
    assert ktc.kv_role == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert ktc.engine_id == POD["POD_NAME"]
    extra = _checked_extra(dict(ktc.kv_connector_extra_config))
    assert extra.advertise_host == POD["POD_IP"] and extra.listen_port == 50051
