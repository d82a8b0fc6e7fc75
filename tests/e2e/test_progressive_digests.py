"""Content digests of a progressive lease, with real servers (content_digest on P and D): P
hashes each block once a commit makes it whole (the committed tokens fill it, or the final
commit came), the digests travel with WaitCommit's answers, and D checks every chunk it read
against them. A block committed half-filled and written further is hashed as it ends up; a
block changed after its digest was taken (the engine writing a committed block, or a READ
landing wrong) fails the transfer with DATA_LOSS DIGEST_MISMATCH, never served."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from kvsvc.cli.procs import ServerProcess
from kvsvc.errors import KvsvcError
from kvsvc.reasons import ErrorCode, Reason
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.verify import RankMemory, check_rank
from tests.e2e.harness import layout_table, running, session
from tests.e2e.test_content_digest import content, start
from tests.e2e.test_progressive import LAYOUT, claimed_on_p, committing, landed_on_d, opening

pytestmark = pytest.mark.timeout(120)


# P and D of one TP size or another, D's blocks holding one or two of P's
PAIRS = pytest.mark.parametrize(("p_tp", "d_tp", "d_block"), [(1, 1, 4), (2, 1, 4), (1, 2, 4), (1, 1, 8)],
                                ids=["eq", "p2-d1", "p1-d2", "d-block-8"])
STREAM_TOKENS = 22  # P's blocks [1, 2, 5, 6, 9, 10]: the last one half-filled


@contextlib.contextmanager
def pair(tmp_path, *, p_tp: int = 1, d_tp: int = 1, d_layout=None, p_digest: bool = True,
         p_faults: str = "", d_faults: str = "") -> Iterator[tuple[ServerProcess, ServerProcess]]:
    p = start("pd-p", "prefill", p_tp, LAYOUT, tmp_path, digest=p_digest, faults=p_faults)
    try:
        d = start("pd-d", "decode", d_tp, d_layout or LAYOUT, tmp_path, faults=d_faults)
    except BaseException:
        p.stop()
        raise
    with running(p, d):
        yield p, d


def block_bytes(mem, block: int) -> list[np.ndarray]:
    return [mem.block_view(r, block).copy() for r in mem.regions]


def write_block(mem, block: int, parts: list[np.ndarray]) -> None:
    for r, part in zip(mem.regions, parts, strict=True):
        mem.block_view(r, block)[:] = part


@PAIRS
async def test_every_block_of_a_stream_is_checked_and_a_half_filled_block_is_hashed_as_it_ends_up(
        tmp_path, p_tp, d_tp, d_block):
    p_ids, d_ids = [1, 2, 5, 6, 9, 10], list(range(20, 20 + -(-STREAM_TOKENS // d_block)))
    with pair(tmp_path, p_tp=p_tp, d_tp=d_tp, d_layout=layout_table(k=2, block=d_block)) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([p_ids])  # what each block holds once computed
            # Block 6 is half computed at the second commit (14 tokens: 2 of its 4): until the
            # engine writes the rest, its bytes are others.
            computed = {rank: block_bytes(mem, 6) for rank, mem in s.pe.mem.items()}
            for rank, mem in s.pe.mem.items():
                write_block(mem, 6, [part ^ 0x33 for part in computed[rank]])
            params = (await s.pc.publish_blocks_request(opening("hd", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-hd", params, [d_ids], timeout_s=60))
            await claimed_on_p(s, "hd")
            await s.pc.commit_blocks(committing(params, 2, [5, 6], 14))
            if d_block == 4:
                await landed_on_d(s, d_ids[:3])  # blocks 1, 2 and 5 read while P computes the rest
            for rank, mem in s.pe.mem.items():
                write_block(mem, 6, computed[rank])  # the engine computes block 6's last tokens
            await s.pc.commit_blocks(committing(params, 3, [9, 10], 22, final=True))
            resp = await asyncio.wait_for(moving, 60)
            assert resp.chunks_read_growing >= 1
            assert not s.de.check([d_ids], num_tokens=22)
            (ev,) = await s.watch.wait_for("hd")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED
        # Every P block read whole from each P rank D read, checked against P's digest: 6 blocks
        # per P rank (two D ranks each read half of every block: whole once joined, counted once).
        assert content(d, "pd-d") == {"checked": 6 * p_tp, "unchecked": 0, "mismatch": 0}


def layer_regions(mem, layout, layer: int):
    """A view of a rank's memory holding only the regions of one layer of group 0."""
    name = [n for n, _ in layout.groups[0].layers()][layer]
    return RankMemory(tuple(r for r in mem.regions if r.layer_name == name), mem.buf)


