"""Engine-owned GPU memory shaped exactly as vLLM's GPU attention backends allocate it, read in place.

Each case builds per-layer CUDA tensors the way a backend does, hands them to embedded
servers region by region (no copy, no kvsvc pool: NIXL registers the engine's VRAM),
moves one request P -> D and checks every D rank byte for byte with kvsvc.verify:

- FlashAttention / Triton, [2, num_blocks, ...] per layer (K and V halves: split_kv):
  with the LBHNC (HND) layout kvsvc's connector requests, physically [2, blocks, heads,
  tokens, head] -- heterogeneous TP works; in their default NHD, [2, blocks, tokens, heads,
  head] -- equal TP works and a pair that splits heads is refused with LAYOUT_MISMATCH;
- FlashInfer, [num_blocks, 2, ...] per layer (blocks_first), HND;
- MLA, [num_blocks, tokens, 576] per layer (the latent), P TP 2 -> D TP 1 and back.

KVSVC_TEST_DEVICE=cpu runs the same cases on host tensors (a check of the test itself on
a machine without a GPU); by default they need CUDA.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("KVSVC_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]

from kvsvc.client import AsyncClient  # noqa: E402
from kvsvc.config import Role, load_config  # noqa: E402
from kvsvc.errors import KvsvcError  # noqa: E402
from kvsvc.layout import build_pool_layout, layout_from_dict  # noqa: E402
from kvsvc.service.server import create_server  # noqa: E402
from kvsvc.v1 import kv_transfer_pb2 as pb  # noqa: E402
from kvsvc.verify import RankMemory, check_rank, fill_rank, rank_heads, tag  # noqa: E402
from tests.e2e.harness import layout_table  # noqa: E402

K, HEAD, BLOCK, NB, LAYERS, LATENT = 4, 64, 16, 32, 2, 576
P_IDS, D_IDS = [[7, 8, 2, 30]], [[1, 3, 5, 31]]


def table(backend: str) -> dict:
    if backend == "mla":
        return layout_table(k=1, head=LATENT, block=BLOCK, nb=NB, layers=LAYERS, mla=True, dtype="bfloat16")
    kw = {"flash_hnd": {"kv_memory_layout": "HND", "region_layout": "split_kv"},
          "flash_nhd": {"kv_memory_layout": "NHD", "region_layout": "split_kv"},
          "flashinfer_hnd": {"kv_memory_layout": "HND", "region_layout": "blocks_first"}}[backend]
    return layout_table(k=K, head=HEAD, block=BLOCK, nb=NB, layers=LAYERS, dtype="bfloat16", **kw)


def layer_buffers(backend: str, tp: int) -> list:
    """One rank's region buffers, in region order, as views of per-layer tensors shaped as the backend's."""
    return [b for _, regions in layers(backend, tp) for b in regions]


def layers(backend: str, tp: int) -> list[tuple[object, tuple]]:
    """Per layer: the K cache as the backend indexes it ([blocks, tokens, heads, head], or the
    latent [blocks, tokens, 576]) and the layer's region buffers in physical order."""
    heads = max(1, K // tp)
    out = []
    for _ in range(LAYERS):
        if backend == "mla":
            t = torch.zeros(NB, BLOCK, LATENT, dtype=torch.bfloat16, device=DEVICE)
            out.append((t, (t,)))
            continue
        if backend == "flash_hnd":  # logical [2, NB, B, H, D] laid out with stride order (0, 1, 3, 2, 4)
            t = torch.zeros(2, NB, heads, BLOCK, HEAD, dtype=torch.bfloat16, device=DEVICE).permute(0, 1, 3, 2, 4)
            k_logical = t[0]
            kv = (t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3))  # physical order for the regions
        elif backend == "flash_nhd":  # logical = physical [2, NB, B, H, D]
            t = torch.zeros(2, NB, BLOCK, heads, HEAD, dtype=torch.bfloat16, device=DEVICE)
            k_logical, kv = t[0], (t[0], t[1])
        else:  # flashinfer_hnd: logical [NB, 2, B, H, D], physical [NB, 2, H, B, D]
            t = torch.zeros(NB, 2, heads, BLOCK, HEAD, dtype=torch.bfloat16, device=DEVICE)
            k_logical, kv = t[:, 0].permute(0, 2, 1, 3), (t[:, 0], t[:, 1])
        out.append((k_logical, kv))
    return out


def byte_rows(buf) -> object:
    """[num_blocks, block bytes] uint8 view of a region buffer (aliases it)."""
    rows = buf.view(torch.uint8).reshape(buf.shape[0], -1)
    assert rows.data_ptr() == buf.data_ptr()
    return rows


def fill(buffers: list, regions, rank: int, tp: int, k: int) -> None:
    host = [byte_rows(b).cpu().numpy() for b in buffers]
    fill_rank(RankMemory(regions, None, host), rank, tp, k, P_IDS, BLOCK)
    for b, h in zip(buffers, host, strict=True):
        byte_rows(b).copy_(torch.from_numpy(h))


def check(buffers: list, regions, rank: int, tp: int, k: int) -> list[str]:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    host = [byte_rows(b).cpu().numpy() for b in buffers]
    return check_rank(RankMemory(regions, None, host), rank, tp, k, D_IDS, BLOCK)


async def serve(name: str, role: Role, backend: str, tp: int, buffers: dict[int, list]):
    cfg = load_config(listen="127.0.0.1:0", engine_id=name, role=role, tp_size=tp, layout_table=table(backend))
    return await create_server(cfg, external_pools=buffers)


