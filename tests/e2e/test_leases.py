"""Leases across real processes: expiry, reads refused after expiry, idempotent notify, P restarts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from kvsvc.errors import FailedPrecondition
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import Engine, layout_table, servers, session, transfer_and_check

LAYOUT = layout_table(k=4)


async def test_expiry_release_and_refused_read():
    with servers(2, 1, LAYOUT) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1, 2, 3]])
            for mem in s.de.mem.values():  # D's destination blocks hold the engine's own data
                mem.buf[:] = np.uint8(0xAB)
            before = s.de.snapshot()
            pub = await s.pc.publish_blocks("short", [[1, 2, 3]], lease_ttl_ms=300)
            events = await s.watch.wait_for("short", timeout_s=5)
            assert [e.reason for e in events] == [pb.RELEASE_REASON_EXPIRED]
            assert list(events[0].block_ids_per_group[0].block_ids) == [1, 2, 3]
            with pytest.raises(FailedPrecondition) as e:
                await s.dc.transfer("d-short", pub.params, [[4, 5, 6]])
            assert e.value.reason == "LEASE_EXPIRED"
            # The READs raced the refused claim: they may have written the request's own
            # blocks (4-6), which the answer calls invalid -- and nothing else of D's.
            failure = [x for x in e.value.details if isinstance(x, pb.TransferFailure)]
            assert failure and not failure[0].valid_local_block_ids_per_group
            s.de.restore_blocks(before, [[4, 5, 6]])
            assert s.de.snapshot() == before, "a refused transfer wrote outside its own blocks"
            # Nothing stays leased, and a late notify changes nothing.
            n = await s.pc.notify(pb.NotifyRequest(request_id="short", kind=pb.NOTIFY_KIND_CONSUMED,
                                                   tp_size=1, done_ranks=[0], lease_epoch=pub.params.remote_epoch))
            assert n.state == pb.LEASE_STATE_EXPIRED
            await asyncio.sleep(0.2)
            assert len([ev for ev in s.watch.events if ev.request_id == "short"]) == 1
            assert (await s.pc.get_info()).live_leases == 0


async def test_duplicate_and_unknown_notify_are_harmless():
    with servers(1, 2, LAYOUT) as (p, d):
        async with session(p, d) as s:
            resp = await transfer_and_check(s, "dup", [[7, 8]], [[1, 2]])
            assert resp.total_bytes > 0 and resp.after_final_us == 0  # a whole lease has no final commit
            epoch = s.pe.info.epoch
            again = await s.pc.notify(pb.NotifyRequest(request_id="dup", kind=pb.NOTIFY_KIND_CONSUMED,
                                                       tp_size=2, done_ranks=[0, 1], lease_epoch=epoch))
            assert again.state == pb.LEASE_STATE_CONSUMED
            unknown = await s.pc.notify(pb.NotifyRequest(request_id="never", kind=pb.NOTIFY_KIND_CONSUMED,
                                                         tp_size=2, done_ranks=[0], lease_epoch=epoch))
            assert unknown.state == pb.LEASE_STATE_UNKNOWN
            await asyncio.sleep(0.2)
            assert [e.request_id for e in s.watch.events] == ["dup"]


async def test_prefill_restart_forces_rehandshake():
    p = start_server(engine_id="e2e-prefill", role="prefill", tp_size=2, layout=LAYOUT)
    d = start_server(engine_id="e2e-decode", role="decode", tp_size=1, layout=LAYOUT, extra_env={"KVSVC_DEBUG": "1"})
    p2 = None
    try:
        async with AsyncClient(d.address) as dc:
            de = await Engine.of(dc)
            async with AsyncClient(p.address) as pc:
                pe = await Engine.of(pc)
                pe.fill([[1, 2]])
                old = await pc.publish_blocks("before", [[1, 2]])
                await dc.transfer("d-before", old.params, [[3, 4]])
                assert not de.check([[3, 4]])
                pe.close()
            addr = p.address
            assert p.stop() == 0
            p2 = start_server(engine_id="e2e-prefill", role="prefill", tp_size=2, layout=LAYOUT, listen=addr)
            async with AsyncClient(p2.address) as pc2:
                pe2 = await Engine.of(pc2)
                assert pe2.info.epoch != old.params.remote_epoch
                # The old lease died with the old process: refused (P's answer, not the failed READ's).
                with pytest.raises(FailedPrecondition) as e:
                    await dc.transfer("d-stale", old.params, [[5, 6]])
                assert e.value.reason == "LEASE_EXPIRED"
                pe2.fill([[9, 10]])
                new = await pc2.publish_blocks("after", [[9, 10]])
                await dc.transfer("d-after", new.params, [[7, 8]])
                assert not de.check([[7, 8]])
                pe2.close()
            de.close()
        handshakes = [line for line in d.output if "handshake with" in line]
        assert len(handshakes) == 2, handshakes
    finally:
        d.stop()
        p.stop()
        if p2 is not None:
            p2.stop()
