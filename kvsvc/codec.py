"""Conversion between kvsvc's pure values (layout, plans, regions) and kvsvc.v1 messages.

Imports protobuf messages only (no grpc); rejects UNSPECIFIED enums and malformed
messages with INVALID_ARGUMENT and a field path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message

from kvsvc.errors import FieldViolation, InvalidArgument
from kvsvc.layout.engine import EngineLayout, KVCacheGroup, KvMemoryLayout, RegionLayout
from kvsvc.layout.kinds import BY_WIRE_KIND, policy_of
from kvsvc.layout.regions import Region, RegionKind
from kvsvc.layout.specs import DType, KVCacheSpec, UniformTypeKVCacheSpecs
from kvsvc.limits import MAX_DIM, MAX_GROUPS, MAX_LAYERS, MAX_NUM_BLOCKS, MAX_TP_SIZE, check_count, check_id, too_big
from kvsvc.mapping.planner import RankPlan
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

_DTYPES = {
    DType.FLOAT16: pb.DTYPE_FLOAT16, DType.BFLOAT16: pb.DTYPE_BFLOAT16, DType.FLOAT32: pb.DTYPE_FLOAT32,
    DType.FLOAT8_E4M3: pb.DTYPE_FLOAT8_E4M3, DType.FLOAT8_E5M2: pb.DTYPE_FLOAT8_E5M2, DType.UINT8: pb.DTYPE_UINT8,
}
_DTYPES_BACK = {v: k for k, v in _DTYPES.items()}
_MEM = {KvMemoryLayout.HND: pb.KV_MEMORY_LAYOUT_HND, KvMemoryLayout.NHD: pb.KV_MEMORY_LAYOUT_NHD}
_MEM_BACK = {v: k for k, v in _MEM.items()}
_REG = {RegionLayout.SPLIT_KV: pb.REGION_LAYOUT_SPLIT_KV, RegionLayout.BLOCKS_FIRST: pb.REGION_LAYOUT_BLOCKS_FIRST,
        RegionLayout.PACKED_KV: pb.REGION_LAYOUT_PACKED_KV}
_REG_BACK = {v: k for k, v in _REG.items()}
_KIND = {RegionKind.KEY: pb.REGION_KIND_KEY, RegionKind.VALUE: pb.REGION_KIND_VALUE,
         RegionKind.LATENT: pb.REGION_KIND_LATENT, RegionKind.SSM_STATE: pb.REGION_KIND_SSM_STATE,
         RegionKind.KV: pb.REGION_KIND_KV}


def bad_field(field: str, description: str, reason: str = Reason.INVALID_FIELD, **meta: object) -> InvalidArgument:
    return InvalidArgument(reason, f"{field}: {description}", {"field": field, **meta},
                           field_violations=[FieldViolation(field, description)])


def _enum(table: dict, value: int, field: str, enum_name: str) -> object:
    if value not in table:
        raise bad_field(field, f"{enum_name} must be set (got {value}; *_UNSPECIFIED is rejected)",
                   Reason.UNSPECIFIED_ENUM, value=value)
    return table[value]


def _dtype(value: int, field: str) -> DType:
    return _enum(_DTYPES_BACK, value, field, "Dtype")  # type: ignore[return-value]


# ---- specs ---------------------------------------------------------------------------


def spec_to_proto(spec: KVCacheSpec) -> pb.KvCacheSpec:
    """A spec's message: a uniform-type group's layers in turn, a leaf as its kind says
    (layout/kinds.py: the field it travels in and that message's fields)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return pb.KvCacheSpec(uniform_type=pb.UniformTypeSpecs(
            layers=[pb.LayerSpec(layer_name=n, spec=spec_to_proto(s)) for n, s in spec.layer_specs()]))
    policy = policy_of(spec)
    kind = pb.KvCacheSpec.DESCRIPTOR.fields_by_name[policy.wire_kind].message_type
    msg = pb.KvCacheSpec()
    getattr(msg, policy.wire_kind).CopyFrom(_message(kind, policy.to_wire(spec)))
    return msg


