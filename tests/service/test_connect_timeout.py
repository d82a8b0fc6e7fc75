"""ClientOptions.connect_timeout_ms: how long one connection attempt may wait for the server.

A real server behind a TCP relay that accepts at once but passes nothing on for DELAY_S,
as a host too busy to run the server's event loop does. A connect limit below the delay
gives up on the attempt (UNAVAILABLE); one above it waits and gets the answer. Peers are
dialled with the peer deadline as their connect limit (kvsvc.service.peers).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.errors import KvsvcError

DELAY_S = 3.0


@contextlib.asynccontextmanager
async def slow_relay(port: int) -> AsyncIterator[int]:
    """A TCP relay to 127.0.0.1:port that holds every new connection DELAY_S before relaying."""
    closing = asyncio.Event()
    handlers: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        writers.append(writer)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(closing.wait(), DELAY_S)
        if closing.is_set():
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(up_writer)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    relay = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield relay.sockets[0].getsockname()[1]
    finally:
        closing.set()
        relay.close()
        await asyncio.sleep(0.1)  # connections accepted just now reach their handler
        for w in writers:
            w.close()
        await asyncio.gather(*handlers, return_exceptions=True)


async def test_a_short_connect_limit_gives_up_on_a_slow_server(control_server):
    async with slow_relay(control_server.port) as port:
        opts = ClientOptions(timeout_s=DELAY_S * 4, retries=0, connect_timeout_ms=int(DELAY_S * 1000 / 3))
        async with AsyncClient(f"127.0.0.1:{port}", opts) as c:
            with pytest.raises(KvsvcError) as e:
                await c.get_info()
    assert e.value.code.name == "UNAVAILABLE", e.value


async def test_a_connect_limit_above_the_delay_waits_for_the_answer(control_server):
    async with slow_relay(control_server.port) as port:
        opts = ClientOptions(timeout_s=DELAY_S * 4, retries=0, connect_timeout_ms=int(DELAY_S * 1000 * 3))
        async with AsyncClient(f"127.0.0.1:{port}", opts) as c:
            info = await c.get_info()
    assert info.tp_size == 2
