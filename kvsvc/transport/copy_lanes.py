"""Copy lanes: more NIXL threads, each with its own agent per hosted DRAM rank, that a long
READ between DRAM pools is split across.

Between processes of one host UCX copies a READ's bytes inside the calling thread
(`cma`: process_vm_readv), so one READ moves at one core's copy rate, and while it runs
its thread can post nothing else. Measured here (2 cores, 64 MiB from a P process into a
shared-memory pool): one agent 3.3-4.7 GB/s, the same READ cut in two halves on two
agents and threads 4.9-7.0 GB/s. So a D server reads a long READ in parts, one per lane,
each on its own agent and thread; the main NIXL thread keeps posting short READs and
polling meanwhile. A NIXL agent is used by one thread only (they are made without locks
of their own), so each lane has its own agents, registered on the same pools, connected
to the same remote agents. Only DRAM-to-DRAM READs use lanes: GPU memory is read where
its CUDA context is known to be right, the main NIXL thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsvc.memory.pools import MemoryKind, Pool
from kvsvc.transport.nixl_thread import NixlThread
from kvsvc.transport.ports import Flight
from kvsvc.transport.reads import read_maker, split_descriptors

log = logging.getLogger(__name__)

LANE_READ_MIN_BYTES = 8 << 20
LANE_PART_MIN_BYTES = 4 << 20
"""READs of at least LANE_READ_MIN_BYTES go to the lanes, a part per lane but no part
shorter than LANE_PART_MIN_BYTES; shorter READs stay whole on the main NIXL thread.
Measured here, one request at a time, two lanes against none: 8 MiB 3.4-4.3 against
4.4-6.2 ms, 16 MiB 6.4 against 7.8-8.7 ms, but 4 MiB about even and 2 MiB slower (2.4-2.9
against 2.1-2.2 ms): the parts' hand-offs and wake-ups cost more than a short copy gains."""


def _no_notifications(agent: Any, notifs: dict[str, list[bytes]]) -> None:
    """Lane agents only read: a notification sent to one has no reader (none is expected)."""


@dataclass
class LaneAgent:
    agent: Any
    reg: Any
    pool: Pool


