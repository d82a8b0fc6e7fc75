"""P's side of a PD run, seen from outside: its kvsvc servers' release streams and leases."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from kvsvc.client import AsyncClient
from kvsvc.client.client import ReleaseStream
from kvsvc.errors import Unreachable
from kvsvc.integrations.loop import LoopThread
from kvsvc.v1 import kv_transfer_pb2 as pb


def p_servers(params: dict[str, Any]) -> list[str]:
    """The addresses of every kvsvc server of the P engine that leased a request."""
    kv = params["kvsvc"]
    return [s["address"] for s in kv.get("remote_servers", [])] or [kv["remote_address"]]


# Engines busy on two cores can be slow to answer: a CI run once needed more than 30 s.
SUBSCRIBE_S = 90.0


class Releases:
    """Every WatchReleases event of some P servers, from subscription on."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = sorted(set(addresses))
        self.events: list[tuple[str, str, str, float]] = []  # (server, request id, reason, time.monotonic())
        self._loop = LoopThread("releases")
        self._clients: list[AsyncClient] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed: set[str] = set()
        pending = self._loop.submit(self._subscribe())
        try:
            self._tasks = pending.result(SUBSCRIBE_S)
        except concurrent.futures.TimeoutError:
            pending.cancel()
            self.close()
            silent = [a for a in self.addresses if a not in self._subscribed]
            raise AssertionError(f"P servers {silent} did not answer WatchReleases in {SUBSCRIBE_S:.0f} s "
                                 "(their engines' logs say whether an event loop stalled)") from None

    async def _subscribe(self) -> list[asyncio.Task[None]]:
        self._clients = [AsyncClient(a) for a in self.addresses]

        async def one(address: str, client: AsyncClient) -> asyncio.Task[None]:
            stream = await client.open_release_stream()  # subscribed on return
            self._subscribed.add(address)
            return asyncio.ensure_future(self._drain(address, stream))

        return list(await asyncio.gather(*(one(a, c) for a, c in zip(self.addresses, self._clients, strict=True))))

    async def _drain(self, address: str, stream: ReleaseStream) -> None:
        try:
            async for ev in stream:
                self.events.append((address, ev.request_id, pb.ReleaseReason.Name(ev.reason), time.monotonic()))
        except Unreachable:
            pass  # the engine stopped; wait() reports what never arrived

    def wait(self, request_ids: list[str], timeout_s: float = 30.0) -> dict[str, list[str]]:
        """request id -> reasons seen on every server, once each server released it (or the timeout)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            got = self.by_request()
            if all(len(got.get(r, [])) >= len(self.addresses) for r in request_ids):
                time.sleep(0.2)  # a duplicate would arrive right behind
                return self.by_request()
            time.sleep(0.05)
        return self.by_request()

    def by_request(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for _, rid, reason, _at in list(self.events):
            out.setdefault(rid, []).append(reason)
        return out

    def last_release_at(self) -> float:
        """When (time.monotonic()) the latest release event arrived."""
        return max(at for *_, at in self.events)

    def live_leases(self) -> int:
        async def count() -> int:
            return sum([(await c.get_info()).live_leases for c in self._clients])
        return self._loop.run(count(), 10)

    def close(self) -> None:
        async def down() -> None:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*(c.close() for c in self._clients), return_exceptions=True)
        self._loop.run(down(), 10)
        self._loop.stop()
