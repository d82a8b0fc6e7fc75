"""The NIXL boundary: one agent per hosted rank, registered pools, remote agents, READs.

Every NIXL call goes through NixlThread; NIXL's exceptions become kvsvc errors here and
nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsvc.errors import Internal, KvsvcError, Unavailable
from kvsvc.memory.pools import MemoryKind, Pool
from kvsvc.reasons import Reason
from kvsvc.transport.copy_lanes import CopyLanes
from kvsvc.transport.nixl_thread import NixlThread, TransferError
from kvsvc.transport.ports import Flight
from kvsvc.transport.reads import read_maker
from kvsvc.transport.ucx_cuda import allow_cuda_ipc_reads, bind_cuda_device
from kvsvc.transport.ucx_probe import (
    ReadPath,
    enable_protocol_log,
    forget_environment,
    read_paths,
    read_transports,
    remove_log,
)

log = logging.getLogger(__name__)

INLINE_READ_MAX_BYTES = 1 << 20
"""READs up to this size are posted from the event loop when NIXL is free (see NixlThread):
between processes of one host the copy runs inside the post, and 1 MiB copies here in
~0.1-0.3 ms, about what one gRPC call costs the loop; larger READs copy on the NIXL thread,
beside the loop. Only READs between DRAM pools: a READ that touches GPU memory is posted
where every other call on that agent is made, the NIXL thread (UCX's CUDA transports look
at the calling thread's CUDA context, and no GPU was at hand to prove the loop's right)."""


def _inline(length: np.ndarray, local_memory: str, remote_memory: str) -> bool:
    return local_memory == MemoryKind.DRAM and remote_memory == MemoryKind.DRAM and int(length.sum()) <= INLINE_READ_MAX_BYTES


@functools.cache
def nixl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nixl")
    except Exception:
        return ""


def load_nixl() -> Any:
    """nixl._api, with NIXL's chatty INFO logging turned down; NIXL_UNAVAILABLE if it cannot load."""
    try:
        _api = _import_nixl_api()
    except Exception as e:  # missing wheel or missing shared libraries
        raise Unavailable(Reason.NIXL_UNAVAILABLE, f"NIXL cannot be loaded: {e}") from e
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL's Python logger prints every agent creation to stdout at INFO.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


def _import_nixl_api() -> Any:
    """nixl._api, without the meta package's torch import on CPU-only builds.

    The `nixl` meta package picks its CUDA variant from torch's CUDA version and, when
    the installed torch has none (a CPU build), imports all of torch to ask (~1.5 s per
    server start). With a CPU torch any variant runs host memory only, so take the
    first one installed directly.
    """
    try:
        from nixl_meta_utils import _torch_cuda_version_from_disk
    except ImportError:
        _torch_cuda_version_from_disk = None
    if _torch_cuda_version_from_disk is not None and _torch_cuda_version_from_disk() is None:
        for variant in ("nixl_cu13", "nixl_cu12"):
            try:
                return importlib.import_module(f"{variant}._api")
            except ModuleNotFoundError:
                continue
    from nixl import _api

    return _api


def _kvsvc_error(e: Exception, what: str) -> KvsvcError:
    """NIXL's exception (or the NIXL thread's) as the kvsvc error callers see."""
    if isinstance(e, KvsvcError):
        return e
    if isinstance(e, TransferError):
        return Internal(Reason.TRANSFER_FAILED, f"{what}: {e}")
    return Internal(Reason.NIXL_ERROR, f"{what}: {type(e).__name__}: {e}")


@dataclass
class RankAgent:
    """A hosted rank's NIXL agent and its registered pool."""

    rank: int
    name: str
    agent: Any
    pool: Pool
    reg: Any
    metadata: bytes


