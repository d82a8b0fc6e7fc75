"""What the service asks of a data plane, and the memory kinds it speaks of.

The service layer (kvsvc/service) drives a data plane through `DataPlane` only; the NIXL
adapter (nixl_agents.NixlDataPlane) is the one implementation, handed to a Node by
create_server (tests hand it fakes instead). A posted READ is a `Flight`: its `result`
resolves with its duration or fails with TransferError, and `settled` is set once nothing
of it can still write -- a failed or cancelled READ may settle later than its result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvsvc.memory.pools import MemoryKind
from kvsvc.transport.ucx_probe import ReadPath

__all__ = ["DataPlane", "Flight", "MemoryKind", "TransferError"]


@dataclass
class Flight:
    """One posted READ: the backend's handles, and the futures that report it."""

    agent: Any
    handle: Any
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future[float]
    settled: asyncio.Event
    posted_at: float = field(default_factory=time.perf_counter)
    elapsed: float = 0.0


class TransferError(Exception):
    """A READ ended in error (translated to a kvsvc error by the service)."""


class DataPlane(Protocol):
    """The operations the service uses, all on the server's event loop."""

    backends: list[str]

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...

    def on_dead(self, callback: Callable[[], object]) -> None:
        """callback() (from any thread) if the data plane ever stops other than by close()."""

    def agent_name(self, rank: int) -> str: ...

    def metadata(self, rank: int) -> bytes:
        """What a peer needs to connect to rank (sent in the handshake answer)."""

    async def connect(self, local_rank: int, remote_metadata: bytes, remote_name: str) -> str: ...

    async def forget(self, remote_names: set[str]) -> None:
        """Drop every connection to these peers' ranks (a peer retired or half-wired)."""

    def read_now(self, local_rank: int, remote_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
                 length: np.ndarray, remote_memory: MemoryKind = MemoryKind.DRAM,
                 remote_device: int = 0) -> Flight | None:
        """The READ posted before this returns, when it is short and the backend free; else None."""

    async def read(self, local_rank: int, remote_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
                   length: np.ndarray, remote_memory: MemoryKind = MemoryKind.DRAM,
                   remote_device: int = 0) -> list[Flight]:
        """Post one READ (in parts where the backend splits it); each part settles on its own."""

    async def abort(self, flights: list[Flight]) -> None:
        """Cancel what can be of these READs; the rest settle when they end."""

    def need_progress(self, delta: int) -> None:
        """+1 while peers may be reading from us, -1 when that ends (counted)."""

    def beat_when_idle(self) -> None:
        """Peers have connected: keep our endpoints answering even with nothing to do."""

    @property
    def remote_agents(self) -> int: ...

    @property
    def copy_threads(self) -> int: ...

    @property
    def transports_seen(self) -> list[str]: ...

    def read_paths(self) -> list[ReadPath]: ...
