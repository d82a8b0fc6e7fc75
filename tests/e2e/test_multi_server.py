"""Engines over several kvsvc servers: a P engine whose ranks sit on 2 servers, to a D engine on 1 or 2.

The P engine publishes once, on its first server, which leases the request on its
sibling too; D claims, reads and notifies each P server for the ranks it hosts. Every
cell is checked byte for byte against kvsvc.verify on every D server, with release
accounting on every P server (CONSUMED exactly once each, nothing left leased).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvsvc.cli.procs import ServerProcess, start_engine
from kvsvc.client import AsyncClient
from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.cells import SSM, gqa, mla
from tests.e2e.harness import Engine, ReleaseWatch, assert_consumed_everywhere, layout_table

BIG = layout_table(k=8, head=128, block=16, layers=8, nb=160)


@dataclass(frozen=True)
class MultiCell:
    id: str
    p_tp: int
    p_servers: int
    d_tp: int
    d_servers: int
    layout: dict[str, Any]


CELLS = [
    MultiCell("eq-p4x2-d4x1", 4, 2, 4, 1, gqa(4)),
    MultiCell("eq-p4x2-d4x2", 4, 2, 4, 2, gqa(4)),
    MultiCell("dgtp-p2x2-d4x2", 2, 2, 4, 2, gqa(4)),
    MultiCell("dgtp-p2x2-d4x1", 2, 2, 4, 1, gqa(4)),
    MultiCell("pgtd-gqa-dedup-p4x2-d2x1-k2", 4, 2, 2, 1, gqa(2)),
    MultiCell("pgtd-p4x2-d2x2", 4, 2, 2, 2, gqa(4)),
    MultiCell("mla-p4x2-d2x1", 4, 2, 2, 1, mla()),
    MultiCell("mla-p2x2-d4x2", 2, 2, 4, 2, mla()),
    MultiCell("ssm-p4x2-d2x1", 4, 2, 2, 1, gqa(4, extra=[SSM])),
    MultiCell("ssm-p2x2-d4x2", 2, 2, 4, 2, gqa(4, extra=[SSM])),
]


@dataclass
class Side:
    """One engine's servers, their clients and their pools."""

    procs: list[ServerProcess]
    clients: list[AsyncClient]
    engines: list[Engine]


@contextlib.asynccontextmanager
async def engine(engine_id: str, role: str, tp: int, servers: int, layout: dict[str, Any],
                 **kw: Any) -> AsyncIterator[Side]:
    procs = start_engine(engine_id=engine_id, role=role, tp_size=tp, layout=layout, servers=servers, **kw)
    clients = [AsyncClient(sp.address) for sp in procs]
    try:
        engines = [await Engine.of(c) for c in clients]
        yield Side(procs, clients, engines)
        for e in engines:
            e.close()
    finally:
        for c in clients:
            await c.close()
        codes = [sp.stop() for sp in procs]
    assert codes == [0] * len(procs), "a server crashed"


def groups_of(layout: dict[str, Any], ids: list[int]) -> list[list[int]]:
    return [list(ids) for _ in layout["groups"]]


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
async def test_engine_over_servers(cell: MultiCell):
    async with engine("multi-p", "prefill", cell.p_tp, cell.p_servers, cell.layout) as P, \
            engine("multi-d", "decode", cell.d_tp, cell.d_servers, cell.layout) as D:
        p_ids, d_ids = groups_of(cell.layout, [5, 9, 2, 11]), groups_of(cell.layout, [0, 3, 4, 7])
        for e in P.engines:
            e.fill(p_ids)
        watches = [await ReleaseWatch.open(c) for c in P.clients]
        try:
            pub = await P.clients[0].publish_blocks(cell.id, p_ids)
            servers = pub.params.remote_servers
            assert [list(s.ranks) for s in servers] == [list(sp_ranks) for sp_ranks in
                                                        ([*e.info.hosted_ranks] for e in P.engines)]
            assert len({s.epoch for s in servers}) == cell.p_servers  # each server its own epoch
            # The D engine calls Transfer on each of its servers (each moves its own ranks).
            await asyncio.gather(*(c.transfer("d-" + cell.id, pub.params, d_ids, timeout_s=60) for c in D.clients))
            for e in D.engines:
                assert not e.check(d_ids), e.check(d_ids)
            await assert_consumed_everywhere(watches, P.clients, cell.id)
        finally:
            for w in watches:
                await w.close()


async def test_getinfo_names_the_engines_other_servers():
    async with engine("info-p", "prefill", 2, 2, gqa(4)) as P:
        info = await P.clients[0].get_info()
        assert [s.address for s in info.engine_servers] == [P.procs[1].address]
        await P.clients[0].publish_blocks("x", [[1]])
        info = await P.clients[0].get_info()
        assert list(info.engine_servers[0].ranks) == [1] and info.engine_servers[0].epoch
        from kvsvc.cli.info import format_info

        assert f"sibling     {P.procs[1].address}  (ranks [1], epoch {info.engine_servers[0].epoch})" in \
            format_info(info)


