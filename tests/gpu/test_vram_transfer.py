"""The e2e transfer over VRAM pools (CUDA IPC attach, NIXL VRAM registration). Needs CUDA."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from kvsvc.cli.procs import start_server  # noqa: E402
from kvsvc.client import AsyncClient  # noqa: E402
from kvsvc.client.attach import attach_pool  # noqa: E402
from kvsvc.codec import layout_from_proto  # noqa: E402
from kvsvc.layout.regions import build_pool_layout  # noqa: E402
from kvsvc.verify import RankMemory, check_rank, fill_rank  # noqa: E402
from tests.e2e.harness import layout_table  # noqa: E402


@pytest.mark.parametrize(("p_tp", "d_tp", "mla"), [(1, 1, False), (2, 1, False), (1, 2, False), (2, 1, True)])
async def test_vram_transfer(p_tp, d_tp, mla):
    layout = layout_table(k=4, mla=mla, head=8)
    p = start_server(engine_id="gpu-p", role="prefill", tp_size=p_tp, layout=layout, memory="vram")
    d = start_server(engine_id="gpu-d", role="decode", tp_size=d_tp, layout=layout, memory="vram")
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            pinfo, dinfo = await pc.get_info(), await dc.get_info()
            p_ids, d_ids = [[3, 1, 4]], [[5, 9, 2]]
            pl = layout_from_proto(pinfo.layout, tp_size=p_tp)
            for pool in pinfo.pools:
                host = np.zeros(pool.size_bytes, np.uint8)
                fill_rank(RankMemory(build_pool_layout(pl).regions, host), pool.tp_rank, p_tp, 4, p_ids, 4)
                attach_pool(pool).buffer.copy_(torch.from_numpy(host))
            torch.cuda.synchronize()
            pub = await pc.publish_blocks("gpu-1", p_ids)
            resp = await dc.transfer("gpu-d-1", pub.params, d_ids, timeout_s=60)
            assert resp.total_bytes > 0
            # READs of GPU memory between processes of one host go over cuda_ipc, not UCX's
            # TCP "software emulation" (its default without NVLink: 0.4 GB/s against 1,700).
            transports = list((await dc.get_info()).transport.ucx_transports)
            assert "rma_get:cuda_ipc/cuda" in transports, transports
            dl = layout_from_proto(dinfo.layout, tp_size=d_tp)
            for pool in dinfo.pools:
                host = attach_pool(pool).buffer.cpu().numpy()
                errs = check_rank(RankMemory(build_pool_layout(dl).regions, host), pool.tp_rank, d_tp, 4, d_ids, 4)
                assert not errs, errs
    finally:
        p.stop()
        d.stop()
