"""Transport honesty with real servers: D says which UCX transport its READs from each P
really use (GetInfo's TransportInfo.peers, kvsvc_peer_read_transport), and a READ within
one node that UCX serves over TCP is reported TRANSPORT_DEGRADED (the silent downgrade
vLLM #51377 found on NVL72), while the bytes still arrive right."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsvc.cli.procs import ServerProcess, start_server
from tests.e2e.harness import layout_table, session, transfer_and_check
from tests.e2e.test_observability import metrics_url, scrape, value

LAYOUT = layout_table(k=4)


def start(engine: str, role: str, tmp_path, env: dict[str, str] | None = None) -> ServerProcess:
    cfg = tmp_path / f"{engine}.toml"
    cfg.write_text('[server]\nmetrics_listen = "127.0.0.1:0"\n')
    return start_server(engine_id=engine, role=role, tp_size=1, layout=LAYOUT, config_file=str(cfg), extra_env=env)


async def moved_and_seen(p: ServerProcess, d: ServerProcess):
    """One transfer checked byte for byte, then D's and P's GetInfo."""
    async with session(p, d) as s:
        await transfer_and_check(s, "honest-1", [[1, 2, 3]], [[7, 8, 9]])
        return await s.dc.get_info(), await s.pc.get_info()


async def test_reads_within_the_node_name_their_shared_memory_transport(tmp_path):
    p, d = start("th-p", "prefill", tmp_path), start("th-d", "decode", tmp_path)
    try:
        d_info, p_info = await moved_and_seen(p, d)
        assert d_info.transport.node_id and d_info.transport.node_id == p_info.transport.node_id
        [peer] = d_info.transport.peers
        assert (peer.address, peer.engine_id, peer.locality) == (p.address, "th-p", "intra-node")
        assert peer.read_transports and not any(t.startswith("tcp/") for t in peer.read_transports), peer
        assert peer.warning_reason == "" and peer.warning == ""
        ds = scrape(metrics_url(d))
        for t in peer.read_transports:
            assert value(ds, "kvsvc_peer_read_transport", engine="th-d", peer_engine="th-p", transport=t,
                         degraded="false") == 1
        assert value(ds, "kvsvc_transport_degraded_peers", engine="th-d") == 0
        assert not p_info.transport.peers  # P reads nothing
    finally:
        p.stop()
        d.stop()


async def test_tcp_within_the_node_is_reported_degraded_and_the_bytes_still_arrive(tmp_path):
    """Both servers limited to UCX's TCP transport, as a container without shared memory
    (or with it hidden) ends up: D says so instead of running slow without a word."""
    tcp_only = {"UCX_TLS": "tcp,self"}
    p = start("tcp-p", "prefill", tmp_path, tcp_only)
    d = start("tcp-d", "decode", tmp_path, tcp_only)
    try:
        d_info, _ = await moved_and_seen(p, d)
        [peer] = d_info.transport.peers
        assert peer.locality == "intra-node" and any(t.startswith("tcp/") for t in peer.read_transports), peer
        assert peer.warning_reason == "TRANSPORT_DEGRADED" and "over TCP" in peer.warning, peer
        ds = scrape(metrics_url(d))
        tcp = next(t for t in peer.read_transports if t.startswith("tcp/"))
        assert value(ds, "kvsvc_peer_read_transport", engine="tcp-d", peer_engine="tcp-p", transport=tcp,
                     degraded="true") == 1
        assert value(ds, "kvsvc_transport_degraded_peers", engine="tcp-d") == 1
    finally:
        p.stop()
        d.stop()
    assert any("TRANSPORT_DEGRADED" in line and p.address in line for line in d.output), d.output[-20:]


def test_a_server_that_requires_rdma_where_there_is_none_says_so_at_start():
    import urllib.request

    from kvsvc.cli.info import format_info
    from kvsvc.client import AsyncClient
    from kvsvc.config import Role, load_config
    from kvsvc.service.server import create_server
    from tests.e2e.harness import layout_table

    if any(Path("/sys/class/infiniband").glob("*")):
        pytest.skip("this machine has an RDMA device: the check has nothing to report")

    async def run() -> None:
        server, _ = await create_server(load_config(
            listen="127.0.0.1:0", tp_size=1, engine_id="rdma-d", role=Role.DECODE, layout_table=layout_table(),
            require_rdma_between_nodes=True, metrics_listen="127.0.0.1:0"))
        try:
            async with AsyncClient(f"127.0.0.1:{server.port}") as c:
                whole = await c.get_info()
            info = whole.transport
            assert list(info.rdma_devices) == [] and "no RDMA device" in info.rdma_unavailable_reason
            assert "rdma        devices none  TRANSPORT_DEGRADED: require_rdma_between_nodes" in format_info(whole)
            url = f"http://{server.metrics_address}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
            assert 'kvsvc_rdma_unavailable{engine="rdma-d"} 1.0' in text
        finally:
            await server.stop(0)

    asyncio.run(run())
