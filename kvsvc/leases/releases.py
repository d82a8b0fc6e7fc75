"""Release events to subscribers (WatchReleases, an embedded engine's release stream), each
bounded in bytes: a subscriber that stops reading is ended, never grows the server."""

from __future__ import annotations

import asyncio
import collections

from kvsvc.leases.records import Release

# Most bytes of releases held for one subscriber that does not read; past it the subscriber
# is ended (WATCH_BEHIND) and what it held is freed.
MAX_WATCH_BACKLOG_BYTES = 64 * 1024 * 1024


class SubscriberBehind(Exception):
    """A WatchReleases subscriber fell so far behind that its releases were dropped."""

    def __init__(self, held_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"{held_bytes} bytes of releases waited for this subscriber (limit {limit_bytes})")
        self.held_bytes, self.limit_bytes = held_bytes, limit_bytes


class Subscription:
    """An async iterator of releases; ends when the table closes, or raises SubscriberBehind
    once more than max_bytes of releases waited for it (they are dropped at once: a
    subscriber that stops reading must not grow the server)."""

    def __init__(self, registry: set[Subscription], max_bytes: int) -> None:
        self._registry, self._max = registry, max_bytes
        self._events: collections.deque[Release] = collections.deque()
        self._bytes = 0
        self._wake = asyncio.Event()
        self._ended = False
        self._behind: SubscriberBehind | None = None

    def offer(self, ev: Release) -> None:
        """Queue ev for this subscriber (the table calls it for every release)."""
        size = ev.nbytes
        if self._bytes + size > self._max:
            self._behind = SubscriberBehind(self._bytes + size, self._max)
            self._events.clear()
            self._bytes = 0
            self.close()
            return
        self._events.append(ev)
        self._bytes += size
        self._wake.set()

    def end(self) -> None:
        """No more releases (the table closed): iteration stops once the queued ones are read."""
        self._ended = True
        self.close()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Release:
        while not self._events:
            if self._behind is not None:
                raise self._behind
            if self._ended:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()
        ev = self._events.popleft()
        self._bytes -= ev.nbytes
        return ev

    def close(self) -> None:
        self._registry.discard(self)
        self._wake.set()
