"""Every supported TP / layout cell moved for real and checked byte for byte; every refusal named."""

from __future__ import annotations

import pytest

from kvsvc.errors import FailedPrecondition
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.cells import FAST, FULL, REFUSALS, Cell, Refusal
from tests.e2e.harness import servers, session, transfer_and_check

REPORT: list[dict] = []


def runs(local: list[int], remote: list[int]) -> int:
    """Maximal runs of blocks consecutive on both sides."""
    return 1 + sum(1 for i in range(len(local) - 1) if local[i + 1] != local[i] + 1 or remote[i + 1] != remote[i] + 1)


def token_rows(cell: Cell, block: int) -> int:
    """Descriptors one (region, block, source rank) may need: 1 where heads are contiguous (HND
    on both sides, or NHD blocks read whole); a token's run of heads each where NHD heads are
    split; a token's head each where the sides' memory orders differ."""
    orders = {"NHD" if lay.get("kv_memory_layout") == "NHD" and block > 1 else "HND"
              for lay in (cell.p_layout, cell.d_layout or cell.p_layout)}
    if orders == {"HND"} or (orders == {"NHD"} and cell.p_tp == cell.d_tp):
        return 1
    return block if len(orders) == 1 else block * max(1, cell.p_layout["total_num_kv_heads"] // cell.d_tp)


def descriptor_bound(cell: Cell, info: pb.GetInfoResponse) -> int | None:
    """At most one descriptor per (region, maximal contiguous run, source rank) when a whole block
    is contiguous on both sides; one per (region, block, source rank) when D reads part of a block
    or writes part of one (times token_rows where heads are not contiguous). None for block-size
    ratios (HND splits each block by head)."""
    if info.layout.block_size_tokens != (cell.d_layout or cell.p_layout)["block_size"]:
        return None
    p_block = cell.p_layout["block_size"]
    if p_block != info.layout.block_size_tokens:
        return None
    same_tp = cell.p_tp == cell.d_tp
    is_mla = bool(info.layout.groups) and all(g.spec.WhichOneof("kind") in ("mla_attention", "uniform_type")
                                               for g in info.layout.groups)
    targets = max(1, cell.p_tp // cell.d_tp)
    rows = 1 if is_mla else token_rows(cell, p_block)
    bound = 0
    for region in info.pools[0].regions:
        g = region.group_index
        local = cell.d_ids[g]
        remote = cell.p_ids[g][len(cell.p_ids[g]) - len(local):]
        whole = (same_tp or is_mla) and rows == 1
        bound += (runs(local, remote) if whole else len(local) * rows) * (1 if whole else targets)
    return bound


async def run_cell(cell: Cell) -> None:
    with servers(cell.p_tp, cell.d_tp, cell.p_layout, cell.d_layout) as (p, d):
        async with session(p, d) as s:
            resp = await transfer_and_check(s, cell.id, cell.p_ids, cell.d_ids, cell.first_position)
            per_rank = {r.local_rank: r.num_descriptors for r in resp.ranks}
            bound = descriptor_bound(cell, s.de.info)
            REPORT.append({"cell": cell.id, "category": cell.category, "p_tp": cell.p_tp, "d_tp": cell.d_tp,
                           "bytes": resp.total_bytes, "descriptors_per_rank": per_rank, "bound": bound})
            if bound is not None:
                assert max(per_rank.values()) <= bound, (per_rank, bound)


@pytest.mark.parametrize("cell", FAST, ids=[c.id for c in FAST])
async def test_cell(cell):
    await run_cell(cell)


@pytest.mark.full
@pytest.mark.parametrize("cell", FULL, ids=[c.id for c in FULL])
async def test_sweep(cell):
    await run_cell(cell)


@pytest.mark.parametrize("case", REFUSALS, ids=[r.id for r in REFUSALS])
async def test_refusal(case: Refusal):
    with servers(case.p_tp, case.d_tp, case.p_layout, case.d_layout) as (p, d):
        async with session(p, d) as s:
            pub = await s.pc.publish_blocks("refused", [[1]] * len(case.p_layout["groups"]))
            with pytest.raises(FailedPrecondition) as e:
                await s.dc.transfer("d-refused", pub.params, [[2]] * len(case.d_layout["groups"]))
            assert e.value.reason == case.reason, e.value
            for key, value in case.metadata.items():
                assert e.value.metadata.get(key) == value, (key, e.value.metadata)
            # Nothing stays leased: D told P to let go.
            events = await s.watch.wait_for("refused")
            assert [ev.reason for ev in events] == [pb.RELEASE_REASON_ABORTED]
            assert (await s.pc.get_info()).live_leases == 0
