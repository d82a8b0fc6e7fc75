"""The parts of SGLang's kvsvc backend that need no SGLang: its pools as a kvsvc layout (with
real memory registered region by region) and its ZMQ messages. The backend itself runs
against real SGLang servers in tests/sglang."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsvc.errors import FailedPrecondition
from kvsvc.integrations.sglang import wire
from kvsvc.integrations.sglang.layout import SGLangPools, SGLangWindowPool, describe
from kvsvc.layout.build import layout_from_dict
from kvsvc.layout.regions import RegionKind, build_pool_layout
from kvsvc.memory.pools import RegionBuffersPool
from kvsvc.v1 import kv_transfer_pb2 as pb


def mha(layers: int = 3, pages: int = 9, page: int = 1, heads: int = 2, head_dim: int = 8, vdim: int = 8,
        total: int = 4, tp: int = 2) -> tuple[SGLangPools, list[np.ndarray]]:
    """SGLang's MHA pool as KVArgs gives it: every layer's K buffer, then every layer's V."""
    k = [np.zeros((pages, page * heads * head_dim * 2), np.uint8) for _ in range(layers)]
    v = [np.zeros((pages, page * heads * vdim * 2), np.uint8) for _ in range(layers)]
    bufs = k + v
    return SGLangPools([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [b.shape[1] for b in bufs], page,
                       False, total, tp, "m|kv=auto"), bufs


def test_an_mha_pool_is_split_kv_layer_by_layer_over_sglangs_own_memory():
    pools, bufs = mha()
    d = describe(pools)
    layout = d.layout
    layout.validate(2)
    regions = build_pool_layout(layout).regions
    assert [r.kind for r in regions] == [RegionKind.KEY, RegionKind.VALUE] * 3
    assert layout.num_blocks == 9 and layout.block_size == 1
    # Region i is SGLang's buffer: K of layer l is buffer l, V of layer l is buffer layers + l.
    assert [r.address for r in d.buffers] == [bufs[0].ctypes.data, bufs[3].ctypes.data, bufs[1].ctypes.data,
                                              bufs[4].ctypes.data, bufs[2].ctypes.data, bufs[5].ctypes.data]
    pool = RegionBuffersPool(0, regions, d.buffers)
    assert [pool.region_address(r) for r in regions] == [b.address for b in d.buffers]
    # A head's row is head_dim bf16 values: 16 bytes (the layout counts bytes, dtype uint8).
    spec = layout.groups[0].spec
    assert spec.head_size == 16 and spec.num_kv_heads == 2


def test_a_sliding_window_pool_is_a_second_group_with_its_own_page_count():
    """A hybrid-SWA model: full layers in the KV pool, window layers in SGLang's SWA state
    component, a smaller pool; its regions follow the full ones, over its own buffers."""
    pools, _ = mha(layers=2, pages=9)
    swa_bufs = [np.zeros((5, 2 * 8 * 2), np.uint8) for _ in range(4)]  # 2 layers' K, then V: 5 pages
    pools = dataclasses.replace(pools, swa=SGLangWindowPool([b.ctypes.data for b in swa_bufs],
                                                            [b.nbytes for b in swa_bufs],
                                                            [b.shape[1] for b in swa_bufs], 32))
    d = describe(pools)
    layout = d.layout
    layout.validate(2)
    assert [(g.name, layout.group_blocks(i)) for i, g in enumerate(layout.groups)] == [("kv", 9), ("swa", 5)]
    assert layout.groups[1].spec.sliding_window == 32
    regions = build_pool_layout(layout).regions
    assert [(r.group_index, r.kind, r.num_blocks) for r in regions] == [
        (0, RegionKind.KEY, 9), (0, RegionKind.VALUE, 9), (0, RegionKind.KEY, 9), (0, RegionKind.VALUE, 9),
        (1, RegionKind.KEY, 5), (1, RegionKind.VALUE, 5), (1, RegionKind.KEY, 5), (1, RegionKind.VALUE, 5)]
    assert [r.address for r in d.buffers[4:]] == [swa_bufs[0].ctypes.data, swa_bufs[2].ctypes.data,
                                                  swa_bufs[1].ctypes.data, swa_bufs[3].ctypes.data]
    pool = RegionBuffersPool(0, regions, d.buffers)
    assert [pool.region_address(r) for r in regions] == [b.address for b in d.buffers]


def test_the_typed_layout_is_the_one_a_layout_table_of_the_same_pools_gives():
    """An engine's layout and a [layout] table describing the same pools compare equal, layer
    names included (a standalone server configured by TOML peers with an engine's)."""
    pools, _ = mha(layers=3, pages=9, page=4)
    table = {"model_id": "m|kv=auto", "total_num_kv_heads": 4, "block_size": 4, "num_blocks": 9, "dtype": "uint8",
             "kv_memory_layout": "NHD", "region_layout": "split_kv",
             "groups": [{"name": "kv", "kind": "full_attention", "num_layers": 3, "head_size": 16,
                         "head_size_v": 16}]}
    assert describe(pools).layout == layout_from_dict(table, 2)


def test_one_token_pages_split_heads_between_tp_sizes_larger_pages_do_not():
    assert describe(mha(page=1)[0]).layout.memory_order.value == "HND"
    assert describe(mha(page=4)[0]).layout.memory_order.value == "NHD"


def test_replicated_heads_and_different_value_sizes():
    pools, _ = mha(heads=1, total=2, tp=4, vdim=4)  # TP 4 > 2 heads: one head a rank, replicated
    layout = describe(pools).layout
    layout.validate(4)
    spec = layout.groups[0].spec
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v) == (1, 16, 8)


