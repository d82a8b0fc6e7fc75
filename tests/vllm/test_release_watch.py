"""P's worker reports to vLLM only what vLLM waits for, and never stops hearing releases.

The connector's P worker without a vLLM engine around it (its embedded server, real
leases): a lease released for a request the scheduler did not delay (a publish that
timed out on the scheduler but was applied) is never reported finished sending -- vLLM's
scheduler fails hard on one; and a release stream that falls behind (in process: its loop
stalled through 64 MiB of releases) is made again, with the releases missed in the gap
found by looking the leases up.
"""

from __future__ import annotations

import asyncio
import time

import torch

from kvsvc.client import AsyncClient
from kvsvc.client.leases import abort_published
from kvsvc.config import Role
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata
from kvsvc.integrations.vllm.worker import KvsvcWorker
from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout

TABLE = {"model_id": "rw", "total_num_kv_heads": 2, "block_size": 16, "num_blocks": 32, "dtype": "bfloat16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}]}


def _worker() -> KvsvcWorker:
    regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
    w = KvsvcWorker(engine_id="rw-p", role=Role.PREFILL, tp_rank=0, tp_size=1)
    w.start(CacheDescription(layout_from_dict(TABLE, tp_size=1), [torch.zeros((r.num_blocks, r.block_len), dtype=torch.uint8) for r in regions]))
    return w


def _publish_and_abort(address: str, ids: list[str], between=None) -> None:
    async def go():
        async with AsyncClient(address) as c:
            pubs = [await c.publish_blocks(rid, [[i + 1]]) for i, rid in enumerate(ids)]
        if between is not None:
            between()
        for pub in pubs:
            await abort_published(pub.params, engine_id="router")

    asyncio.run(go())


def _fall_behind(w: KvsvcWorker) -> None:
    """As if the worker's loop had stalled through 64 MiB of releases: the release stream's
    subscription overflows at the next release (it is dropped, and the stream made again)."""
    async def choke() -> None:
        assert w._server is not None
        for sub in list(w._server.node.leases._watchers):
            sub._max = 1

    w._loop.run(choke(), 10)


def _sent_within(worker: KvsvcWorker, seconds: float) -> set[str]:
    out: set[str] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out |= worker.transfer_results(set())[0]
        time.sleep(0.01)
    return out


def test_only_requests_vllm_delayed_are_reported_finished_sending():
    w = _worker()
    try:
        assert w.info is not None
        w.start_load_kv(KvsvcConnectorMetadata(delayed={"held-1"}))
        _publish_and_abort(w.info.address, ["held-1", "stray-1"])
        assert _sent_within(w, 2.0) == {"held-1"}
    finally:
        w.shutdown()


def test_a_release_stream_that_falls_behind_is_made_again_and_the_gap_looked_up():
    w = _worker()
    try:
        assert w.info is not None
        w.start_load_kv(KvsvcConnectorMetadata(delayed={"gap-1", "gap-2"}))
        # The stream falls behind with the leases live; they are released right after.
        _publish_and_abort(w.info.address, ["gap-1", "gap-2"], between=lambda: _fall_behind(w))
        assert _sent_within(w, 5.0) == {"gap-1", "gap-2"}
        # and the new stream works: a later release is heard
        w.start_load_kv(KvsvcConnectorMetadata(delayed={"after-1"}))
        _publish_and_abort(w.info.address, ["after-1"])
        assert _sent_within(w, 3.0) == {"after-1"}
        assert w.gap_repairs == 1
    finally:
        w.shutdown()


def test_a_gap_is_repaired_by_exact_id_never_by_prefix():
    """P's worker missed its releases for a while; vLLM still holds blocks for 'cmpl-1' (live)
    and 'gone-1' (released in the gap). 70 other live leases start with 'cmpl-1' and expire
    before it: a lookup by prefix (64 at most) did not list 'cmpl-1', reported it released,
    and vLLM reused blocks D was about to read. Only 'gone-1' may be reported (the gap is
    now looked up in the lease table, by exact id)."""
    w = _worker()
    try:
        assert w.info is not None
        others = [f"cmpl-1{i}" for i in range(70)]

        async def publish() -> dict:
            async with AsyncClient(w.info.address) as c:
                for rid in others:
                    await c.publish_blocks(rid, [[1]], lease_ttl_ms=60_000)
                return {rid: await c.publish_blocks(rid, [[2]], lease_ttl_ms=60_000) for rid in ("cmpl-1", "gone-1")}

        pubs = asyncio.run(publish())
        w.start_load_kv(KvsvcConnectorMetadata(delayed={"cmpl-1", "gone-1"}))
        _fall_behind(w)  # the gap opens with the next release
        asyncio.run(abort_published(pubs["gone-1"].params, engine_id="router"))
        end = time.monotonic() + 30
        while w.gap_repairs == 0 and time.monotonic() < end:  # the gap looked up
            time.sleep(0.01)
        assert w.gap_repairs >= 1, "the gap was never looked up"
        assert w.transfer_results(set())[0] == {"gone-1"}
        asyncio.run(abort_published(pubs["cmpl-1"].params, engine_id="router"))
        assert _sent_within(w, 3.0) == {"cmpl-1"}  # its real release, heard on the new stream
    finally:
        w.shutdown()


def test_a_lease_released_in_a_gap_before_vllm_kept_its_blocks_is_still_reported():
    """An early lease (made before vLLM says it keeps the request's blocks) is released while
    the release stream is behind, and the gap is looked up before vLLM's word comes: the
    lookup had nothing to look for, and the release was never reported (P kept the blocks
    for good). It must be reported once vLLM says it keeps them."""
    w = _worker()
    try:
        assert w.info is not None

        async def publish():
            async with AsyncClient(w.info.address) as c:
                return await c.publish_blocks("early-1", [[3]], lease_ttl_ms=60_000)

        pub = asyncio.run(publish())
        _fall_behind(w)  # the gap opens with the next release
        asyncio.run(abort_published(pub.params, engine_id="router"))  # released in it
        end = time.monotonic() + 30
        while w.gap_repairs == 0 and time.monotonic() < end:  # the gap looked up: nothing delayed yet
            time.sleep(0.01)
        assert w.gap_repairs >= 1 and w.transfer_results(set())[0] == set()
        w.start_load_kv(KvsvcConnectorMetadata(delayed={"early-1"}))  # vLLM keeps its blocks now
        assert _sent_within(w, 3.0) == {"early-1"}
    finally:
        w.shutdown()