class NixlDataPlane:
    """All NIXL state of one server process."""

    def __init__(self, engine_id: str, epoch: int, pools: Mapping[int, Pool], copy_lanes: int = 0) -> None:
        self._engine_id = engine_id
        self._epoch = epoch
        self._pools = dict(pools)
        self._thread = NixlThread()
        # Long DRAM READs are split over these (see copy_lanes.py); a D server has some.
        self._lanes = CopyLanes(copy_lanes, lambda rank, lane: f"{self.agent_name(rank)}/c{lane}")
        self.agents: dict[int, RankAgent] = {}
        self._remotes: dict[tuple[int, str], str] = {}
        self._remote_lock = asyncio.Lock()
        self.backends = ["UCX"]
        self.notifications = 0
        self._ucx_log: Path | None = None
        self._closed = False

    def agent_name(self, rank: int) -> str:
        return f"{self._engine_id}/{self._epoch:x}/r{rank}"

    @property
    def remote_agents(self) -> int:
        """Remote agents loaded into this process's agents (copy lanes included): what a
        peer that went away would leave behind if it were never forgotten."""
        return len(self._remotes) + self._lanes.loaded

    @property
    def copy_threads(self) -> int:
        """Copy lanes long DRAM READs are split across (see copy_lanes.py)."""
        return self._lanes.count

    @property
    def transports_seen(self) -> list[str]:
        """UCX transports chosen so far, per operation (see ucx_probe)."""
        return read_transports(self._ucx_log)

    def read_paths(self) -> list[ReadPath]:
        """UCX's READ protocols chosen so far, per class of peer (see ucx_probe)."""
        return read_paths(self._ucx_log)

    async def start(self) -> None:
        self._ucx_log = enable_protocol_log()  # before UCX reads its environment
        if any(pool.memory_kind == MemoryKind.VRAM for pool in self._pools.values()):
            allow_cuda_ipc_reads()
        api = load_nixl()
        self._thread.start()
        for rank, pool in sorted(self._pools.items()):
            self.agents[rank] = await self._guard(self._thread.call(self._make_agent, api, rank, pool), "create agent")
        forget_environment()  # UCX has read its settings: children must not inherit kvsvc's log file
        self._thread.set_progress([a.agent for a in self.agents.values()], self._on_notifs)
        await self._guard(self._lanes.start(api, self._pools, self.backends), "create copy lane agents")

    def _make_agent(self, api: Any, rank: int, pool: Pool) -> RankAgent:
        if pool.memory_kind == MemoryKind.VRAM:
            bind_cuda_device(pool.device_id)
        cfg = api.nixl_agent_config(enable_prog_thread=False, backends=list(self.backends))
        name = self.agent_name(rank)
        agent = api.nixl_agent(name, cfg)
        reg = agent.register_memory([(a, n, pool.device_id, "") for a, n in pool.segments()], pool.memory_kind)
        return RankAgent(rank, name, agent, pool, reg, bytes(agent.get_agent_metadata()))

    def _on_notifs(self, agent: Any, notifs: dict[str, list[bytes]]) -> None:
        # kvsvc's own READs carry none (see read()); an engine that drives NIXL itself
        # from PlanTransfer may send some. Releases come from the Notify RPC: only counted.
        self.notifications += sum(len(v) for v in notifs.values())

    async def _guard(self, coro: Any, what: str) -> Any:
        try:
            return await coro
        except Exception as e:
            raise _kvsvc_error(e, what) from e

    def metadata(self, rank: int) -> bytes:
        return self.agents[rank].metadata

    async def connect(self, local_rank: int, remote_metadata: bytes, remote_name: str) -> str:
        """Make remote_name known to local_rank's agent (once); returns the name NIXL uses."""
        key = (local_rank, remote_name)
        if remote_name in {a.name for a in self.agents.values()}:
            # One of this process's own agents (a "both" server reading what it published):
            # NIXL reads between its local agents without loading metadata.
            return remote_name
        async with self._remote_lock:
            if key not in self._remotes:
                agent = self.agents[local_rank].agent
                name = await self._guard(self._thread.call(agent.add_remote_agent, remote_metadata), "add remote agent")
                name = name.decode() if isinstance(name, bytes) else str(name)
                # Pay UCX wire-up now (the peer progresses after a handshake), not on the first READ.
                await self._guard(self._thread.call(agent.make_connection, name), "connect to remote agent")
                await self._lanes.connect(local_rank, remote_metadata, name)
                self._remotes[key] = name
            return self._remotes[key]

    async def forget(self, remote_names: set[str]) -> None:
        """Drop remote agents (a peer restarted): later reads must re-handshake."""
        async with self._remote_lock:
            for (rank, remote), name in list(self._remotes.items()):
                if remote in remote_names:
                    del self._remotes[(rank, remote)]
                    agent = self.agents[rank].agent
                    try:
                        await self._thread.call(agent.remove_remote_agent, name)
                    except Exception:
                        log.warning("remove_remote_agent %s failed", name, exc_info=True)
            await self._lanes.forget(remote_names)

    async def read(
        self, local_rank: int, remote_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
        length: np.ndarray, remote_memory: MemoryKind = MemoryKind.DRAM, remote_device: int = 0,
    ) -> list[Flight]:
        """Post one READ of len(length) descriptors: in parts over the copy lanes when it is
        long and between DRAM pools, else as one READ on the NIXL thread (or inline, see
        read_now). Each Flight resolves with its part's duration; all of them together
        are the READ.

        The READ carries no NIXL notification. P learns that its blocks were read from the
        CONSUMED message on the lease channel, which also proves the bytes; a NIXL
        notification would only repeat it, and it costs much more than it says: UCX then
        completes the READ only once the notification was delivered, which needs P's agent
        to progress, so every READ waited on P's NIXL thread (measured here: a 64 KiB READ
        20 us one-sided, 0.1-0.2 ms with a notification and P progressing, stalled without).
        """
        local_memory = self.agents[local_rank].pool.memory_kind
        if local_memory == MemoryKind.DRAM and remote_memory == MemoryKind.DRAM and self._lanes.takes(local_rank, remote_name,
                                                                                    int(length.sum())):
            return await self._guard(self._lanes.post(local_rank, remote_name, local_addr, remote_addr, length,
                                                      remote_memory, remote_device), "post READ")  # type: ignore[no-any-return]
        agent, make = self._read_handle(local_rank, remote_name, local_addr, remote_addr, length, remote_memory,
                                        remote_device)
        inline = _inline(length, local_memory, remote_memory)
        return [await self._guard(self._thread.post(agent, make, inline), "post READ")]

    def read_now(
        self, local_rank: int, remote_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
        length: np.ndarray, remote_memory: MemoryKind = MemoryKind.DRAM, remote_device: int = 0,
    ) -> Flight | None:
        """read(), posted before this returns when the READ is short (see INLINE_READ_MAX_BYTES)
        and NIXL free at once (no task, no hand-off: most of a short transfer); None
        otherwise (then read())."""
        if not _inline(length, self.agents[local_rank].pool.memory_kind, remote_memory):
            return None
        agent, make = self._read_handle(local_rank, remote_name, local_addr, remote_addr, length, remote_memory,
                                        remote_device)
        try:
            return self._thread.post_now(agent, make)
        except Exception as e:
            raise _kvsvc_error(e, "post READ") from e

    def _read_handle(
        self, local_rank: int, remote_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
        length: np.ndarray, remote_memory: str, remote_device: int,
    ) -> tuple[Any, Callable[[], Any]]:
        """The rank's agent, and how to make the READ's handle (called holding NIXL)."""
        ra = self.agents[local_rank]
        return ra.agent, read_maker(ra.agent, ra.pool.memory_kind, ra.pool.device_id, remote_name, local_addr,
                                    remote_addr, length, remote_memory, remote_device)

    async def abort(self, flights: list[Flight]) -> None:
        """Cancel what NIXL can of these READs; the rest settle when they end."""
        running = [f for f in flights if not f.settled.is_set()]
        await self._thread.abort(running)
        await self._lanes.abort(running)

    def need_progress(self, delta: int) -> None:
        self._thread.need_progress(delta)

    def beat_when_idle(self) -> None:
        """Peers read from us now: keep our UCX endpoints answering (a slow beat)."""
        self._thread.beat_when_idle()

    @property
    def alive(self) -> bool:
        return self._thread.alive and self._lanes.alive

    def on_dead(self, callback: Callable[[], object]) -> None:
        """callback() (from the NIXL thread or a copy lane's) if that thread ever ends other
        than by close()."""
        self._thread.on_dead = callback
        self._lanes.on_dead(callback)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._lanes.close()
        if not self._thread.alive:  # crashed: nothing can be called on it any more
            self.agents.clear()
            self._thread.stop()  # releases what the thread kept (its wake-up pipe)
            remove_log(self._ucx_log)
            return
        for ra in self.agents.values():
            try:
                await self._thread.call(ra.agent.deregister_memory, ra.reg)
            except Exception:
                log.warning("deregister rank %d failed", ra.rank, exc_info=True)
        drop: Callable[[], None] = self.agents.clear
        await self._thread.call(drop)  # agents are destroyed on the NIXL thread too
        self._thread.stop()
        remove_log(self._ucx_log)
