"""A small asyncio client for etcd v3, over its JSON gateway (/v3/...), standard library only.

kvsvc needs five calls -- grant, keep alive and revoke a lease; put and range over keys --
and one stream, a watch. The gateway speaks them as JSON over HTTP (keys and values base64),
so no generated etcd stubs and no second gRPC stack are needed. Each call runs in a worker
thread (http.client blocks); a watch holds one thread and one connection for its life and
hands events to the event loop. Endpoints are tried in order until one answers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvsvc.errors import FailedPrecondition, InvalidArgument, KvsvcError, Unavailable
from kvsvc.reasons import Reason

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 32 * 1024 * 1024
"""Largest answer read from etcd (a range over every kvsvc server is a few hundred KB)."""
MAX_ENDPOINTS = 16
MAX_WATCH_LINE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def connect(self, timeout_s: float | None) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


def parse_endpoints(spec: str | Sequence[str]) -> list[Endpoint]:
    """'http://h:2379,h2:2379' (or a list) -> endpoints; the scheme defaults to http."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise InvalidArgument(Reason.ETCD_ENDPOINTS_INVALID, "no etcd endpoint given (e.g. http://127.0.0.1:2379)",
                              {"endpoints": str(spec)[:200]})
    if len(items) > MAX_ENDPOINTS:
        raise InvalidArgument(Reason.ETCD_ENDPOINTS_INVALID, f"at most {MAX_ENDPOINTS} etcd endpoints",
                              {"count": len(items)})
    out = []
    for item in items:
        url = urlsplit(item if "://" in item else f"http://{item}")
        try:
            port = url.port or 2379
        except ValueError:
            port = -1
        if url.scheme not in ("http", "https") or not url.hostname or port <= 0 or url.path not in ("", "/"):
            raise InvalidArgument(Reason.ETCD_ENDPOINTS_INVALID, f"not an etcd endpoint: {item[:200]!r} (want "
                                  "http://host:port or https://host:port)", {"endpoint": item[:200]})
        out.append(Endpoint(url.scheme, url.hostname, port))
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with prefix."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"  # every key


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "PUT" or "DELETE"
    key: str
    value: bytes  # empty for DELETE