async def move(backend: str, p_tp: int, d_tp: int) -> tuple[dict, dict]:
    """P's ranks filled, one request read by D; the D buffers and D's regions (and D's layers
    as the backend indexes them, under "layers")."""
    k = 1 if backend == "mla" else K
    p_kv = {r: layer_buffers(backend, p_tp) for r in range(p_tp)}
    d_layers = {r: layers(backend, d_tp) for r in range(d_tp)}
    d_kv = {r: [b for _, regions in d_layers[r] for b in regions] for r in range(d_tp)}
    p_regions = build_pool_layout(layout_from_dict(table(backend), p_tp)).regions
    for r, bufs in p_kv.items():
        fill(bufs, p_regions, r, p_tp, k)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    p_srv, p_port = await serve("gpu-em-p", Role.PREFILL, backend, p_tp, p_kv)
    d_srv, d_port = await serve("gpu-em-d", Role.DECODE, backend, d_tp, d_kv)
    try:
        async with AsyncClient(f"127.0.0.1:{p_port}") as pc, AsyncClient(f"127.0.0.1:{d_port}") as dc:
            info = await pc.get_info()
            want = pb.MEMORY_KIND_VRAM if DEVICE == "cuda" else pb.MEMORY_KIND_DRAM
            assert {pool.memory_kind for pool in info.pools} == {want}
            for pool in info.pools:  # NIXL reads the engine's tensors themselves
                assert [reg.base_address for reg in pool.regions] == [b.data_ptr() for b in p_kv[pool.tp_rank]]
            pub = await pc.publish_blocks(f"gpu-em-{backend}", P_IDS)
            resp = await dc.transfer(f"d-gpu-em-{backend}", pub.params, D_IDS, timeout_s=60)
            assert resp.total_bytes > 0
            transports = list((await dc.get_info()).transport.ucx_transports)
            print(f"{backend} P TP{p_tp} -> D TP{d_tp}: {resp.total_bytes} bytes, UCX {transports}")
    finally:
        await d_srv.stop(0)
        await p_srv.stop(0)
    return d_kv, {"regions": build_pool_layout(layout_from_dict(table(backend), d_tp)).regions, "k": k,
                  "layers": d_layers}


def semantic_errors(d_layers: dict, d_tp: int, k: int) -> list[str]:
    """Read D's K caches the way the attention kernel indexes them: token t of block b, head
    h, starts with the (region tag, token position) kvsvc.verify wrote for that head. This
    checks that the layout table describes the backend's tensors, not only that bytes moved."""
    errs = []
    for r, per_layer in d_layers.items():
        heads = rank_heads(r, d_tp, k)
        for li, (k_cache, regions) in enumerate(per_layer):
            region = li * len(regions)  # a layer's K region comes first
            for i, b in enumerate(D_IDS[0]):
                words = k_cache[b].contiguous().view(torch.int32).cpu().numpy()  # [tokens, (heads,) words]
                for t in range(BLOCK):
                    pos = i * BLOCK + t
                    got = [tuple(words[t, :2])] if words.ndim == 2 else [tuple(words[t, h, :2]) for h in
                                                                        range(len(heads))]
                    want = [(tag(region, 0), pos)] if words.ndim == 2 else [(tag(region, h), pos) for h in heads]
                    if got != want:
                        errs.append(f"rank {r} layer {li} block {b} token {t}: {got} != {want}")
    return errs


@pytest.mark.parametrize(("backend", "p_tp", "d_tp"), [
    ("flash_hnd", 2, 1), ("flash_hnd", 1, 2), ("flash_hnd", 2, 2),
    ("flash_nhd", 1, 1), ("flash_nhd", 2, 2),
    ("flashinfer_hnd", 2, 1), ("flashinfer_hnd", 1, 2),
    ("mla", 2, 1), ("mla", 1, 2),
])
async def test_backend_shaped_vram_is_read_in_place(backend, p_tp, d_tp):
    d_kv, d = await move(backend, p_tp, d_tp)
    for r, bufs in d_kv.items():
        errs = check(bufs, d["regions"], r, d_tp, d["k"])
        assert not errs, errs[:5]
    errs = semantic_errors(d["layers"], d_tp, d["k"])
    assert not errs, errs[:5]
    # Blocks D did not ask for stay untouched.
    untouched = [b for b in range(NB) if b not in D_IDS[0]]
    for bufs in d_kv.values():
        for b in bufs:
            assert not byte_rows(b)[untouched].any()


async def test_nhd_with_heads_split_is_refused_with_its_reason():
    """NHD interleaves heads inside each token: a TP pair that splits heads cannot be read
    without a gather, so kvsvc refuses it by name (the connector asks vLLM for HND)."""
    with pytest.raises(KvsvcError) as e:
        await move("flash_nhd", 2, 1)
    assert e.value.reason == "LAYOUT_MISMATCH", e.value
    assert e.value.metadata.get("kv_memory_layout") == "NHD"


def test_bytes_helper_aliases_non_contiguous_halves():
    t = torch.zeros(NB, 2, 2, BLOCK, HEAD, dtype=torch.bfloat16, device=DEVICE)
    rows = byte_rows(t[:, 1])
    rows[3] = 7
    assert bool((t[3, 1].view(torch.uint8) == 7).all()) and not bool(t[3, 0].view(torch.uint8).any())
    assert np.array_equal(rows.cpu().numpy()[3], np.full(rows.shape[1], 7, np.uint8))
