"""ClientOptions.connect_timeout_ms: how long one connection attempt may wait for the server.

A real server behind a TCP relay that accepts at once but passes nothing on for DELAY_S,
as a host too busy to run the server's event loop does. A connect limit below the delay
gives up on the attempt (UNAVAILABLE); one above it waits and gets the answer. Peers are
dialled with the peer deadline as their connect limit (kvsvc.service.peers).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.errors import KvsvcError

DELAY_S = 3.0


@contextlib.contextmanager
def slow_relay(port: int) -> Iterator[int]:
    """A TCP relay to 127.0.0.1:port that holds every new connection DELAY_S before relaying.

    Plain sockets and threads, every socket kept in one list and closed at the end (a relay
    on the test's event loop would race the loop's own accept against its shutdown).
    """
    closing = threading.Event()
    sockets: list[socket.socket] = []
    lock = threading.Lock()

    def keep(s: socket.socket) -> socket.socket:
        with lock:
            if closing.is_set():  # came in while the relay was being closed
                s.close()
            else:
                sockets.append(s)
        return s

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def handle(client: socket.socket) -> None:
        if closing.wait(DELAY_S):
            return
        with contextlib.suppress(OSError):
            upstream = keep(socket.create_connection(("127.0.0.1", port)))
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
            pipe(upstream, client)

    listener = keep(socket.create_server(("127.0.0.1", 0)))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not closing.is_set():
                client, _ = listener.accept()
                threading.Thread(target=handle, args=(keep(client),), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        with lock:
            closing.set()
            for s in sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


async def test_a_short_connect_limit_gives_up_on_a_slow_server(control_server):
    with slow_relay(control_server.port) as port:
        opts = ClientOptions(timeout_s=DELAY_S * 4, retries=0, connect_timeout_ms=int(DELAY_S * 1000 / 3))
        async with AsyncClient(f"127.0.0.1:{port}", opts) as c:
            with pytest.raises(KvsvcError) as e:
                await c.get_info()
    assert e.value.code.name == "UNAVAILABLE", e.value


async def test_a_connect_limit_above_the_delay_waits_for_the_answer(control_server):
    with slow_relay(control_server.port) as port:
        opts = ClientOptions(timeout_s=DELAY_S * 4, retries=0, connect_timeout_ms=int(DELAY_S * 1000 * 3))
        async with AsyncClient(f"127.0.0.1:{port}", opts) as c:
            info = await c.get_info()
    assert info.tp_size == 2