def test_an_mla_pool_is_one_latent_region_a_layer():
    lat = [np.zeros((5, 576 * 2), np.uint8) for _ in range(2)]
    d = describe(SGLangPools([b.ctypes.data for b in lat], [b.nbytes for b in lat], [b.shape[1] for b in lat], 1,
                             True, 1, 2, "m"))
    layout = d.layout
    layout.validate(2)
    assert layout.is_mla and [r.kind for r in build_pool_layout(layout).regions] == [RegionKind.LATENT] * 2


@pytest.mark.parametrize("change,reason", [
    (dict(kv_item_lens=[33] * 6), "whole number"),  # lengths not a multiple of the page
    (dict(kv_data_lens=[64] * 6), "different page counts"),
    (dict(kv_data_ptrs=[1, 2, 3]), "3 KV buffers"),
    (dict(page_size=0), "page size"),
])
def test_what_sglang_describes_inconsistently_is_refused_with_the_values(change, reason):
    pools, bufs = mha()
    fields = {**pools.__dict__, **change}
    if "kv_data_lens" in change:
        fields["kv_data_lens"] = [b.nbytes for b in bufs[:5]] + [b.shape[1] * 4 for b in bufs[5:]]
        fields["kv_item_lens"] = [b.shape[1] for b in bufs]
    if "kv_data_ptrs" in change:
        fields.update(kv_data_lens=[64] * 3, kv_item_lens=[32] * 3)
    with pytest.raises(FailedPrecondition) as e:
        describe(SGLangPools(**fields))
    assert e.value.reason == "UNSUPPORTED_KV_LAYOUT" and reason in e.value.message


def test_metadata_and_ready_round_trip_and_bad_frames_are_refused():
    m = wire.Metadata(7, "10.0.0.1", 5000, 1, np.array([3, 4, 5], np.int32), 2, 2, 16, False)
    back = wire.Metadata.parse(m.frames())
    assert (back.room, back.ip, back.port, back.rank, list(back.pages), back.aux_index, back.d_ranks_expected,
            back.decode_prefix_len, back.is_dummy) == (7, "10.0.0.1", 5000, 1, [3, 4, 5], 2, 2, 16, False)
    params = pb.TransferParams(remote_request_id="sglang-7", lease_token="t" * 32, remote_tp_size=2)
    r = wire.Ready.parse(wire.Ready(7, 1, params, [b"a", b"bc"]).frames())
    assert (r.room, r.p_rank, r.params, r.aux) == (7, 1, params, [b"a", b"bc"])
    for bad in ([wire.METADATA, b"x"], m.frames()[:9], [*m.frames()[:5], b"abc", *m.frames()[6:]],
                [wire.METADATA, b"seven", *m.frames()[2:]], [wire.READY, b"1", b"0", b"\xff\xff"],
                [wire.READY, b"1"]):
        with pytest.raises(wire.Malformed):
            (wire.Metadata if bad[0] == wire.METADATA else wire.Ready).parse(bad)


def piece(rank: int, **over: object) -> wire.Ready:
    p = pb.TransferParams(remote_address=f"h:{rank}", remote_request_id="sglang-1", lease_token="t" * 32,
                          remote_tp_size=2, remote_engine_id="e", remote_epoch=rank + 10,
                          remote_block_ids_per_group=[pb.BlockIds(block_ids=[1, 2])],
                          remote_servers=[pb.EngineServer(address=f"h:{rank}", ranks=[rank], epoch=rank + 10)])
    for k, v in over.items():
        setattr(p, k, v)
    return wire.Ready(1, rank, p, [])


def test_the_p_ranks_pieces_join_into_one_params_naming_every_server():
    joined = wire.join_params([piece(1), piece(0)])
    assert [(s.address, list(s.ranks), s.epoch) for s in joined.remote_servers] == [("h:0", [0], 10),
                                                                                   ("h:1", [1], 11)]
    assert joined.remote_address == "h:0" and joined.remote_epoch == 10
    with pytest.raises(wire.Malformed):
        wire.join_params([piece(0), piece(1, lease_token="u" * 32)])
    other = piece(1)
    other.params.remote_block_ids_per_group[0].block_ids.append(3)
    with pytest.raises(wire.Malformed):
        wire.join_params([piece(0), other])