class CopyLanes:
    """`count` lanes (0: none), made by start() where a pool is in DRAM. start() once, after
    the main agents exist; close() once."""

    def __init__(self, count: int, agent_name: Callable[[int, int], str]) -> None:
        self._wanted = count
        self._agent_name = agent_name  # (rank, lane) -> this process's unique agent name
        # Made by start(), and only where some pool is in DRAM (a thread holds a wake-up pipe).
        self._threads: list[NixlThread] = []
        self._agents: list[dict[int, LaneAgent]] = []
        self._remotes: set[tuple[int, str]] = set()  # (rank, remote agent) connected on every lane
        # (lane, rank, remote agent) for every remote a lane agent was asked to load, noted
        # before asking: a connect cancelled midway is still undone by forget().
        self._loaded: set[tuple[int, int, str]] = set()
        self._next = 0  # the lane a one-part READ goes to: round robin

    @property
    def count(self) -> int:
        return len(self._threads)

    @property
    def loaded(self) -> int:
        """Remote agents loaded into lane agents (one per lane, rank and remote)."""
        return len(self._loaded)

    async def start(self, api: Any, pools: Mapping[int, Pool], backends: list[str]) -> None:
        """Start the lanes and make their agents on the DRAM pools (ranks in VRAM get none)."""
        dram = {rank: pool for rank, pool in sorted(pools.items()) if pool.memory_kind == MemoryKind.DRAM}
        if not dram:  # nothing they could read into: no threads at all
            return
        self._threads = [NixlThread(f"kvsvc-copy{i}") for i in range(self._wanted)]
        self._agents = [{} for _ in self._threads]
        for lane, thread in enumerate(self._threads):
            thread.start()
            for rank, pool in dram.items():
                self._agents[lane][rank] = await thread.call(self._make_agent, api, self._agent_name(rank, lane),
                                                             pool, backends)
            # A slow beat of progress while idle: UCX finishes an endpoint's close (a peer
            # that restarted, forgotten) only inside progress, and without it each P restart
            # left this lane's connections to the old P open (CLOSE-WAIT) for good.
            thread.set_progress([a.agent for a in self._agents[lane].values()], _no_notifications)
            thread.beat_when_idle()

    @staticmethod
    def _make_agent(api: Any, name: str, pool: Pool, backends: list[str]) -> LaneAgent:
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        reg = agent.register_memory([(a, n, pool.device_id, "") for a, n in pool.segments()], pool.memory_kind)
        return LaneAgent(agent, reg, pool)

    def takes(self, rank: int, remote_name: str, nbytes: int) -> bool:
        """The lanes read this READ (post()): it is long, and rank's lane agents know remote_name."""
        return nbytes >= LANE_READ_MIN_BYTES and (rank, remote_name) in self._remotes

    async def connect(self, rank: int, remote_metadata: bytes, remote_name: str) -> None:
        """Make remote_name known to rank's agent on every lane. A lane that cannot is left
        out for that remote (READs then run on the main NIXL thread): a warning, not an error."""
        if not self._threads or rank not in self._agents[0] or (rank, remote_name) in self._remotes:
            return
        try:
            for lane, thread in enumerate(self._threads):
                agent = self._agents[lane][rank].agent
                self._loaded.add((lane, rank, remote_name))
                await thread.call(agent.add_remote_agent, remote_metadata)
                await thread.call(agent.make_connection, remote_name)
        except Exception:
            log.warning("copy lanes could not connect to %s; its long READs use one thread", remote_name,
                        exc_info=True)
            await self.forget({remote_name})
            return
        self._remotes.add((rank, remote_name))

    async def forget(self, remote_names: set[str]) -> None:
        """Drop remote agents (a peer restarted, or a connect failed or was cancelled) from
        every lane agent that was asked to load them."""
        self._remotes -= {k for k in self._remotes if k[1] in remote_names}
        for lane, rank, remote in sorted(k for k in self._loaded if k[2] in remote_names):
            self._loaded.discard((lane, rank, remote))
            try:
                await self._threads[lane].call(self._agents[lane][rank].agent.remove_remote_agent, remote)
            except Exception:  # never loaded (its add failed) or already gone
                log.debug("remove_remote_agent %s on copy lane %d failed", remote, lane, exc_info=True)

    async def post(self, rank: int, remote_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
                   length: np.ndarray, remote_memory: str, remote_device: int) -> list[Flight]:
        """Post the READ in parts over the lanes (takes() first). Every part is posted, or,
        if one could not be, those that were are cancelled and waited out before this raises:
        a caller never has to settle READs it did not hear of. Not to be cancelled midway
        (the decoder shields it, as it does every post)."""
        total = int(length.sum())
        parts = split_descriptors(local_addr, remote_addr, length, max(1, min(self.count, total // LANE_PART_MIN_BYTES)))
        first = self._next
        self._next = (self._next + len(parts)) % self.count
        posts: list[Coroutine[Any, Any, Flight]] = []
        for i, (la, ra, ln) in enumerate(parts):
            lane = (first + i) % self.count
            own = self._agents[lane][rank]
            make = read_maker(own.agent, own.pool.memory_kind, own.pool.device_id, remote_name, la, ra, ln,
                              remote_memory, remote_device)
            posts.append(self._threads[lane].post(own.agent, make))
        results = await asyncio.gather(*posts, return_exceptions=True)
        flights = [r for r in results if isinstance(r, Flight)]
        failed = [r for r in results if not isinstance(r, Flight)]
        if failed:
            await self.abort(flights)
            await asyncio.gather(*(f.settled.wait() for f in flights))
            raise failed[0]
        return flights

    async def abort(self, flights: list[Flight]) -> None:
        """Cancel what NIXL can of these READs (each lane looks only at its own)."""
        if flights:
            for thread in self._threads:
                if thread.alive:  # a crashed lane failed its own READs already
                    await thread.abort(flights)

    @property
    def alive(self) -> bool:
        return all(t.alive for t in self._threads)

    def on_dead(self, callback: Callable[[], object]) -> None:
        for t in self._threads:
            t.on_dead = callback

    async def close(self) -> None:
        """Deregister and drop the lanes' agents on their threads, then end the threads."""
        for lane, thread in enumerate(self._threads):
            if not thread.alive:
                self._agents[lane].clear()
                thread.stop()
                continue
            for la in self._agents[lane].values():
                try:
                    await thread.call(la.agent.deregister_memory, la.reg)
                except Exception:
                    log.warning("deregister on copy lane %d failed", lane, exc_info=True)
            await thread.call(self._agents[lane].clear)
            thread.stop()
        self._remotes.clear()
        self._loaded.clear()
