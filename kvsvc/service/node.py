"""The state one server owns: config, layout, epoch, pools, NIXL agents, leases and peers."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsvc import __version__
from kvsvc.codec import layout_to_proto, rank_plan_to_proto, region_to_proto
from kvsvc.config import MemoryMode, Role, ServerConfig
from kvsvc.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvsvc.layout.compat import compatibility_hash
from kvsvc.leases.arrivals import LeaseArrivals
from kvsvc.leases.table import LeaseTable
from kvsvc.mapping.planner import Layers, RankPlan, Side, plan_rank, prepare_blocks, validate_pair
from kvsvc.memory.pools import CudaPool, ExternalPool, MemoryKind, Pool, RegionBuffersPool, ShmPool, shm_name_for
from kvsvc.reasons import Reason
from kvsvc.service.faults import Faults
from kvsvc.service.metrics import Metrics
from kvsvc.transport.nixl_agents import NixlDataPlane, nixl_version
from kvsvc.transport.ports import DataPlane
from kvsvc.transport.rdma_check import RdmaCheck
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_ROLES = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE, Role.BOTH: pb.ROLE_BOTH}


def new_epoch() -> int:
    """A fresh 63-bit epoch: differs on every start, so stale leases and handshakes show."""
    return secrets.randbits(63) or 1


def _cuda_ipc_to_proto(share: tuple[Any, ...] | None) -> pb.CudaIpc | None:
    if share is None:
        return None
    _device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = share
    return pb.CudaIpc(handle=bytes(handle), storage_size_bytes=int(size), storage_offset_bytes=int(offset),
                      ref_counter_handle=bytes(ref_handle or b""), ref_counter_offset=int(ref_offset or 0),
                      event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync))


DataPlaneFactory = Callable[[str, int, Mapping[int, Pool], int], DataPlane]
"""(engine id, epoch, pools by rank, copy lanes) -> a data plane not yet started."""


def nixl_data_plane(engine_id: str, epoch: int, pools: Mapping[int, Pool], copy_lanes: int) -> DataPlane:
    return NixlDataPlane(engine_id, epoch, pools, copy_lanes=copy_lanes)


def node_identity() -> str:
    """This host as kvsvc tells hosts apart: its hostname and boot id, hashed. Processes in
    network namespaces of one machine share both, as they share its memory (UCX reaches
    them through shared memory too)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}|{boot}".encode()).hexdigest()[:16]