async def test_a_p_server_killed_mid_transfer_fails_cleanly():
    async with engine("kill2-p", "prefill", 2, 2, BIG) as P, engine("kill2-d", "decode", 2, 1, BIG) as D:
        warm = await P.clients[0].publish_blocks("warm", [[1]])
        await D.clients[0].transfer("d-warm", warm.params, [[2]], timeout_s=30)
        pub = await P.clients[0].publish_blocks("big", [list(range(128))])
        call = asyncio.ensure_future(D.clients[0].transfer("d-big", pub.params, [list(range(128))], timeout_s=60))
        await asyncio.sleep(0.005)
        P.procs[1].kill()
        try:
            await call
        except KvsvcError as e:
            assert (e.code, e.reason) == (ErrorCode.UNAVAILABLE, "PEER_UNAVAILABLE"), e
            assert e.metadata["address"] == P.procs[1].address
            assert [d for d in e.details if isinstance(d, pb.TransferFailure)]
        # The surviving P server's lease was aborted (or consumed, if the read won the race).
        assert (await P.clients[0].get_info()).live_leases == 0
        assert (await D.clients[0].get_info()).engine_id == "kill2-d"
        P.procs[1].stop()
        P.procs.pop()


async def test_restart_of_one_p_server_rehandshakes_with_it_only():
    async with engine("rs-p", "prefill", 2, 2, gqa(4)) as P, \
            engine("rs-d", "decode", 2, 1, gqa(4), extra_env={"KVSVC_DEBUG": "1"}) as D:
        for e in P.engines:
            e.fill([[1, 2]])
        first = await P.clients[0].publish_blocks("before", [[1, 2]])
        await D.clients[0].transfer("d-before", first.params, [[3, 4]])
        old_epoch = first.params.remote_servers[1].epoch
        address = P.procs[1].address
        P.engines[1].close()
        assert P.procs[1].stop() == 0
        P.procs[1] = _restart(address)
        await P.clients[1].close()
        P.clients[1] = AsyncClient(address)
        P.engines[1] = await Engine.of(P.clients[1])
        P.engines[1].fill([[5, 6]])
        P.engines[0].fill([[5, 6]])
        pub = await _publish_retrying(P.clients[0], "after", [[5, 6]])
        assert pub.params.remote_servers[1].epoch != old_epoch
        assert pub.params.remote_servers[0].epoch == first.params.remote_servers[0].epoch
        await D.clients[0].transfer("d-after", pub.params, [[7, 8]])
        assert not D.engines[0].check([[7, 8]])
        handshakes = [line for line in D.procs[0].output if "handshake with" in line]
        assert len(handshakes) == 3, handshakes  # two at first, then only the restarted one
        assert sum(address in line for line in handshakes) == 2


def _restart(address: str) -> ServerProcess:
    from kvsvc.cli.procs import start_server

    return start_server(engine_id="rs-p", role="prefill", tp_size=2, ranks=[1], layout=gqa(4), listen=address)


async def _publish_retrying(client: AsyncClient, rid: str, ids: list[list[int]]) -> pb.PublishBlocksResponse:
    """A publish that failed on a sibling left nothing behind, so the engine may simply retry."""
    for attempt in range(20):
        try:
            return await client.publish_blocks(rid, ids)
        except KvsvcError as e:
            if e.reason != "SIBLING_UNAVAILABLE" or attempt == 19:
                raise
            await asyncio.sleep(0.25)
    raise AssertionError("unreachable")


async def test_a_publish_that_fails_on_a_sibling_leaves_no_lease_and_no_release():
    """A failed PublishBlocks leased nothing anywhere: no live lease, no WatchReleases event to free twice."""
    async with engine("wd-p", "prefill", 4, 3, gqa(4)) as P:
        watches = [await ReleaseWatch.open(c) for c in P.clients[:2]]
        try:
            P.procs[2].kill()  # the third server is gone; the second will have leased before the failure shows
            with pytest.raises(KvsvcError) as e:
                await P.clients[0].publish_blocks("doomed", [[1, 2]])
            assert e.value.reason == "SIBLING_UNAVAILABLE" and e.value.metadata["address"] == P.procs[2].address
            for c in P.clients[:2]:
                assert (await c.get_info()).live_leases == 0
            await asyncio.sleep(0.3)
            assert [w.events for w in watches] == [[], []]
        finally:
            for w in watches:
                await w.close()
        P.procs[2].stop()
        P.procs.pop()
