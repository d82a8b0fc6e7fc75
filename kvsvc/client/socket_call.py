"""The client's end of a framed same-host socket (kvsvc/framing.py says what and why)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvsvc.errors import KvsvcError, Unreachable
from kvsvc.framing import MAX_UNSENT_BYTES, frame, split_frames


class SocketCall(asyncio.Protocol):
    """The client's end of a framed socket: write_now() (a write that never waits), each
    message received handed over as it arrives, cancel(). Nothing waits for the socket
    to drain: every call has its own deadline, and a server that stops reading while
    unsent bytes pile up past MAX_UNSENT_BYTES counts as broken (its calls fail over, as
    for any break)."""

    def __init__(self, max_bytes: int, parse: Callable[[bytes], Any], what: str) -> None:
        self._max_bytes = max_bytes
        self._parse = parse
        self._what = what  # "the lease socket", "the transfer socket": for errors
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._on_message: Callable[[Any], None] | None = None
        self._on_end: Callable[[KvsvcError | None], None] | None = None
        self._lost: KvsvcError | None = None
        self._closed = False
        self._early: list[Any] = []  # messages read before attach() (a server's refusal can come first)

    def attach(self, on_message: Callable[[Any], None], on_end: Callable[[KvsvcError | None], None]) -> None:
        self._on_message, self._on_end = on_message, on_end
        early, self._early = self._early, []
        for msg in early:
            on_message(msg)
        if self._closed:
            on_end(self._lost)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def check_reading(self) -> None:
        """Raise if the server stopped reading: more than MAX_UNSENT_BYTES left unsent from
        earlier writes. Asked before a loop turn's writes, never after one: a large message
        (a legal Transfer of several MiB) is no sign that the server stopped."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(f"{self._what} is closed")
        backlog = transport.get_write_buffer_size()
        if backlog > MAX_UNSENT_BYTES:
            raise ConnectionResetError(f"{backlog} bytes unsent: the server stopped reading")

    def write_now(self, msg: Message) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(f"{self._what} is closed")
        transport.write(frame(msg))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        bodies, too_big = split_frames(self._buf, self._max_bytes)
        for body in bodies:
            try:
                msg = self._parse(body)
            except DecodeError:
                return self._fail(f"{self._what} broke: DecodeError")
            if self._on_message is not None:
                self._on_message(msg)
            else:
                self._early.append(msg)
        if too_big:
            self._fail(f"{self._what} sent a {too_big}-byte frame")

    def connection_lost(self, exc: Exception | None) -> None:
        # The server closed it (a stream that ended) or it broke.
        self._ended(Unreachable(f"{self._what} broke: {type(exc).__name__}") if exc else None)

    def _fail(self, why: str) -> None:
        self._ended(Unreachable(why))
        self.cancel()

    def _ended(self, error: KvsvcError | None) -> None:
        if self._closed:
            return
        self._closed, self._lost = True, error
        if self._on_end is not None:
            self._on_end(error)

    def cancel(self) -> None:
        if self._transport is not None:
            self._transport.close()
