"""What kvsvc knows about each kind of KV-cache layer, in one place. Pure.

A kind is a leaf spec class of specs.py: full attention, sliding window, MLA, Mamba. Its
policy says how a layer of that kind is read from a layout table, checked, placed in a
rank's pool, compared with the same layer of another engine, and hashed; and which
family it transfers as (SpecFamily: how its bytes split across TP ranks, which is what
mapping/ and verify.py know). Layout code asks ``policy_of(spec)`` instead of testing
classes. A new kind of an existing family is its spec class, a policy here, and its wire
form (protos/, codec.py); a new family also needs its TP split (mapping/) and its
reference bytes (verify.py).
"""

from __future__ import annotations

import enum
import itertools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from kvsvc.errors import FailedPrecondition, FieldViolation, InvalidArgument
from kvsvc.layout.specs import (
    AttentionSpec,
    DType,
    FullAttentionSpec,
    KVCacheSpec,
    KvMemoryLayout,
    MambaSpec,
    MLAAttentionSpec,
    RegionLayout,
    SlidingWindowSpec,
    SpecFamily,
    UniformTypeKVCacheSpecs,
    per_rank_heads,
)
from kvsvc.layout.violation import Violation, violation
from kvsvc.limits import MAX_STATE_PAGE_BYTES
from kvsvc.reasons import Reason


class RegionKind(enum.Enum):
    """What one region of a rank's pool holds for a layer."""

    KEY = "key"
    VALUE = "value"
    KV = "kv"  # K and V of a token packed inside each head (packed_kv)
    LATENT = "latent"
    SSM_STATE = "ssm_state"


@dataclass(frozen=True, slots=True)
class Part:
    """One region of a layer inside an allocation: where a block's bytes of it start (from
    the block's start in the allocation), how many, and their geometry (attention: heads x
    tokens x head_bytes, head-major or not; latent: one head; state: opaque)."""

    kind: RegionKind
    offset: int
    length: int
    heads: int = 0
    tokens: int = 0
    head_bytes: int = 0
    head_major: bool = True
    elements: tuple[int, ...] = ()  # a block of it as typed elements (what an engine views it as)
    dtype: DType | None = None  # ... of this type


@dataclass(frozen=True, slots=True)
class Allocation:
    """One run of num_blocks blocks of `stride` bytes holding the parts of a layer."""

    stride: int
    parts: tuple[Part, ...]


