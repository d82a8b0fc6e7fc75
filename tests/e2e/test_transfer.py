"""Real P -> D transfers between server processes, checked byte for byte against the reference."""

from __future__ import annotations

import pytest

from tests.e2e.harness import layout_table, leases_drained, servers, session, transfer_and_check

CASES = [
    pytest.param(2, 2, layout_table(k=4), id="equal-tp2"),
    pytest.param(1, 2, layout_table(k=4), id="d-gt-p"),
    pytest.param(2, 1, layout_table(k=4), id="p-gt-d-gqa"),
    pytest.param(2, 1, layout_table(mla=True, head=8), id="mla-p-gt-d"),
]


@pytest.mark.parametrize(("p_tp", "d_tp", "layout"), CASES)
async def test_transfer_matches_reference(p_tp, d_tp, layout):
    with servers(p_tp, d_tp, layout) as (p, d):
        async with session(p, d) as s:
            resp = await transfer_and_check(s, "req-a", [[5, 9, 2, 11]], [[0, 3, 4, 7]])
            assert resp.total_bytes > 0 and len(resp.ranks) == d_tp
            # A second request reuses the cached handshake and different blocks.
            await transfer_and_check(s, "req-b", [[1, 2, 3]], [[10, 11, 12]])
            # GetInfo names the transport UCX picked for READs (cma between processes here).
            transports = (await s.dc.get_info()).transport.ucx_transports
            assert any(t.startswith("rma_get:") for t in transports), transports


async def test_a_both_server_transfers_from_itself():
    """The default `kvsvc serve` is role both: it may be P and D of one request (NIXL reads between its own agents)."""
    from kvsvc.cli.procs import start_server
    from kvsvc.client import AsyncClient
    from tests.e2e.harness import Engine

    sp = start_server(engine_id="selfie", role="both", tp_size=2, layout=layout_table(k=4))
    try:
        async with AsyncClient(sp.address) as c:
            engine = await Engine.of(c)
            engine.fill([[1, 2]])
            pub = await c.publish_blocks("self", [[1, 2]])
            resp = await c.transfer("d-self", pub.params, [[5, 6]])
            assert resp.total_bytes > 0 and not engine.check([[5, 6]])
            assert await leases_drained(c) == 0
            engine.close()
    finally:
        assert sp.stop() == 0


async def test_kvsvc_s_ucx_log_settings_do_not_reach_processes_started_later():
    """kvsvc routes UCX's protocol log to a private file and takes the settings out of the
    environment once UCX has read them: a process the engine starts afterwards (vLLM's
    workers, another connector's engine) must not inherit a file that goes away with the
    server. Servers in this process, as an engine embeds them."""
    import os

    from tests.e2e.harness import in_process_pair
    from tests.e2e.test_read_then_claim import engines

    names = ("UCX_LOG_FILE", "UCX_PROTO_INFO", "KVSVC_UCX_LOG_OWNER")
    before = {k: os.environ.get(k) for k in names}
    async with in_process_pair("env") as (p, d), engines(p, d):
        assert {k: os.environ.get(k) for k in names} == before
