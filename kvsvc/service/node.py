"""The state one server owns: config, layout, epoch; and the pure planning it serves."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from kvsvc import __version__
from kvsvc.codec import layout_to_proto, rank_plan_to_proto, region_to_proto
from kvsvc.config import Role, ServerConfig
from kvsvc.errors import InvalidArgument
from kvsvc.layout.compat import compatibility_hash
from kvsvc.mapping.planner import RankPlan, Side, plan_rank, validate_pair
from kvsvc.v1 import kv_transfer_pb2 as pb

_ROLES = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE, Role.BOTH: pb.ROLE_BOTH}


def new_epoch() -> int:
    """A fresh 63-bit epoch: differs on every start, so stale leases and handshakes show."""
    return secrets.randbits(63) or 1


class Node:
    """One engine's ranks on this node, as the control plane sees them."""

    def __init__(self, config: ServerConfig) -> None:
        config.validate()
        self.config = config
        self.layout = config.layout()
        self.side = Side.of(self.layout, config.tp_size)
        self.layout_hash = compatibility_hash(self.layout)
        self.epoch = new_epoch()
        self.address = config.advertised_address or config.listen

    def bind(self, address: str) -> None:
        """Record the bound address (port 0 resolved) unless one is advertised."""
        self.address = self.config.advertised_address or address

    async def start(self) -> None:
        """Start what the node owns beyond config (the data plane, when present)."""

    async def close(self) -> None:
        """Release what start() acquired; idempotent."""

    @property
    def hosted_ranks(self) -> tuple[int, ...]:
        return self.config.ranks

    def check_ranks(self, ranks: Sequence[int], field: str) -> tuple[int, ...]:
        """The ranks asked for (all hosted when empty); RANK_NOT_HOSTED otherwise."""
        if not ranks:
            return self.hosted_ranks
        missing = [r for r in ranks if r not in self.hosted_ranks]
        if missing:
            raise InvalidArgument(
                "RANK_NOT_HOSTED", f"{field}: ranks {missing} are not hosted here (hosted: {list(self.hosted_ranks)})",
                {"ranks": ",".join(map(str, missing)), "hosted_ranks": ",".join(map(str, self.hosted_ranks))},
            )
        return tuple(dict.fromkeys(ranks))

    def plan(
        self, remote: Side, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]],
        ranks: Sequence[int],
    ) -> list[RankPlan]:
        validate_pair(self.side, remote)
        return [plan_rank(self.side, remote, r, local_ids, remote_ids, validated=True) for r in ranks]

    def plan_response(self, plans: Sequence[RankPlan], summary_only: bool) -> pb.PlanTransferResponse:
        msg = pb.PlanTransferResponse(
            rank_plans=[rank_plan_to_proto(p, summary_only) for p in plans],
            total_bytes=sum(p.nbytes for p in plans),
            total_descriptors=sum(p.num_descriptors for p in plans),
        )
        if plans:
            msg.prefix_blocks_skipped_per_group.extend(plans[0].prefix_blocks_skipped)
        return msg

    def info(self) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(
            engine_id=self.config.engine_id, role=_ROLES[self.config.role], tp_size=self.config.tp_size,
            hosted_ranks=list(self.hosted_ranks), layout=layout_to_proto(self.layout),
            layout_hash=self.layout_hash, epoch=self.epoch, server_version=__version__,
            capabilities=["plan"], advertised_address=self.address,
        )

    def region_table(self, base_address: int = 0) -> list[pb.RegionInfo]:
        return [region_to_proto(r, base_address + r.pool_offset) for r in self.side.pool.regions]