class Node:
    """One engine's ranks on this node. External pools (embedding mode) replace allocation;
    data_plane makes the data plane over the pools (NIXL unless a test hands in another)."""

    def __init__(self, config: ServerConfig, external_pools: Mapping[int, Any] | None = None,
                 data_plane: DataPlaneFactory = nixl_data_plane) -> None:
        config.validate()
        self.config = config
        self.layout = config.layout()
        self.side = Side.of(self.layout, config.tp_size)
        self.layout_hash = compatibility_hash(self.layout)
        self.epoch = new_epoch()
        self.node_id = node_identity()
        self.rdma = RdmaCheck((), "")  # what start-up found (server.py: check_rdma)
        self.faults = Faults.from_environment(os.environ)  # tests only (service/faults.py)
        self.address = config.advertised_address or config.listen
        self.lease_socket_path = ""  # offered to same-host D servers in the handshake answer
        self.transfer_socket_path = ""  # offered to this server's engine in GetInfo
        self._external = dict(external_pools or {})
        self.pools: dict[int, Pool] = {}
        self._region_bases: dict[int, np.ndarray] = {}
        self.data: DataPlane | None = None
        self._data_plane = data_plane
        self.data_error = ""
        self.metrics = Metrics(config.engine_id)
        if self.faults is not None:
            self.faults.on_inject = self.metrics.fault_injected
        self.leases = LeaseTable(self.epoch, self.hosted_ranks, config.tp_size, config.lease_ttl_s,
                                 config.max_lease_ttl_s, on_live_change=self._leases_live,
                                 on_release=lambda reason: self.metrics.released(reason.value),
                                 max_live=config.max_live_leases, dcp_size=self.layout.dcp_size,
                                 max_leased_blocks=config.max_leased_blocks,
                                 max_claims_per_engine=config.max_claims_per_engine,
                                 arrivals=LeaseArrivals(config.max_waiting_claims_per_engine))
        self._closed = False
        self.health_tasks: set[asyncio.Future[None]] = set()

    # ---- lifecycle ------------------------------------------------------------------

    def bind(self, address: str) -> None:
        """Record the bound address (port 0 resolved) unless one is advertised."""
        self.address = self.config.advertised_address or address

    async def start(self) -> None:
        """Allocate pools and start NIXL agents (unless memory is none), then the lease reaper."""
        self.leases.start()
        if self.config.memory is MemoryMode.NONE and not self._external:
            self.data_error = "memory = none: control plane only"
            return
        size = self.side.pool.size_bytes
        try:
            for rank in self.hosted_ranks:
                self.pools[rank] = self._make_pool(rank, size)
            reads = self.config.role in (Role.DECODE, Role.BOTH)
            self.data = self._data_plane(self.config.engine_id, self.epoch, self.pools,
                                         self.config.copy_threads if reads else 0)
            await self.data.start()
        except BaseException:
            await self.close()
            raise

    def _make_pool(self, rank: int, size: int) -> Pool:
        if rank in self._external:
            given = self._external[rank]
            if isinstance(given, (list, tuple)):  # one buffer per region (per-layer tensors)
                return RegionBuffersPool(rank, self.side.pool.regions, given)
            return ExternalPool(rank, given, size)
        if self.config.memory is MemoryMode.VRAM:
            return CudaPool(rank, size, self.config.device_of(rank), wrap=not self.config.cuda_devices)
        return ShmPool(rank, size, shm_name_for(self.config.engine_id, self.epoch, rank))

    async def close(self) -> None:
        """Release leases, agents and pools; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.leases.close()
        if self.data is not None:
            await self.data.close()
        for pool in self.pools.values():
            pool.close()

    def _leases_live(self, delta: int) -> None:
        # While a peer may be reading a lease (any whole lease; a progressive one until its
        # claimant waits with its READs done: LeaseTable.on_live_change), keep our agents
        # progressing. Over shared memory or RDMA a READ needs nothing of us, but where UCX
        # carries it as messages (TCP between hosts) it moves only when we progress: with the
        # idle beat alone a 1-block READ from another host took 12 ms instead of 1. Only the
        # first readable lease and the last one's end come here: every job the NIXL thread
        # gets restarts its pump at the shortest sleep, and one per lease kept a busy P
        # pumping flat out. The pump then wakes every PROGRESS_MAX_SLEEP_S (4 % of a core here).
        if self.data is not None:
            self.data.need_progress(delta)

    # ---- checks ---------------------------------------------------------------------

    @property
    def hosted_ranks(self) -> tuple[int, ...]:
        return self.config.ranks

    def require_role(self, role: Role, what: str) -> None:
        if self.config.role not in (role, Role.BOTH):
            raise FailedPrecondition(Reason.WRONG_ROLE, f"{what} needs a {role.value} server; this one is "
                                     f"{self.config.role.value}", {"role": self.config.role.value})

    def require_data_plane(self, what: str) -> DataPlane:
        if self.data is None:
            raise Unavailable(Reason.DATA_PLANE_UNAVAILABLE, f"{what} needs the data plane: {self.data_error}")
        if not self.data.alive:
            raise Unavailable(Reason.DATA_PLANE_UNAVAILABLE, f"{what} needs the data plane: it stopped (the NIXL thread ended)")
        return self.data

    def check_ranks(self, ranks: Sequence[int], field: str) -> tuple[int, ...]:
        """The ranks asked for (all hosted when empty); RANK_NOT_HOSTED otherwise."""
        if not ranks:
            return self.hosted_ranks
        missing = [r for r in ranks if r not in self.hosted_ranks]
        if missing:
            raise InvalidArgument(
                Reason.RANK_NOT_HOSTED, f"{field}: ranks {missing} are not hosted here (hosted: {list(self.hosted_ranks)})",
                {"ranks": ",".join(map(str, missing)), "hosted_ranks": ",".join(map(str, self.hosted_ranks))},
            )
        return tuple(dict.fromkeys(ranks))

    # ---- planning -------------------------------------------------------------------

    def plan(self, remote: Side, local_ids: Sequence[Sequence[int] | np.ndarray],
             remote_ids: Sequence[Sequence[int] | np.ndarray],
             ranks: Sequence[int], validated: bool = False, remote_num_tokens: int = 0,
             layers: Layers | None = None) -> list[RankPlan]:
        if not validated:
            validate_pair(self.side, remote)
        blocks = prepare_blocks(self.side, remote, local_ids, remote_ids, remote_num_tokens)  # once for every rank
        return [plan_rank(self.side, remote, r, validated=True, blocks=blocks, layers=layers) for r in ranks]

    def plan_response(self, plans: Sequence[RankPlan], summary_only: bool) -> pb.PlanTransferResponse:
        msg = pb.PlanTransferResponse(
            rank_plans=[rank_plan_to_proto(p, summary_only) for p in plans],
            total_bytes=sum(p.nbytes for p in plans),
            total_descriptors=sum(p.num_descriptors for p in plans),
        )
        if plans:
            msg.prefix_blocks_skipped_per_group.extend(plans[0].prefix_blocks_skipped)
        return msg

    # ---- descriptions ---------------------------------------------------------------

    def region_bases(self, rank: int) -> np.ndarray:
        """The absolute address of each region's block 0 in a hosted rank's pool (made once)."""
        bases = self._region_bases.get(rank)
        if bases is None:
            pool = self.pools[rank]
            bases = self._region_bases[rank] = np.array([pool.region_address(r) for r in self.side.pool.regions],
                                                        dtype=np.int64)
        return bases

    def region_table(self, rank: int) -> list[pb.RegionInfo]:
        pool = self.pools.get(rank)
        return [region_to_proto(r, pool.region_address(r) if pool is not None else 0) for r in self.side.pool.regions]

    def memory_kind(self, rank: int) -> pb.MemoryKind:
        return pb.MEMORY_KIND_VRAM if self.pools[rank].memory_kind == MemoryKind.VRAM else pb.MEMORY_KIND_DRAM

    def pool_infos(self) -> list[pb.PoolInfo]:
        out = []
        for rank, pool in sorted(self.pools.items()):
            out.append(pb.PoolInfo(
                tp_rank=rank, memory_kind=self.memory_kind(rank),
                shm_name=pool.shm_name, size_bytes=pool.size_bytes, device_id=pool.device_id,
                regions=self.region_table(rank), cuda_ipc=_cuda_ipc_to_proto(pool.cuda_ipc),
                populate_ms=int(pool.populate_s * 1000)))
        return out

    def info(self) -> pb.GetInfoResponse:
        caps = ["plan"] + (["faults"] if self.faults is not None else [])
        if self.data is not None:
            caps += ["transfer", "leases", "handshake"]
        transport = pb.TransportInfo(nixl_available=self.data is not None, nixl_version=nixl_version(),
                                     unavailable_reason=self.data_error)
        if self.data is not None:
            transport.backends.extend(self.data.backends)
            transport.ucx_transports.extend(self.data.transports_seen)
            transport.copy_threads = self.data.copy_threads
        transport.node_id = self.node_id
        transport.rdma_devices.extend(self.rdma.devices)
        transport.rdma_unavailable_reason = self.rdma.unavailable_reason
        return pb.GetInfoResponse(
            engine_id=self.config.engine_id, role=_ROLES[self.config.role], tp_size=self.config.tp_size,
            hosted_ranks=list(self.hosted_ranks), layout=layout_to_proto(self.layout),
            layout_hash=self.layout_hash, epoch=self.epoch, server_version=__version__,
            capabilities=caps, advertised_address=self.address, pools=self.pool_infos(), transport=transport,
            live_leases=self.leases.live_count, transfer_socket=self.transfer_socket_path,
        )


__all__ = ["Node", "new_epoch"]
