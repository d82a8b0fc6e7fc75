"""The declarative layout of one rank's KV cache: groups, layers, block size, memory order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvsvc.errors import FieldViolation, InvalidArgument
from kvsvc.layout.kinds import policy_of, representative_spec_type, spec_family
from kvsvc.layout.specs import KVCacheSpec, SpecFamily, UniformTypeKVCacheSpecs
from kvsvc.layout.specs import KvMemoryLayout as KvMemoryLayout  # re-exported: the layout's fields
from kvsvc.layout.specs import RegionLayout as RegionLayout
from kvsvc.layout.specs import per_rank_heads as per_rank_heads
from kvsvc.reasons import Reason


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers sharing one block table. layer_names is empty for a uniform-type spec.

    num_blocks: the group's own block count where its pool is not the layout's size (an
    engine with separate pools per group, such as SGLang's sliding-window pool beside the
    full one); 0: the layout's num_blocks."""

    name: str
    spec: KVCacheSpec
    layer_names: tuple[str, ...] = ()
    num_blocks: int = 0

    def layers(self) -> Iterator[tuple[str, KVCacheSpec]]:
        """(layer name, leaf spec) in layer order."""
        if isinstance(self.spec, UniformTypeKVCacheSpecs):
            yield from self.spec.layer_specs()
        else:
            for name in self.layer_names:
                yield name, self.spec

    @property
    def num_layers(self) -> int:
        return sum(1 for _ in self.layers())

    @property
    def family(self) -> SpecFamily:
        return spec_family(self.spec)

    @property
    def spec_type(self) -> type[KVCacheSpec]:
        return representative_spec_type(self.spec)


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """Everything about one rank's cache that a peer must agree with.

    block_size is in tokens; num_blocks is per region and equal on every rank of the
    engine; specs carry per-rank head counts (see per_rank_heads).

    dcp_size: decode context parallelism (MLA only, 1 or the TP size). With DCP > 1 a
    request's tokens are dealt out block by block over the ranks: the block at position
    j of a rank's block list holds the request's block j·dcp_size + rank (MAPPING.md §9).
    """

    model_id: str
    total_num_kv_heads: int
    block_size: int
    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    kv_memory_layout: KvMemoryLayout = KvMemoryLayout.HND
    region_layout: RegionLayout = RegionLayout.SPLIT_KV
    dcp_size: int = 1

    @property
    def memory_order(self) -> KvMemoryLayout:
        """The order a block's bytes really have: a block of one token (SGLang's default page)
        is the same bytes under NHD and HND, heads contiguous, so it splits by heads as HND does."""
        return KvMemoryLayout.HND if self.block_size == 1 else self.kv_memory_layout

    @property
    def group_spec_types(self) -> tuple[type[KVCacheSpec], ...]:
        """Representative spec type per group, in group order (compute_tp_mapping input)."""
        return tuple(g.spec_type for g in self.groups)

    @property
    def is_mla(self) -> bool:
        """True when every attention group is MLA (and there is at least one)."""
        fams = [g.family for g in self.groups if g.family is not SpecFamily.SSM]
        return bool(fams) and all(f is SpecFamily.MLA for f in fams)

    def group_blocks(self, group: int) -> int:
        """Blocks in each region of group `group` (block ids of the group are below this)."""
        return self.groups[group].num_blocks or self.num_blocks

    @property
    def num_layers(self) -> int:
        return sum(1 for g in self.groups for _ in g.layers())

    def validate(self, tp_size: int | None = None) -> None:
        """Raise InvalidArgument listing every malformed field; tp_size checks head counts."""
        bad: list[FieldViolation] = []
        if not self.model_id:
            bad.append(FieldViolation("layout.model_id", "must be set"))
        if self.block_size <= 0:
            bad.append(FieldViolation("layout.block_size_tokens", "must be positive"))
        if self.num_blocks <= 0:
            bad.append(FieldViolation("layout.num_blocks", "must be positive"))
        if not self.groups:
            bad.append(FieldViolation("layout.groups", "needs at least one group"))
        seen: set[str] = set()
        families: set[SpecFamily] = set()
        for gi, group in enumerate(self.groups):
            where = f"layout.groups[{gi}]"
            try:
                families.add(group.family)  # a mixed-family wrapper raises MIXED_FAMILY_GROUP as is
            except InvalidArgument as e:
                bad.append(FieldViolation(where + ".spec", e.message))
                continue
            if group.num_blocks < 0:
                bad.append(FieldViolation(where + ".num_blocks", "must be positive (or 0: the layout's)"))
            layers = list(group.layers())
            if not layers:
                bad.append(FieldViolation(where, f"group {group.name!r} has no layers"))
            for li, (name, spec) in enumerate(layers):
                bad.extend(self._check_leaf(f"{where}.layers[{li}]", name, spec, tp_size))
                if name in seen:
                    bad.append(FieldViolation(f"{where}.layers[{li}]", f"layer {name!r} appears twice"))
                seen.add(name)
        k = self.total_num_kv_heads
        if SpecFamily.ATTENTION in families and k <= 0:
            bad.append(FieldViolation("layout.total_num_kv_heads", "must be positive for attention layers"))
        elif SpecFamily.ATTENTION in families and tp_size and (k % tp_size if tp_size <= k else tp_size % k):
            # TP attention gives each rank K/tp heads, or replicates one head over tp/K ranks;
            # anything else would drop or split heads.
            bad.append(FieldViolation("layout.total_num_kv_heads",
                                      f"{k} KV heads cannot be sharded over TP {tp_size}: one must divide the other"))
        bad.extend(self._check_dcp(tp_size))
        if bad:
            raise InvalidArgument(
                Reason.INVALID_LAYOUT,
                "invalid layout: " + "; ".join(f"{v.field}: {v.description}" for v in bad),
                {"model_id": self.model_id},
                field_violations=bad,
            )

    def _check_dcp(self, tp_size: int | None) -> list[FieldViolation]:
        dcp = self.dcp_size
        if dcp == 1:
            return []
        if dcp < 1:
            return [FieldViolation("layout.dcp_size", "must be positive (1: no decode context parallelism)")]
        bad = []
        if not self.is_mla:
            bad.append(FieldViolation("layout.dcp_size", f"is {dcp} but DCP shards only MLA caches; this layout "
                                      "has other attention groups"))
        if tp_size and dcp != tp_size:
            # A partly replicated, partly sharded cache has no closed-form mapping.
            bad.append(FieldViolation("layout.dcp_size", f"is {dcp} but must be 1 or the TP size {tp_size}"))
        return bad

    def _check_leaf(self, where: str, name: str, spec: KVCacheSpec, tp_size: int | None) -> list[FieldViolation]:
        bad: list[FieldViolation] = []
        if not name:
            bad.append(FieldViolation(where, "layer name must be set"))
        if spec.block_size != self.block_size:
            bad.append(
                FieldViolation(where, f"block_size {spec.block_size} differs from the layout's {self.block_size}")
            )
        bad.extend(policy_of(spec).check(spec, where, self.total_num_kv_heads, tp_size))
        return bad
