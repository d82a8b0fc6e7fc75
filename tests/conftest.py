"""Shared fixtures: in-process servers on port 0, always stopped."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvsvc.client import AsyncClient
from kvsvc.config import MemoryMode, Role, load_config
from kvsvc.service.server import RunningServer, create_server


@pytest.fixture
async def control_server() -> AsyncIterator[RunningServer]:
    """A control-plane-only server (TP 2, both ranks, the built-in layout)."""
    running, _ = await create_server(load_config(listen="127.0.0.1:0", tp_size=2, memory=MemoryMode.NONE))
    try:
        yield running
    finally:
        await running.stop(0)


@pytest.fixture
async def control_client(control_server: RunningServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"127.0.0.1:{control_server.port}") as client:
        yield client


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[RunningServer, AsyncClient]]:
    """A prefill server with a DRAM pool (TP 1, the built-in layout) and a client of it."""
    running, port = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, role=Role.PREFILL,
                                                    memory=MemoryMode.DRAM))
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            yield running, client
    finally:
        # Some tests leave a lease claimed on purpose: not held to its deadline (this
        # process's memory is no engine's to reuse).
        await running.stop(0, drain_s=0, hold_claims=False)
