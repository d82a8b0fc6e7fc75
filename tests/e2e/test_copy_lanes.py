"""Copy lanes: a long READ split across D's extra NIXL threads moves exactly P's bytes, over
real NIXL between real servers (failure paths: tests/unit/test_copy_lanes_failures.py)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvsvc.client import AsyncClient
from kvsvc.errors import KvsvcError
from kvsvc.transport.copy_lanes import LANE_READ_MIN_BYTES, CopyLanes
from kvsvc.transport.ports import Flight
from tests.e2e.harness import Engine, in_process_pair, layout_table, same_block_bytes

# 1 MiB blocks (8 layers x K and V x 64 KiB): 16 blocks make a READ the lanes take.
BIG = layout_table(k=8, head=128, block=16, layers=8, nb=80)
BLOCK_BYTES = 1 << 20


class LanePosts:
    """Counts the READs D's copy lanes post, and the parts they cut them into."""

    def __init__(self, lanes: CopyLanes) -> None:
        self.reads, self.parts = 0, 0
        real = lanes.post

        async def post(*args: Any, **kw: Any) -> list[Flight]:
            flights = await real(*args, **kw)
            self.reads += 1
            self.parts += len(flights)
            return flights

        lanes.post = post  # type: ignore[method-assign]


def _fill_random(pe: Engine, seed: int) -> None:
    buf = pe.mem[0].buf
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)


@pytest.mark.parametrize("copy_threads", [2, 3, 0])
async def test_long_reads_split_over_the_lanes_move_exactly_p_bytes(copy_threads: int) -> None:
    async with in_process_pair(f"lanes{copy_threads}", d_overrides={"copy_threads": copy_threads},
                               layout_table=BIG) as (p, d):
        async with AsyncClient(f"127.0.0.1:{p.port}") as pc, AsyncClient(f"127.0.0.1:{d.port}") as dc:
            pe, de = await Engine.of(pc), await Engine.of(dc)
            assert (de.info.transport.copy_threads, pe.info.transport.copy_threads) == (copy_threads, 0)
            spy = LanePosts(d.node.data._lanes)
            try:
                _fill_random(pe, copy_threads)
                rng = random.Random(copy_threads)
                # 17 MiB contiguous: 16 runs (one per region) of 17 blocks; three lanes cut mid-run.
                cases = [(list(range(17)), list(range(40, 57))),
                         (rng.sample(range(80), 24), rng.sample(range(80), 24)),  # shuffled: one per block and region
                         ([3, 9], [70, 71])]  # 2 MiB: short, one READ on the NIXL thread
                for i, (src, dst) in enumerate(cases):
                    de.mem[0].buf[:] = 0xAB
                    pub = await pc.publish_blocks(f"lanes-{i}", [src])
                    resp = await dc.transfer(f"d-lanes-{i}", pub.params, [dst])
                    assert resp.total_bytes == len(src) * BLOCK_BYTES
                    bad = [(s, t) for s, t in zip(src, dst, strict=True) if not same_block_bytes(pe, s, de, t)]
                    assert not bad, f"case {i}: D blocks differ from P's: {bad[:4]}"
                    untouched = set(range(80)) - set(dst)
                    buf = de.mem[0]
                    assert all((buf.block_view(r, b) == 0xAB).all()
                               for r in buf.regions for b in untouched), "bytes outside the request changed"
                long_reads = sum(len(src) * BLOCK_BYTES >= LANE_READ_MIN_BYTES for src, _ in cases)
                if copy_threads:
                    assert spy.reads == long_reads and spy.parts == long_reads * min(copy_threads, 4)
                else:
                    assert spy.reads == 0
            finally:
                pe.close()
                de.close()


async def test_copy_threads_is_bounded() -> None:
    from kvsvc.config import load_config

    for bad in (-1, 17, "2"):
        with pytest.raises(KvsvcError) as e:
            load_config(copy_threads=bad).validate()
        assert e.value.reason == "INVALID_CONFIG" and "copy_threads" in str(e.value)
    load_config(copy_threads=0).validate()