def check_keys(table: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    """A layout table may have the keys allowed, and no other: a misspelt key is named,
    not ignored (a misspelt `num_block = 4096` once gave the default 64 blocks unsaid)."""
    if not isinstance(table, Mapping):
        raise InvalidArgument(Reason.INVALID_LAYOUT, f"{where} must be a table, not {type(table).__name__}",
                              {"where": where})
    unknown = sorted(str(k) for k in table if k not in allowed)
    if unknown:
        raise InvalidArgument(Reason.UNKNOWN_LAYOUT_KEY, f"{where} has unknown keys {unknown}; it may have "
                              f"{sorted(allowed)}", {"where": where, "unknown": ",".join(unknown)})


def table_int(table: Mapping[str, Any], key: str, default: int, where: str) -> int:
    """An integer value of a layout table: a whole number, never a float, a bool or a string
    (`num_blocks = 4.7` once loaded 4 blocks, `block_size = true` a block of 1, unsaid)."""
    value = table.get(key, default)
    if not _whole(value):
        raise InvalidArgument(Reason.INVALID_LAYOUT, f"{where}.{key} must be a whole number, not {value!r}",
                              {"field": f"{where}.{key}", "value": repr(value)[:64]})
    return int(value)


def _whole(value: object) -> bool:
    """An integer of any integer type (an engine's sizes may be numpy's), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def table_str(table: Mapping[str, Any], key: str, default: str, where: str) -> str:
    """A string value of a layout table (a number is not taken as its digits)."""
    value = table.get(key, default)
    if not isinstance(value, str):
        raise InvalidArgument(Reason.INVALID_LAYOUT, f"{where}.{key} must be a string, not {value!r}",
                              {"field": f"{where}.{key}", "value": repr(value)[:64]})
    return value


def table_list(table: Mapping[str, Any], key: str, default: list[Any], where: str) -> list[Any]:
    """A list value of a layout table (an array of tables, or of numbers)."""
    value = table.get(key, default)
    if not isinstance(value, list | tuple):
        raise InvalidArgument(Reason.INVALID_LAYOUT, f"{where}.{key} must be a list, not {type(value).__name__}",
                              {"field": f"{where}.{key}"})
    return list(value)


S = TypeVar("S", bound=KVCacheSpec)  # the spec class a policy is for
A = TypeVar("A", bound=AttentionSpec)


class KindPolicy(Generic[S]):
    """A kind's answers. Subclasses set the class attributes and override what differs."""

    spec_type: ClassVar[type[KVCacheSpec]]
    family: ClassVar[SpecFamily]
    table_kind: ClassVar[str]  # its `kind` in a layout table (TOML, the demo)
    # Its wire form: the KvCacheSpec field it travels in, and (to_wire / from_wire) that
    # message's fields as a mapping (dtypes as DType; codec.py makes the message of it, so
    # this layer stays free of protobuf).
    wire_kind: ClassVar[str]
    table_keys: ClassVar[frozenset[str]]  # the keys its table may have
    # Its block list follows the request's tokens, a block per block_size of them: cut to
    # the request's length, and it must cover it. Not so for a sliding-window group (which
    # may name only its window's blocks) or a state group (a request's state, not its tokens).
    blocks_cover_tokens: ClassVar[bool] = True

    def from_table(self, d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType,
                   where: str) -> KVCacheSpec:
        """The spec of a layer from its table (keys already checked; heads: per rank)."""
        raise NotImplementedError

    def to_wire(self, spec: S) -> dict[str, Any]:
        raise NotImplementedError

    def from_wire(self, fields: Mapping[str, Any], block: int) -> KVCacheSpec:
        """A spec from its wire fields (a field left out is 0; dtype, always there, a DType)."""
        raise NotImplementedError

    def allocations(self, spec: S, memory_order: KvMemoryLayout, region_layout: RegionLayout) -> list[Allocation]:
        """Where a layer's blocks live in a rank's pool, allocation by allocation."""
        raise NotImplementedError

    def check(self, spec: S, where: str, total_num_kv_heads: int, tp_size: int | None) -> list[FieldViolation]:
        """What is malformed in a layer's spec (tp_size: check per-rank counts against it)."""
        return []

    def compare(self, layer: str, ls: S, rs: S) -> list[Violation]:
        """The rules the same layer of two engines (both of this kind) breaks."""
        return []

    def hash_item(self, spec: S) -> dict[str, object]:
        """What of a layer two compatible engines share whatever their TP and block size."""
        return {}


class _Attention(KindPolicy[A]):
    """K and V per head: heads split across TP ranks (or replicated past K)."""

    family = SpecFamily.ATTENTION

    def allocations(self, spec: A, memory_order: KvMemoryLayout,
                    region_layout: RegionLayout) -> list[Allocation]:
        e = spec.dtype.itemsize
        hv = spec.value_head_size if isinstance(spec, FullAttentionSpec) else spec.head_size
        k_len = spec.block_size * spec.num_kv_heads * spec.head_size * e
        v_len = spec.block_size * spec.num_kv_heads * hv * e
        hnd = memory_order is KvMemoryLayout.HND
        heads, tokens = spec.num_kv_heads, spec.block_size

        def part(kind: RegionKind, offset: int, length: int, head: int) -> Part:
            return Part(kind, offset, length, heads, tokens, head * e, hnd,
                        (heads, tokens, head) if hnd else (tokens, heads, head), spec.dtype)

        key = part(RegionKind.KEY, 0, k_len, spec.head_size)
        if region_layout is RegionLayout.PACKED_KV:
            # A head's row is K then V of one token: heads stay outermost (HND), so a head
            # slice of a block is still one contiguous run.
            return [Allocation(k_len + v_len, (part(RegionKind.KV, 0, k_len + v_len, spec.head_size + hv),))]
        if region_layout is RegionLayout.BLOCKS_FIRST:
            return [Allocation(k_len + v_len, (key, part(RegionKind.VALUE, k_len, v_len, hv)))]
        return [Allocation(k_len, (key,)), Allocation(v_len, (part(RegionKind.VALUE, 0, v_len, hv),))]

    def check(self, spec: A, where: str, total_num_kv_heads: int,
              tp_size: int | None) -> list[FieldViolation]:
        bad = []
        if spec.head_size <= 0:
            bad.append(FieldViolation(where + ".head_size", "must be positive"))
        if spec.num_kv_heads <= 0:
            bad.append(FieldViolation(where + ".num_kv_heads_per_rank", "must be positive"))
        elif tp_size and spec.num_kv_heads != per_rank_heads(total_num_kv_heads, tp_size):
            bad.append(FieldViolation(
                where + ".num_kv_heads_per_rank",
                f"is {spec.num_kv_heads} but K={total_num_kv_heads} over TP {tp_size} "
                f"gives {per_rank_heads(total_num_kv_heads, tp_size)}"))
        return bad

    def compare(self, layer: str, ls: A, rs: A) -> list[Violation]:
        out = []
        if ls.dtype is not rs.dtype:
            out.append(violation(Reason.DTYPE_MISMATCH,
                                 f"layer {layer} dtypes differ: {ls.dtype.type_name} vs {rs.dtype.type_name}",
                                 layer=layer, local_dtype=ls.dtype.type_name, remote_dtype=rs.dtype.type_name))
        lv = ls.value_head_size if isinstance(ls, FullAttentionSpec) else ls.head_size
        rv = rs.value_head_size if isinstance(rs, FullAttentionSpec) else rs.head_size
        if (ls.head_size, lv) != (rs.head_size, rv):
            out.append(violation(Reason.HEAD_SIZE_MISMATCH,
                                 f"layer {layer} head sizes differ: {ls.head_size} vs {rs.head_size}",
                                 layer=layer, local_head_size=ls.head_size, remote_head_size=rs.head_size))
        return out

    def hash_item(self, spec: A) -> dict[str, object]:
        return {"head_size": spec.head_size, "dtype": spec.dtype.type_name}


class FullAttention(_Attention[FullAttentionSpec]):
    spec_type = FullAttentionSpec
    table_kind = "full_attention"
    table_keys = frozenset({"kind", "dtype", "head_size", "head_size_v"})

    def from_table(self, d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType,
                   where: str) -> KVCacheSpec:
        return FullAttentionSpec(block, heads, table_int(d, "head_size", 64, where), dtype,
                                 table_int(d, "head_size_v", 0, where))

    wire_kind = "full_attention"

    def to_wire(self, spec: FullAttentionSpec) -> dict[str, Any]:
        return {"num_kv_heads_per_rank": spec.num_kv_heads, "head_size": spec.head_size,
                "head_size_v": spec.head_size_v, "dtype": spec.dtype}

    def from_wire(self, fields: Mapping[str, Any], block: int) -> KVCacheSpec:
        return FullAttentionSpec(block, fields.get("num_kv_heads_per_rank", 0), fields.get("head_size", 0),
                                 fields["dtype"], fields.get("head_size_v", 0))

    def hash_item(self, spec: FullAttentionSpec) -> dict[str, object]:
        return {**super().hash_item(spec), "head_size_v": spec.value_head_size}


class SlidingWindow(_Attention[SlidingWindowSpec]):
    spec_type = SlidingWindowSpec
    table_kind = "sliding_window"
    table_keys = frozenset({"kind", "dtype", "head_size", "sliding_window"})
    blocks_cover_tokens = False

    def from_table(self, d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType,
                   where: str) -> KVCacheSpec:
        return SlidingWindowSpec(block, heads, table_int(d, "head_size", 64, where), dtype,
                                 table_int(d, "sliding_window", 128, where))

    wire_kind = "sliding_window"

    def to_wire(self, spec: SlidingWindowSpec) -> dict[str, Any]:
        return {"num_kv_heads_per_rank": spec.num_kv_heads, "head_size": spec.head_size, "dtype": spec.dtype,
                "sliding_window_tokens": spec.sliding_window}

    def from_wire(self, fields: Mapping[str, Any], block: int) -> KVCacheSpec:
        return SlidingWindowSpec(block, fields.get("num_kv_heads_per_rank", 0), fields.get("head_size", 0),
                                 fields["dtype"], fields.get("sliding_window_tokens", 0))

    def hash_item(self, spec: SlidingWindowSpec) -> dict[str, object]:
        return {**super().hash_item(spec), "window": spec.sliding_window}


class MLA(_Attention[MLAAttentionSpec]):
    """Multi-head latent attention: one latent vector per token, the same on every rank."""

    spec_type = MLAAttentionSpec
    family = SpecFamily.MLA
    table_kind = "mla"
    table_keys = frozenset({"kind", "dtype", "head_size"})

    def from_table(self, d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType,
                   where: str) -> KVCacheSpec:
        return MLAAttentionSpec(block, 1, table_int(d, "head_size", 576, where), dtype)

    wire_kind = "mla_attention"

    def to_wire(self, spec: MLAAttentionSpec) -> dict[str, Any]:
        return {"head_size": spec.head_size, "dtype": spec.dtype}

    def from_wire(self, fields: Mapping[str, Any], block: int) -> KVCacheSpec:
        return MLAAttentionSpec(block, 1, fields.get("head_size", 0), fields["dtype"])

    def allocations(self, spec: MLAAttentionSpec, memory_order: KvMemoryLayout,
                    region_layout: RegionLayout) -> list[Allocation]:
        length = spec.page_size_bytes()
        latent = Part(RegionKind.LATENT, 0, length, heads=1, tokens=spec.block_size,
                      head_bytes=spec.head_size * spec.dtype.itemsize, elements=(spec.block_size, spec.head_size),
                      dtype=spec.dtype)
        return [Allocation(length, (latent,))]

    def check(self, spec: MLAAttentionSpec, where: str, total_num_kv_heads: int,
              tp_size: int | None) -> list[FieldViolation]:
        bad = []
        if spec.head_size <= 0:
            bad.append(FieldViolation(where + ".head_size", "must be positive"))
        if spec.num_kv_heads != 1:
            bad.append(FieldViolation(where + ".num_kv_heads", "MLA holds exactly one latent head"))
        return bad

    def hash_item(self, spec: MLAAttentionSpec) -> dict[str, object]:
        return {**super().hash_item(spec), "head_size_v": spec.value_head_size}


class Mamba(KindPolicy[MambaSpec]):
    """Mamba (SSM) state: opaque bytes per block, sharded contiguously across TP ranks."""

    spec_type = MambaSpec
    family = SpecFamily.SSM
    table_kind = "mamba"
    table_keys = frozenset({"kind", "dtype", "states", "page_size_bytes"})
    blocks_cover_tokens = False
    state_keys = frozenset({"shape", "dtype"})

    def from_table(self, d: Mapping[str, Any], *, heads: int, tp_size: int, block: int, dtype: DType,
                   where: str) -> KVCacheSpec:
        states = table_list(d, "states", [{"shape": [8, 16]}], where)
        shapes = []
        for si, st in enumerate(states):
            at = f"{where}.states[{si}]"
            check_keys(st, self.state_keys, at)
            full = table_list(st, "shape", [], at)
            if not full or not all(_whole(x) for x in full):
                raise InvalidArgument(Reason.INVALID_LAYOUT, f"{at}.shape must be a list of whole numbers, not "
                                      f"{full!r}"[:200], {"field": f"{at}.shape"})
            full = [int(x) for x in full]
            if full[0] % tp_size:
                raise InvalidArgument(Reason.TP_NOT_DIVISIBLE,
                                      f"mamba state dim 0 ({full[0]}) is not divisible by TP {tp_size}",
                                      {"state_dim0": full[0], "tp_size": tp_size})
            shapes.append((full[0] // tp_size, *full[1:]))
        dtypes = tuple(DType.parse(st["dtype"]) if "dtype" in st else dtype for st in states)
        return MambaSpec(block, tuple(shapes), dtypes, table_int(d, "page_size_bytes", 0, where))

    wire_kind = "mamba"

    def to_wire(self, spec: MambaSpec) -> dict[str, Any]:
        return {"states": [{"shape": list(s), "dtype": d} for s, d in zip(spec.shapes, spec.dtypes, strict=True)],
                "page_size_bytes": spec.page_bytes}

    def from_wire(self, fields: Mapping[str, Any], block: int) -> KVCacheSpec:
        states = fields.get("states", [])
        return MambaSpec(block, tuple(tuple(st.get("shape", ())) for st in states),
                         tuple(st["dtype"] for st in states), int(fields.get("page_size_bytes", 0)))

    def allocations(self, spec: MambaSpec, memory_order: KvMemoryLayout,
                    region_layout: RegionLayout) -> list[Allocation]:
        parts = zip(spec.state_bytes(), spec.shapes, spec.dtypes, strict=True)
        if not spec.page_bytes:  # each state packed in a region of its own
            return [Allocation(length, (Part(RegionKind.SSM_STATE, 0, length, elements=tuple(shape), dtype=dtype),))
                    for length, shape, dtype in parts]
        # One page per block, the states back to back at its start (the engine pads the rest):
        # still a region per state, each stepping by the page.
        offsets = itertools.accumulate(spec.state_bytes()[:-1], initial=0)
        return [Allocation(spec.page_bytes, tuple(
            Part(RegionKind.SSM_STATE, at, length, elements=tuple(shape), dtype=dtype)
            for at, (length, shape, dtype) in zip(offsets, parts, strict=True)))]

    def check(self, spec: MambaSpec, where: str, total_num_kv_heads: int,
              tp_size: int | None) -> list[FieldViolation]:
        if not spec.shapes or len(spec.shapes) != len(spec.dtypes):
            return [FieldViolation(where + ".states", "needs one dtype per state shape, at least one")]
        if any(d <= 0 for s in spec.shapes for d in s) or any(not s for s in spec.shapes):
            return [FieldViolation(where + ".states", "state dimensions must be positive")]
        held = sum(spec.state_bytes())
        if spec.page_bytes and not held <= spec.page_bytes <= MAX_STATE_PAGE_BYTES:
            return [FieldViolation(where + ".page_size_bytes", f"is {spec.page_bytes}: a page holds the states' "
                                   f"{held} bytes and is at most {MAX_STATE_PAGE_BYTES} (0: packed)")]
        return []

    def compare(self, layer: str, ls: MambaSpec, rs: MambaSpec) -> list[Violation]:
        if len(ls.shapes) != len(rs.shapes):
            return [violation(Reason.REGION_COUNT_MISMATCH, f"layer {layer} has {len(ls.shapes)} state regions "
                              f"locally and {len(rs.shapes)} remotely", layer=layer, local_regions=len(ls.shapes),
                              remote_regions=len(rs.shapes))]
        if ls.dtypes != rs.dtypes or [s[1:] for s in ls.shapes] != [s[1:] for s in rs.shapes]:
            return [violation(Reason.SSM_SHAPE_MISMATCH, f"layer {layer} state shapes or dtypes differ: "
                              f"{ls.shapes} vs {rs.shapes}", layer=layer, local_shapes=ls.shapes,
                              remote_shapes=rs.shapes)]
        return []

    def hash_item(self, spec: MambaSpec) -> dict[str, object]:
        return {"trailing": [list(s[1:]) for s in spec.shapes], "dtypes": [d.type_name for d in spec.dtypes]}


KINDS: tuple[KindPolicy[Any], ...] = (FullAttention(), SlidingWindow(), MLA(), Mamba())
_BY_TYPE = {p.spec_type: p for p in KINDS}
BY_TABLE_KIND = {p.table_kind: p for p in KINDS}
BY_WIRE_KIND = {p.wire_kind: p for p in KINDS}


def policy_of(spec: KVCacheSpec | type[KVCacheSpec]) -> KindPolicy[Any]:
    """The policy of a leaf spec (or spec class); UNKNOWN_SPEC_TYPE for one kvsvc has none for."""
    spec_type = spec if isinstance(spec, type) else type(spec)
    policy = _BY_TYPE.get(spec_type)
    if policy is None:
        raise InvalidArgument(Reason.UNKNOWN_SPEC_TYPE, f"spec type {spec_type.__name__} has no transfer family")
    return policy


def representative_spec_type(spec: KVCacheSpec) -> type[KVCacheSpec]:
    """The class that stands for a group: a uniform wrapper's first inner spec's class."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        if not spec.kv_cache_specs:
            raise InvalidArgument(Reason.EMPTY_GROUP, "a uniform-type spec needs at least one layer")
        return type(spec.kv_cache_specs[0][1])
    return type(spec)


def spec_family_of_type(spec_type: type[KVCacheSpec]) -> SpecFamily:
    """Family of a (leaf) spec class."""
    return policy_of(spec_type).family


def spec_family(spec: KVCacheSpec) -> SpecFamily:
    """Family of a group spec, looking at every inner spec of a uniform wrapper.

    The representative type alone is not enough: a wrapper whose first layer is MLA but
    whose later layers are not would be transferred with the wrong geometry, so mixed
    wrappers are rejected here.
    """
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return spec_family_of_type(type(spec))
    families = {name: spec_family_of_type(type(inner)) for name, inner in spec.layer_specs()}
    distinct = sorted({f.value for f in families.values()})
    if len(distinct) > 1:
        # A well-formed request for an unsupported combination: FAILED_PRECONDITION.
        raise FailedPrecondition(
            Reason.MIXED_FAMILY_GROUP,
            "a uniform-type group mixes spec families "
            + ", ".join(f"{n}={f.value}" for n, f in families.items())
            + "; split it into one group per family",
            {"families": ",".join(distinct)},
        )
    for name, inner in spec.layer_specs():
        if isinstance(inner, UniformTypeKVCacheSpecs):
            raise InvalidArgument(Reason.NESTED_UNIFORM_GROUP, f"layer {name} nests a uniform-type spec")
    return spec_family_of_type(representative_spec_type(spec))