def _message(descriptor: Any, fields: Mapping[str, Any]) -> Message:
    """A message of descriptor's type from a kind's wire fields (dtype as DType, nested
    messages as mappings)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        fd = descriptor.fields_by_name[name]
        if name == "dtype":
            out[name] = _DTYPES[value]
        elif fd.message_type is not None:
            out[name] = [_message(fd.message_type, v) for v in value]
        else:
            out[name] = value
    return getattr(pb, descriptor.name)(**out)  # type: ignore[no-any-return]


def _fields(msg: Message, field: str) -> dict[str, Any]:
    """A kind message's fields for its policy's from_wire (the opposite of _message); a
    message with a dtype always has it, checked (UNSPECIFIED is rejected)."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None:
            out[fd.name] = [_fields(v, f"{field}.{fd.name}[{i}]") for i, v in enumerate(value)]
        elif isinstance(value, int | float | str | bytes):
            out[fd.name] = value
        else:  # a repeated scalar field
            out[fd.name] = list(value)
    if "dtype" in msg.DESCRIPTOR.fields_by_name:
        out["dtype"] = _dtype(msg.dtype, f"{field}.dtype")  # type: ignore[attr-defined]
    return out


# Limits of a kind's message, whatever the kind: each dimension (a sliding window is a token
# count, a page a byte count, not dimensions), nested messages (Mamba's states) and the dimensions of a shape.
_NOT_A_DIM = frozenset({"sliding_window_tokens", "dtype", "page_size_bytes"})  # a page: the kind checks it
MAX_NESTED = 16
MAX_SHAPE_DIMS = 8


def _check_dims(msg: pb.KvCacheSpec, field: str) -> None:
    kind = msg.WhichOneof("kind")
    if kind and kind != "uniform_type":
        _check_message_dims(getattr(msg, kind), field)


def _check_message_dims(msg: Message, field: str) -> None:
    for fd, value in msg.ListFields():
        name = f"{field}.{fd.name}"
        if fd.message_type is not None:
            check_count(value, name, MAX_NESTED)
            for i, inner in enumerate(value):
                _check_message_dims(inner, f"{name}[{i}]")
        elif fd.name in _NOT_A_DIM:
            continue
        elif isinstance(value, int):
            if value > MAX_DIM:
                raise too_big(name, value, MAX_DIM, "")
        else:  # a shape
            check_count(value, name, MAX_SHAPE_DIMS)
            if any(d > MAX_DIM for d in value):
                raise too_big(name, max(value), MAX_DIM, "")


def spec_from_proto(msg: pb.KvCacheSpec, block_size: int, field: str) -> KVCacheSpec:
    _check_dims(msg, field)
    kind = msg.WhichOneof("kind")
    if kind == "uniform_type":
        inner = []
        for i, layer in enumerate(msg.uniform_type.layers):
            if layer.spec.WhichOneof("kind") == "uniform_type":
                raise bad_field(f"{field}.layers[{i}]", "a uniform-type spec cannot nest another", Reason.NESTED_UNIFORM_GROUP)
            inner.append((layer.layer_name, spec_from_proto(layer.spec, block_size, f"{field}.layers[{i}].spec")))
        return UniformTypeKVCacheSpecs(block_size, tuple(inner))
    policy = BY_WIRE_KIND.get(kind or "")
    if policy is None:
        raise bad_field(field, "spec kind must be set", Reason.MISSING_FIELD)
    return policy.from_wire(_fields(getattr(msg, kind), field), block_size)


# ---- layout --------------------------------------------------------------------------


def layout_to_proto(layout: EngineLayout) -> pb.KvLayout:
    return pb.KvLayout(
        model_id=layout.model_id, total_num_kv_heads=layout.total_num_kv_heads,
        block_size_tokens=layout.block_size, num_blocks=layout.num_blocks,
        kv_memory_layout=_MEM[layout.kv_memory_layout], region_layout=_REG[layout.region_layout],
        groups=[pb.KvCacheGroup(name=g.name, spec=spec_to_proto(g.spec),
                                layer_names=[] if isinstance(g.spec, UniformTypeKVCacheSpecs) else list(g.layer_names),
                                num_blocks=g.num_blocks)
                for g in layout.groups],
        dcp_size=layout.dcp_size,
    )


