"""DCP-sharded MLA between real server processes (MAPPING.md §9), checked byte for byte.

A request of TOKENS tokens fills BLOCKS blocks of 4; an engine with DCP d keeps its
block g at position g // d of rank g % d. P publishes its per-rank lists with the
request's length; D's list is shorter by a prefix hit in the "hit" cells. Every D rank
is checked against kvsvc.verify (positions past the request's end must stay untouched),
and every P server must release the request exactly once, CONSUMED, with no lease left.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from kvsvc.errors import ErrorCode, KvsvcError
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.cells import mla
from tests.e2e.harness import ReleaseWatch, assert_consumed_everywhere
from tests.e2e.test_multi_server import engine

BLOCK = 4
BLOCKS = 9
TOKENS = (BLOCKS - 1) * BLOCK + 3  # the last block is not full


@dataclass(frozen=True)
class DcpCell:
    id: str
    p_tp: int
    p_dcp: int
    d_tp: int
    d_dcp: int
    hit: int = 0  # local positions D already holds
    p_servers: int = 1
    d_servers: int = 1


CELLS = [
    DcpCell("d4dcp1-p4dcp4", 4, 4, 4, 1),
    DcpCell("d4dcp1-p4dcp4-hit", 4, 4, 4, 1, hit=2),
    DcpCell("d2dcp2-p4dcp4", 4, 4, 2, 2),
    DcpCell("d2dcp2-p4dcp4-hit", 4, 4, 2, 2, hit=1),
    DcpCell("d4dcp4-p2dcp2", 2, 2, 4, 4),
    DcpCell("d4dcp4-p2dcp2-hit", 2, 2, 4, 4, hit=1),
    # One P rank per server: each P server hears only from the D server whose rank reads it.
    DcpCell("d2dcp2-p4dcp4-over-servers", 4, 4, 2, 2, hit=1, p_servers=4, d_servers=2),
]


def layout(dcp: int) -> dict:
    return mla(block=BLOCK, nb=32, dcp_size=dcp)


def positions(dcp: int) -> int:
    return -(-BLOCKS // dcp)


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
async def test_dcp_cell(cell: DcpCell):
    async with engine("dcp-p", "prefill", cell.p_tp, cell.p_servers, layout(cell.p_dcp)) as P, \
            engine("dcp-d", "decode", cell.d_tp, cell.d_servers, layout(cell.d_dcp)) as D:
        p_ids = [[31 - i for i in range(positions(cell.p_dcp))]]
        d_all = [2 * i + 1 for i in range(positions(cell.d_dcp))]
        d_ids = [d_all[cell.hit:]]
        for e in P.engines:
            e.fill(p_ids)
        before = [e.snapshot() for e in D.engines]
        watches = [await ReleaseWatch.open(c) for c in P.clients]
        try:
            pub = await P.clients[0].publish_blocks(cell.id, p_ids, num_tokens=TOKENS)
            assert (pub.params.remote_dcp_size, pub.params.remote_num_tokens) == (cell.p_dcp, TOKENS)
            plans = await asyncio.gather(*(c.plan_transfer(pb.PlanTransferRequest(
                remote_address=P.procs[0].address, local_block_ids_per_group=[pb.BlockIds(block_ids=d_ids[0])],
                remote_block_ids_per_group=[pb.BlockIds(block_ids=p_ids[0])], remote_num_tokens=TOKENS,
                summary_only=True)) for c in D.clients))
            assert all(list(p.prefix_blocks_skipped_per_group) == [cell.hit] for p in plans)
            resps = await asyncio.gather(*(c.transfer("d-" + cell.id, pub.params, d_ids, timeout_s=60)
                                           for c in D.clients))
            for e, snap in zip(D.engines, before, strict=True):
                assert not e.check(d_ids, [cell.hit], num_tokens=TOKENS), e.check(d_ids, [cell.hit], TOKENS)
                _assert_untouched_past_the_end(e, snap, d_ids[0], cell)
            moved = sum(r.total_bytes for r in resps)
            latent = sum(reg.block_len for reg in D.engines[0].mem[D.engines[0].info.hosted_ranks[0]].regions)
            assert moved == latent * _blocks_read(cell)
            await assert_consumed_everywhere(watches, P.clients, cell.id)
        finally:
            for w in watches:
                await w.close()


def _blocks_read(cell: DcpCell) -> int:
    """Request blocks every D rank together reads: each D rank reads the blocks it holds past the hit."""
    total = 0
    for t in range(cell.d_tp):
        total += sum(1 for pos in range(cell.hit, positions(cell.d_dcp))
                     if pos * cell.d_dcp + t % cell.d_dcp < BLOCKS)
    return total


def _assert_untouched_past_the_end(e, snap: dict[int, bytes], ids: list[int], cell: DcpCell) -> None:
    for rank, mem in e.mem.items():
        for pos, b in enumerate(ids, start=cell.hit):
            if pos * cell.d_dcp + rank % cell.d_dcp < BLOCKS:
                continue
            for reg in mem.regions:
                start = reg.pool_offset + b * reg.block_stride
                assert bytes(mem.buf[start:start + reg.block_len]) == snap[rank][start:start + reg.block_len], \
                    f"rank {rank} block {b} past the request's end was written"


async def test_a_dcp_engine_needs_the_request_length():
    async with engine("dcp-n", "prefill", 2, 1, layout(2)) as P:
        with pytest.raises(KvsvcError) as e:
            await P.clients[0].publish_blocks("no-length", [[1, 2]])
        assert (e.value.code, e.value.reason) == (ErrorCode.INVALID_ARGUMENT, "NUM_TOKENS_REQUIRED")
        with pytest.raises(KvsvcError) as e:  # 9 blocks need 5 ids per rank at DCP 2
            await P.clients[0].publish_blocks("short", [[1, 2, 3, 4]], num_tokens=TOKENS)
        assert e.value.reason == "BLOCK_COUNT_MISMATCH" and e.value.metadata["needed"] == "5"
        info = await P.clients[0].get_info()
        assert info.live_leases == 0
        from kvsvc.cli.info import format_info

        assert "TP          size 2, hosted ranks [0, 1], DCP 2" in format_info(info)


async def test_params_with_a_wrong_dcp_size_are_refused_and_free_the_lease():
    async with engine("dcp-w", "prefill", 2, 1, layout(2)) as P, engine("dcp-wd", "decode", 2, 1, layout(1)) as D:
        pub = await P.clients[0].publish_blocks("wrong", [[1, 2, 3, 4, 5]], num_tokens=TOKENS)
        params = pb.TransferParams()
        params.CopyFrom(pub.params)
        params.remote_dcp_size = 1  # stale or edited: D would pick the wrong P ranks
        with pytest.raises(KvsvcError) as e:
            await D.clients[0].transfer("d-wrong", params, [list(range(BLOCKS))], timeout_s=30)
        assert (e.value.code, e.value.reason) == (ErrorCode.INVALID_ARGUMENT, "DCP_MISMATCH")
        for _ in range(50):  # the abort is sent in the background
            if (await P.clients[0].get_info()).live_leases == 0:
                break
            await asyncio.sleep(0.05)
        assert (await P.clients[0].get_info()).live_leases == 0
