"""Content digests with real servers (content_digest on P and D): P takes a digest of every
leased block when it leases it, D checks what its READs landed against it. The right bytes
pass at any TP pair; a leased block the engine changes before D reads it (the class of a
block reused while leased: vLLM #55470, kvsvc's own release-stream gap before round four)
fails the transfer with DATA_LOSS DIGEST_MISMATCH instead of being served; a P without
digests leaves D's blocks counted unchecked."""

from __future__ import annotations

import pytest

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.errors import KvsvcError
from kvsvc.reasons import ErrorCode, Reason
from tests.e2e.harness import layout_table, session, transfer_and_check
from tests.e2e.test_observability import metrics_url, scrape


def start(engine: str, role: str, tp: int, layout, tmp_path, digest: bool = True, faults: str = "") -> ServerProcess:
    cfg = tmp_path / f"{engine}.toml"
    cfg.write_text(f'[server]\nmetrics_listen = "127.0.0.1:0"\ncontent_digest = {str(digest).lower()}\n')
    return start_server(engine_id=engine, role=role, tp_size=tp, layout=layout, config_file=str(cfg),
                        extra_env={"KVSVC_FAULTS": faults} if faults else None)


def content(d: ServerProcess, engine: str) -> dict[str, float]:
    samples = scrape(metrics_url(d))
    return {result: samples.get(("kvsvc_content_checked_blocks_total", (("engine", engine), ("result", result))), 0.0)
            for result in ("checked", "unchecked", "mismatch")}


@pytest.mark.parametrize("p_tp,d_tp,layout", [
    (1, 1, layout_table(k=4)),
    (2, 1, layout_table(k=4)),  # D reads P ranks' whole blocks into halves of its own
    (1, 2, layout_table(k=4)),  # two D ranks read halves of P's blocks: whole once joined
    (2, 1, layout_table(mla=True, head=8)),  # one P rank read, the other only told
    (1, 1, layout_table(k=4, kv_memory_layout="NHD")),
], ids=["eq-1-1", "p2-d1", "p1-d2", "mla-p2-d1", "nhd"])
async def test_the_right_bytes_pass_the_check_at_any_tp_pair(tmp_path, p_tp, d_tp, layout):
    p, d = start("cd-p", "prefill", p_tp, layout, tmp_path), start("cd-d", "decode", d_tp, layout, tmp_path)
    try:
        async with session(p, d) as s:
            await transfer_and_check(s, "cd-1", [[5, 9, 2, 11]], [[0, 3, 4, 7]])
            await transfer_and_check(s, "cd-2", [[1, 2, 3]], [[10, 11, 12]])
        # P blocks read, each checked: 7, from every P rank D read from (MLA: one).
        read_ranks = 1 if layout["groups"][0]["kind"] == "mla" else p_tp
        assert content(d, "cd-d") == {"checked": 7 * read_ranks, "unchecked": 0, "mismatch": 0}
    finally:
        p.stop()
        d.stop()


async def test_a_leased_block_changed_before_d_reads_it_fails_the_transfer_with_data_loss(tmp_path):
    layout = layout_table(k=4)
    p, d = start("cd-p", "prefill", 1, layout, tmp_path), start("cd-d", "decode", 1, layout, tmp_path)
    try:
        async with session(p, d) as s:
            await transfer_and_check(s, "warm", [[1]], [[2]])
            s.pe.fill([[5, 6]])
            pub = await s.pc.publish_blocks("victim", [[5, 6]])  # answered once P took its digests
            mem = s.pe.mem[0]
            region = mem.regions[1]
            mem.buf[region.pool_offset + 6 * region.block_stride + 17] ^= 0x5A  # the engine writes a leased block
            with pytest.raises(KvsvcError) as caught:
                await s.dc.transfer("d-victim", pub.params, [[8, 9]])
            e = caught.value
            assert (e.code, e.reason) == (ErrorCode.DATA_LOSS, Reason.DIGEST_MISMATCH), e
            assert e.metadata["block"] == "6" and e.metadata["group"] == "0", e.metadata
            assert (await s.pc.get_info()).live_leases == 0  # P's lease ended all the same
            # The next request, on the same blocks, is right again.
            await transfer_and_check(s, "after", [[5, 6]], [[8, 9]])
        assert content(d, "cd-d") == {"checked": 1 + 2, "unchecked": 0, "mismatch": 1}  # a failed one counts no block
    finally:
        p.stop()
        d.stop()


async def test_a_prefill_server_without_digests_leaves_blocks_unchecked_not_failed(tmp_path):
    layout = layout_table(k=4)
    p = start("cd-p", "prefill", 1, layout, tmp_path, digest=False)
    d = start("cd-d", "decode", 1, layout, tmp_path)
    try:
        async with session(p, d) as s:
            await transfer_and_check(s, "plain", [[5, 9]], [[0, 3]])
        assert content(d, "cd-d") == {"checked": 0, "unchecked": 2, "mismatch": 0}
    finally:
        p.stop()
        d.stop()