def layout_from_proto(msg: pb.KvLayout, field: str = "layout", tp_size: int | None = None) -> EngineLayout:
    """A validated EngineLayout; INVALID_ARGUMENT naming the bad field otherwise."""
    _check_layout_sizes(msg, field)
    mem = _enum(_MEM_BACK, msg.kv_memory_layout, f"{field}.kv_memory_layout", "KvMemoryLayout")
    reg = _enum(_REG_BACK, msg.region_layout, f"{field}.region_layout", "RegionLayout")
    groups = tuple(
        KVCacheGroup(g.name or f"g{i}", spec_from_proto(g.spec, msg.block_size_tokens, f"{field}.groups[{i}].spec"),
                     tuple(g.layer_names), g.num_blocks)
        for i, g in enumerate(msg.groups)
    )
    layout = EngineLayout(msg.model_id, msg.total_num_kv_heads, msg.block_size_tokens, msg.num_blocks, groups,
                          mem, reg, msg.dcp_size or 1)  # type: ignore[arg-type]
    layout.validate(tp_size)
    return layout


def _check_layout_sizes(msg: pb.KvLayout, field: str) -> None:
    """The limits of kvsvc.limits on a layout, before anything is built from it."""
    check_count(msg.groups, f"{field}.groups", MAX_GROUPS)
    layers = sum(max(len(g.layer_names), len(g.spec.uniform_type.layers)) for g in msg.groups)
    if layers > MAX_LAYERS:
        raise too_big(f"{field}.groups", layers, MAX_LAYERS, "layers")
    if msg.dcp_size > MAX_TP_SIZE:
        raise too_big(f"{field}.dcp_size", msg.dcp_size, MAX_TP_SIZE, "ranks")
    if msg.num_blocks > MAX_NUM_BLOCKS:
        raise too_big(f"{field}.num_blocks", msg.num_blocks, MAX_NUM_BLOCKS, "blocks")
    for i, g in enumerate(msg.groups):
        if g.num_blocks > MAX_NUM_BLOCKS:
            raise too_big(f"{field}.groups[{i}].num_blocks", g.num_blocks, MAX_NUM_BLOCKS, "blocks")
    for name in ("total_num_kv_heads", "block_size_tokens"):
        if getattr(msg, name) > MAX_DIM:
            raise too_big(f"{field}.{name}", getattr(msg, name), MAX_DIM, "")
    check_id(msg.model_id, f"{field}.model_id")


# ---- regions, blocks, plans ----------------------------------------------------------


def region_to_proto(r: Region, base_address: int = 0) -> pb.RegionInfo:
    return pb.RegionInfo(
        region_index=r.index, kind=_KIND[r.kind], group_index=r.group_index, layer_name=r.layer_name,
        pool_offset_bytes=r.pool_offset, base_address=base_address, block_len_bytes=r.block_len,
        block_stride_bytes=r.block_stride, num_blocks=r.num_blocks, block_shape=list(r.elements),
        dtype=_DTYPES[r.dtype] if r.dtype is not None else pb.DTYPE_UNSPECIFIED,
    )


def block_ids_to_proto(ids_per_group: Iterable[Sequence[int] | np.ndarray]) -> list[pb.BlockIds]:
    return [pb.BlockIds(block_ids=ids.tolist() if isinstance(ids, np.ndarray) else [int(b) for b in ids])
            for ids in ids_per_group]


def block_ids_from_proto(msgs: Sequence[pb.BlockIds]) -> list[list[int]]:
    return [list(m.block_ids) for m in msgs]


def rank_plan_to_proto(plan: RankPlan, summary_only: bool = False) -> pb.RankPlan:
    msg = pb.RankPlan(
        local_rank=plan.local_rank, tp_ratio=plan.tp_ratio,
        handshake_target_ranks=list(plan.handshake_target_ranks),
        source_ranks_per_group=[pb.BlockIds(block_ids=list(s)) for s in plan.mapping.source_ranks_per_group],
        source_ranks=list(plan.mapping.all_source_ranks), notify_only_ranks=list(plan.notify_only_ranks),
        rank_offset_factor=plan.mapping.rank_offset_factor, bytes=plan.nbytes, num_descriptors=plan.num_descriptors,
    )
    msg.rank_to_attention_slot.update(plan.mapping.rank_to_attention_slot)
    for reads in plan.reads:
        src = msg.reads.add(remote_rank=reads.remote_rank, bytes=reads.nbytes, num_descriptors=reads.num_descriptors)
        if not summary_only:
            for lr, lo, rr, ro, ln in zip(reads.local_region.tolist(), reads.local_offset.tolist(),
                                          reads.remote_region.tolist(), reads.remote_offset.tolist(),
                                          reads.length.tolist(), strict=True):
                src.ranges.add(local_region=lr, local_offset_bytes=lo, remote_region=rr, remote_offset_bytes=ro,
                               length_bytes=ln)
    return msg