async def landed_in_layer(s, d_ids: list[int], layer: int) -> None:
    """Until D's blocks d_ids hold P's request blocks (from position 0) in one layer."""
    for _ in range(2000):
        errors = [e for rank, mem in s.de.mem.items()
                  for e in check_rank(layer_regions(mem, s.de.layout, layer), rank, s.de.info.tp_size,
                                      s.de.layout.total_num_kv_heads, [d_ids], s.de.layout.block_size)]
        if not errors:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"D's blocks {d_ids} never held P's in layer {layer}: {errors[:3]}")


def rewrite_layers(mem, layout, block: int, layers: range, parts: dict[int, np.ndarray] | None = None
                   ) -> dict[int, np.ndarray]:
    """Scramble (or, given parts, restore) one block's regions of some layers; the old bytes."""
    names = [n for n, _ in layout.groups[0].layers()]
    old = {}
    for r in mem.regions:
        if names.index(r.layer_name) in layers:
            view = mem.block_view(r, block)
            old[r.index] = view.copy()
            view[:] = parts[r.index] if parts is not None else view ^ 0x5A
    return old


@PAIRS
async def test_a_chunk_committed_layer_by_layer_is_read_as_its_layers_are_written_and_checked_once_whole(
        tmp_path, p_tp, d_tp, d_block):
    p_ids, d_ids = [1, 2, 5, 6, 9, 10], list(range(20, 20 + -(-STREAM_TOKENS // d_block)))
    with pair(tmp_path, p_tp=p_tp, d_tp=d_tp, d_layout=layout_table(k=2, block=d_block)) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([p_ids])  # what each block holds once computed
            # The second chunk (blocks 5 and 6, tokens 8..13) as the engine computes it layer by
            # layer: block 5 written in layer 0 only, block 6 not yet in any (its last tokens
            # come with the third chunk). Until written, their bytes are others.
            later = {rank: (rewrite_layers(mem, s.pe.layout, 5, range(1, 2)),
                            rewrite_layers(mem, s.pe.layout, 6, range(2))) for rank, mem in s.pe.mem.items()}
            params = (await s.pc.publish_blocks_request(opening("ll", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-ll", params, [d_ids], timeout_s=60))
            await claimed_on_p(s, "ll")
            await s.pc.commit_blocks(pb.CommitBlocksRequest(
                request_id=params.remote_request_id, lease_token=params.lease_token, commit_epoch=2,
                block_ids_per_group=[pb.BlockIds(block_ids=[5, 6])], num_tokens=14, layers_done=[1]))
            if d_block == 4:
                await landed_in_layer(s, d_ids[:3], 0)  # block 5's layer 0, read while P computes layer 1
            for rank, mem in s.pe.mem.items():  # the engine computes layer 1 of the chunk, then the rest
                rewrite_layers(mem, s.pe.layout, 5, range(1, 2), later[rank][0])
                rewrite_layers(mem, s.pe.layout, 6, range(2), later[rank][1])
            await s.pc.commit_blocks(pb.CommitBlocksRequest(
                request_id=params.remote_request_id, lease_token=params.lease_token, commit_epoch=3,
                block_ids_per_group=[pb.BlockIds()], num_tokens=14, layers_done=[2]))
            await s.pc.commit_blocks(committing(params, 4, [9, 10], 22, final=True))
            resp = await asyncio.wait_for(moving, 60)
            # Each block in each layer read once (a layer read before it was written would
            # have stayed wrong), and every block checked against the digest P took once whole.
            assert not s.de.check([d_ids], num_tokens=22)
            per_block = sum(r.block_len for r in s.de.mem[0].regions) * len(s.de.mem)
            assert resp.total_bytes == per_block * len(d_ids)
            (ev,) = await s.watch.wait_for("ll")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED
        assert content(d, "pd-d") == {"checked": 6 * p_tp, "unchecked": 0, "mismatch": 0}


async def test_a_committed_block_the_engine_rewrites_fails_the_stream_with_data_loss(tmp_path):
    """block_rewritten on a progressive lease: the first block a commit made whole is changed
    right after its digest was taken. Opened whole-blocked, that is the opening's; opened with
    a half-filled block only, it waits for the commit that fills it."""
    with pair(tmp_path, p_faults="block_rewritten") as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1, 2, 3]])
            params = (await s.pc.publish_blocks_request(opening("rw1", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-rw1", params, [[20, 21, 22]], timeout_s=60))
            await claimed_on_p(s, "rw1")
            await s.pc.commit_blocks(committing(params, 2, [3], 10, final=True))
            with pytest.raises(KvsvcError) as caught:
                await asyncio.wait_for(moving, 60)
            e = caught.value
            assert (e.code, e.reason) == (ErrorCode.DATA_LOSS, Reason.DIGEST_MISMATCH), e
            assert (e.metadata["block"], e.metadata["group"]) == ("1", "0"), e.metadata
            assert (await s.pc.get_info()).live_leases == 0

            s.pe.fill([[4, 5]])
            half = pb.PublishBlocksRequest(request_id="rw2", block_ids_per_group=[pb.BlockIds(block_ids=[4])],
                                           num_tokens=2, progressive=True)
            params = (await s.pc.publish_blocks_request(half)).params
            moving = asyncio.ensure_future(s.dc.transfer("d-rw2", params, [[20, 21]], timeout_s=60))
            await claimed_on_p(s, "rw2")
            await s.pc.commit_blocks(committing(params, 2, [5], 8, final=True))
            with pytest.raises(KvsvcError) as caught:
                await asyncio.wait_for(moving, 60)
            assert caught.value.reason == Reason.DIGEST_MISMATCH and caught.value.metadata["block"] == "4"
            assert (await s.pc.get_info()).live_leases == 0
        assert content(d, "pd-d")["mismatch"] == 2


async def test_a_byte_landed_wrong_in_a_stream_fails_it_and_the_next_stream_is_right(tmp_path):
    with pair(tmp_path, d_faults="corrupt_landed,-") as (p, d):
        async with session(p, d) as s:
            for i, want in enumerate((Reason.DIGEST_MISMATCH, None)):
                p_ids, d_ids = [1 + 2 * i, 2 + 2 * i], [20 + 2 * i, 21 + 2 * i]
                s.pe.fill([p_ids])
                params = (await s.pc.publish_blocks_request(opening(f"cl{i}", p_ids[:1]))).params
                moving = asyncio.ensure_future(s.dc.transfer(f"d-cl{i}", params, [d_ids], timeout_s=60))
                await claimed_on_p(s, f"cl{i}")
                await s.pc.commit_blocks(committing(params, 2, p_ids[1:], 8, final=True))
                try:
                    await asyncio.wait_for(moving, 60)
                    got = None
                except KvsvcError as e:
                    assert e.code == ErrorCode.DATA_LOSS, e
                    got = e.reason
                assert got == want
                assert (await s.pc.get_info()).live_leases == 0
            assert not s.de.check([[22, 23]])  # what passed is right
        assert content(d, "pd-d") == {"checked": 2, "unchecked": 0, "mismatch": 1}


async def test_a_prefill_server_without_digests_leaves_a_streams_blocks_unchecked(tmp_path):
    with pair(tmp_path, p_digest=False) as (p, d):
        async with session(p, d) as s:
            s.pe.fill([[1, 2]])
            params = (await s.pc.publish_blocks_request(opening("plain", [1]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-plain", params, [[20, 21]], timeout_s=60))
            await claimed_on_p(s, "plain")
            await s.pc.commit_blocks(committing(params, 2, [2], 8, final=True))
            await asyncio.wait_for(moving, 60)
            assert not s.de.check([[20, 21]])
        assert content(d, "pd-d") == {"checked": 0, "unchecked": 2, "mismatch": 0}
