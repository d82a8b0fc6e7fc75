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
                assert error["is_lease_expired"] is True  # the client's REASONS, from the proto's ErrorReason
                # On one TransferStream: two good transfers, and the consumed lease's own error.
                good, good2, expired = summary["stream"]
                assert good == good2 == {"total_bytes": summary["transfer"]["total_bytes"]}
                assert expired == {"code": "FAILED_PRECONDITION", "reason": "LEASE_EXPIRED"}
            finally:
                pe.close()
                de.close()


async def run_node_in(cwd: Path, code: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(NODE, "-e", code, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_packed_package_installs_and_carries_its_protos(tmp_path):
    """npm pack -> npm install the tarball in an empty project -> require it by name and call
    a live server: the package works outside this repository, with the .proto it carries."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    pack = await asyncio.create_subprocess_exec(npm, "pack", "--silent", "--pack-destination", str(tmp_path),
                                                cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE)
    tarball = tmp_path / (await pack.communicate())[0].decode().strip().splitlines()[-1]
    assert pack.returncode == 0 and tarball.exists()
    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text('{"name": "app", "version": "1.0.0"}')
    install = await asyncio.create_subprocess_exec(npm, "install", "--prefer-offline", "--no-audit", "--no-fund",
                                                   "--loglevel=error", str(tarball), cwd=app)
    assert await asyncio.wait_for(install.wait(), 300) == 0
    layout = layout_table(k=4)
    with servers(1, 1, layout) as (p, _d):
        rc, out, err = await run_node_in(app, (
            "const k = require('kvsvc-client');"
            f"const c = new k.KvsvcClient('{p.address}');"
            "c.getInfo().then((i) => { console.log(JSON.stringify({engine: i.engine_id, proto: k.PROTO_ROOT}));"
            " c.close(); }).catch((e) => { console.error(e); process.exit(1); });"))
    assert rc == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["engine"] == "e2e-prefill"
    assert Path(got["proto"]).resolve().is_relative_to((app / "node_modules" / "kvsvc-client").resolve())
    # The example the package ships, run from where npm put it: a whole transfer, byte for byte.
    example = app / "node_modules" / "kvsvc-client" / "examples" / "transfer.js"
    with servers(1, 1, layout) as (p, d):
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            try:
                pe.fill([[2, 7]])
                node = await asyncio.create_subprocess_exec(NODE, str(example), p.address, d.address, "2,7", "6,1",
                                                            cwd=app, stdout=asyncio.subprocess.PIPE,
                                                            stderr=asyncio.subprocess.PIPE)
                out_b, err_b = await asyncio.wait_for(node.communicate(), 120)
                assert node.returncode == 0, err_b.decode()
                summary = json.loads(out_b.decode().strip().splitlines()[-1])
                assert summary["settled"] == "TRANSFER_STATE_SUCCEEDED"
                assert not de.check([[6, 1]]), "the bytes the packed example asked for arrived"
            finally:
                pe.close()
                de.close()


async def test_only_idempotent_calls_are_retried_and_only_when_no_server_answered():
    """Against an address nothing listens on: GetInfo and Transfer are retried `retries`
    times, PublishBlocks never; a server's own error is never retried."""
    code = """
const k = require('./kvsvc');
const seen = [];
const c = new k.KvsvcClient(process.argv[1], { retries: 2, backoffMs: 5, timeoutMs: 5000,
                                              onRetry: (rpc, attempt) => seen.push(`${rpc}#${attempt}`) });
(async () => {
  const out = {};
  for (const call of ['getInfo', 'transfer', 'publishBlocks']) {
    try { await c[call]({ request_id: 'r' }); out[call] = 'ok'; } catch (e) { out[call] = e.code; }
  }
  console.log(JSON.stringify({ out, seen, answered: process.argv[2] }));
  c.close();
})();
"""
    layout = layout_table(k=4)
    with servers(1, 1, layout) as (p, _d):
        dead = f"127.0.0.1:{_free_port()}"
        results = []
        for address in (dead, p.address):
            proc = await asyncio.create_subprocess_exec(NODE, "-e", code, address, address, cwd=NODE_DIR,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, err.decode()
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    unreachable, live = results
    assert unreachable["out"] == {"getInfo": "UNAVAILABLE", "transfer": "UNAVAILABLE", "publishBlocks": "UNAVAILABLE"}
    assert unreachable["seen"] == ["GetInfo#1", "GetInfo#2", "Transfer#1", "Transfer#2"]
    # The P server answers: GetInfo works, Transfer is refused by it (a prefill server), no retry.
    assert live["out"]["getInfo"] == "ok" and live["out"]["transfer"] not in ("ok", "UNAVAILABLE")
    assert live["seen"] == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_node_opens_commits_and_waits_on_a_progressive_lease():
    """CommitBlocks and WaitCommit from Node.js against a live P server; the consumed claim
    over the final blocks, from Python, releases the lease the Node client grew."""
    from kvsvc.leases.records import blocks_digest
    from kvsvc.v1 import kv_transfer_pb2 as pb

    with servers(1, 1, layout_table(k=4)) as (p, _d):
        rc, out, err = await run_node("examples/progressive.js", p.address)
        assert rc == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["progressive"] is True and got["next_epoch"] == 2
        assert [[int(b) for b in g] for g in got["next_blocks"]] == [[5]]
        assert got["out_of_order"] == {"code": "FAILED_PRECONDITION", "reason": "COMMIT_OUT_OF_ORDER", "typed": True}
        assert got["final_epoch"] == 3 and got["tail_final"] is True
        assert [[int(b) for b in g] for g in got["tail_blocks"]] == [[6]]
        async with AsyncClient(p.address) as pc:
            done = await pc.claim_lease(pb.ClaimLeaseRequest(
                request_id="node-grow", lease_epoch=int(got["lease_epoch"]), engine_id="node-d", tp_size=1,
                lease_token=got["lease_token"], claim_id=got["claim_id"], consumed=True,
                blocks_digest=blocks_digest([[1, 2, 5, 6]], 16)))
            assert done.state == pb.LEASE_STATE_CONSUMED
            assert (await pc.get_info()).live_leases == 0