class EtcdClient:
    """grant / keepalive / revoke / put / get_prefix / watch_prefix against etcd v3."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(map(str, self.endpoints))})"

    # ---- calls ------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ttl_s seconds; its id."""
        resp = await self._post("/v3/lease/grant", {"TTL": int(ttl_s)})
        if resp.get("error"):
            raise Unavailable(Reason.ETCD_ERROR, f"etcd refused a lease: {str(resp['error'])[:200]}")
        return int(resp["ID"])

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; the seconds it now has left (0: etcd no longer knows it)."""
        resp = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(resp.get("result", {}).get("TTL", 0))

    async def revoke(self, lease_id: int) -> None:
        """End a lease now: every key put under it is deleted."""
        await self._post("/v3/lease/revoke", {"ID": str(lease_id)})

    async def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        """Set key (tied to lease_id when non-zero); the store's revision after the put."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease_id:
            body["lease"] = str(lease_id)
        resp = await self._post("/v3/kv/put", body)
        return int(resp.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """(revision, every key under prefix) in one consistent read."""
        p = prefix.encode()
        resp = await self._post("/v3/kv/range", {"key": _b64(p), "range_end": _b64(prefix_end(p))})
        kvs = [KeyValue(_unb64(kv["key"]).decode(errors="replace"), _unb64(kv.get("value", "")),
                        int(kv.get("lease", 0))) for kv in resp.get("kvs", [])]
        return int(resp.get("header", {}).get("revision", 0)), kvs

    def watch_prefix(self, prefix: str, start_revision: int = 0) -> EtcdWatch:
        """Changes to keys under prefix from start_revision on (0: from now); use as an async
        iterator, close() to stop."""
        p = prefix.encode()
        create: dict[str, Any] = {"key": _b64(p), "range_end": _b64(prefix_end(p))}
        if start_revision:
            create["start_revision"] = str(start_revision)
        return EtcdWatch(self, {"create_request": create})

    # ---- transport --------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self._post_sync, path, body)

    def _post_sync(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for ep in self.endpoints:
            conn = ep.connect(self.timeout_s)
            try:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read(MAX_RESPONSE_BYTES + 1)
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{ep}: {type(e).__name__}: {e}")
                continue
            finally:
                conn.close()
            if len(data) > MAX_RESPONSE_BYTES:
                raise FailedPrecondition(Reason.ETCD_ANSWER_TOO_BIG, f"etcd at {ep} answered more than "
                                         f"{MAX_RESPONSE_BYTES} bytes", {"endpoint": str(ep)})
            try:
                parsed = json.loads(data or b"{}")
            except ValueError:
                raise Unavailable(Reason.ETCD_ERROR, f"etcd at {ep} answered {resp.status} with no JSON: "
                                  f"{data[:200]!r}", {"endpoint": str(ep)}) from None
            if resp.status != 200:
                raise Unavailable(Reason.ETCD_ERROR, f"etcd at {ep} answered {resp.status}: "
                                  f"{str(parsed.get('message') or parsed.get('error') or parsed)[:200]}",
                                  {"endpoint": str(ep), "status": resp.status})
            return parsed  # type: ignore[no-any-return]
        raise Unavailable(Reason.ETCD_UNAVAILABLE, f"no etcd endpoint answered: {'; '.join(errors)[:500]}",
                          {"endpoints": ",".join(map(str, self.endpoints))})


class EtcdWatch:
    """One watch stream: a thread reads the gateway's JSON lines and queues events for the loop."""

    def __init__(self, client: EtcdClient, request: dict[str, Any]) -> None:
        self._client = client
        self._request = request
        self._queue: asyncio.Queue[WatchEvent | KvsvcError | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._conn: http.client.HTTPConnection | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsvc-etcd-watch", daemon=True)
        self._thread.start()

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[WatchEvent]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, KvsvcError):
                raise item
            yield item

    def close(self) -> None:
        self._closed.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread

    def _emit(self, item: WatchEvent | KvsvcError | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed first
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _run(self) -> None:
        error: KvsvcError | None = None
        try:
            error = self._stream()
        except Exception as e:  # a bug in parsing: end the watch with it, never silently
            error = Unavailable(Reason.ETCD_WATCH_BROKEN, f"etcd watch failed: {type(e).__name__}: {e}")
        if self._closed.is_set():
            error = None
        self._emit(error)
        if error is None:
            self._emit(None)

    def _stream(self) -> KvsvcError | None:
        errors = []
        for ep in self._client.endpoints:
            if self._closed.is_set():
                return None
            conn = ep.connect(None)  # a watch waits as long as nothing changes
            self._conn = conn
            try:
                conn.request("POST", "/v3/watch", json.dumps(self._request), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    errors.append(f"{ep}: HTTP {resp.status}")
                    continue
                return self._read(resp, ep)
            except (OSError, http.client.HTTPException) as e:
                if self._closed.is_set():
                    return None
                errors.append(f"{ep}: {type(e).__name__}: {e}")
            finally:
                conn.close()
        return Unavailable(Reason.ETCD_UNAVAILABLE, f"no etcd endpoint accepted the watch: {'; '.join(errors)[:500]}")

    def _read(self, resp: http.client.HTTPResponse, ep: Endpoint) -> KvsvcError | None:
        buf = b""
        while not self._closed.is_set():
            chunk = resp.read1(65536)
            if not chunk:
                return Unavailable(Reason.ETCD_WATCH_BROKEN, f"etcd at {ep} ended the watch")
            buf += chunk
            if len(buf) > MAX_WATCH_LINE_BYTES:
                return FailedPrecondition(Reason.ETCD_ANSWER_TOO_BIG, f"an etcd watch message over "
                                          f"{MAX_WATCH_LINE_BYTES} bytes")
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                msg = json.loads(line)
                result = msg.get("result") or {}
                if msg.get("error") or result.get("canceled"):
                    return Unavailable(Reason.ETCD_WATCH_BROKEN, f"etcd ended the watch: "
                                       f"{str(msg.get('error') or result.get('cancel_reason'))[:200]}")
                for ev in result.get("events", []):
                    kv = ev.get("kv", {})
                    self._emit(WatchEvent("DELETE" if ev.get("type") == "DELETE" else "PUT",
                                          _unb64(kv.get("key", "")).decode(errors="replace"),
                                          _unb64(kv.get("value", ""))))
        return None
