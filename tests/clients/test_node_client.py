"""The Node.js client performs a real transfer against live servers, and sees the same errors."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from kvsvc.client import AsyncClient
from tests.e2e.harness import Engine, layout_table, servers

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed (the Node client test needs `node`)")


async def run_node(*args: str) -> tuple[int, str, str]:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node/node_modules is missing: `make node` (or `make test`) installs it")
    proc = await asyncio.create_subprocess_exec(NODE, *args, cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_node_transfer_and_lease_expired():
    layout = layout_table(k=4)
    with servers(2, 1, layout) as (p, d):
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            try:
                pe.fill([[3, 1, 4]])
                rc, out, err = await run_node("examples/transfer.js", p.address, d.address, "3,1,4", "5,9,2")
                assert rc == 0, err
                summary = json.loads(out.strip().splitlines()[-1])
                assert summary["prefill"]["tp_size"] == 2 and summary["decode"]["tp_size"] == 1
                assert summary["lease_epoch"] == str(pe.info.epoch)  # uint64 arrives as a string
                assert summary["plan"]["sources"] == [[0, 1]]
                assert int(summary["transfer"]["total_bytes"]) == int(summary["plan"]["total_bytes"]) > 0
                assert not de.check([[5, 9, 2]]), "the bytes Node asked for arrived"
                assert summary["settled"] == "TRANSFER_STATE_SUCCEEDED"
                error = summary["second_transfer_error"]
                assert error["code"] == "FAILED_PRECONDITION" and error["reason"] == "LEASE_EXPIRED"
                assert error["metadata"]["request_id"] == "node-req-1"
            finally:
                pe.close()
                de.close()
