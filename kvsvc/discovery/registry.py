"""kvsvc servers in etcd: each running server under a key kept alive by an etcd lease.

Key:   {prefix}/engines/{engine_id}/servers/{address}
Value: JSON ServerRecord (engine id, role, TP size, hosted ranks, address, epoch, layout hash)

A server puts its key under a lease of ttl_s seconds and refreshes it at a third of that;
a clean shutdown revokes the lease (the key goes at once), a killed server's key goes when
the lease runs out. A restart registers again with its new epoch. Routers and D servers
resolve an engine id to its servers with one range read, and watch them come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from kvsvc.discovery.etcd import EtcdClient, WatchEvent
from kvsvc.errors import InvalidArgument, KvsvcError
from kvsvc.limits import MAX_ADDRESS_BYTES, MAX_TP_SIZE, check_id
from kvsvc.reasons import Reason

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvsvc/v1"
DEFAULT_TTL_S = 10
MIN_TTL_S = 2
MAX_TTL_S = 3600
MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerRecord:
    """What a router needs to reach one kvsvc server (JSON in etcd, proto-like field names)."""

    engine_id: str
    role: str
    tp_size: int
    ranks: list[int]
    address: str
    epoch: int
    layout_hash: str = ""
    dcp_size: int = 1
    server_version: str = ""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ServerRecord:
        """Parse and check a record read from etcd (anyone with write access could have put it)."""
        if len(data) > MAX_RECORD_BYTES:
            raise InvalidArgument(Reason.DISCOVERY_RECORD_INVALID, f"record of {len(data)} bytes (max {MAX_RECORD_BYTES})")
        try:
            d = json.loads(data)
            rec = cls(engine_id=str(d["engine_id"]), role=str(d["role"]), tp_size=int(d["tp_size"]),
                      ranks=[int(r) for r in d["ranks"]], address=str(d["address"]), epoch=int(d["epoch"]),
                      layout_hash=str(d.get("layout_hash", "")), dcp_size=int(d.get("dcp_size", 1)),
                      server_version=str(d.get("server_version", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument(Reason.DISCOVERY_RECORD_INVALID, f"not a kvsvc server record: {e}") from None
        check_id(rec.engine_id, "engine_id")
        check_id(rec.address, "address", MAX_ADDRESS_BYTES)
        if not 1 <= rec.tp_size <= MAX_TP_SIZE or any(not 0 <= r < rec.tp_size for r in rec.ranks):
            raise InvalidArgument(Reason.DISCOVERY_RECORD_INVALID, f"tp_size {rec.tp_size} / ranks {rec.ranks[:8]} "
                                  "out of range")
        return rec


def engines_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix.rstrip('/')}/engines/"


def engine_prefix(engine_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    check_id(engine_id, "engine_id")
    if "/" in engine_id:
        raise InvalidArgument(Reason.INVALID_ENGINE_ID, "an engine id registered in etcd may not contain '/'",
                              {"engine_id": engine_id})
    return f"{engines_prefix(prefix)}{engine_id}/servers/"


def server_key(record: ServerRecord, prefix: str = DEFAULT_PREFIX) -> str:
    return engine_prefix(record.engine_id, prefix) + record.address


def check_ttl(ttl_s: int) -> int:
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise InvalidArgument(Reason.ETCD_TTL_INVALID, f"etcd_ttl_s must be {MIN_TTL_S}..{MAX_TTL_S} seconds",
                              {"etcd_ttl_s": ttl_s})
    return ttl_s


class Registration:
    """One server's key in etcd, kept alive until stop()."""

    def __init__(self, client: EtcdClient, record: ServerRecord, ttl_s: int = DEFAULT_TTL_S,
                 prefix: str = DEFAULT_PREFIX) -> None:
        self.client, self.record, self.ttl_s = client, record, check_ttl(ttl_s)
        self.key = server_key(record, prefix)
        self.lease_id = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now (raises ETCD_UNAVAILABLE if etcd does not answer), then keep it alive."""
        await self._register()
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="kvsvc-etcd-keepalive")

    async def _register(self) -> None:
        self.lease_id = await self.client.grant(self.ttl_s)
        await self.client.put(self.key, self.record.to_json(), self.lease_id)
        log.info("registered %s in etcd (lease %x, ttl %d s)", self.key, self.lease_id, self.ttl_s)

    async def _keep_alive(self) -> None:
        delay = self.ttl_s / 3
        while True:
            await asyncio.sleep(delay)
            try:
                if await self.client.keepalive(self.lease_id) <= 0:
                    # etcd forgot the lease (it was down, or we were cut off longer than the TTL).
                    log.warning("etcd lease of %s ran out: registering again", self.key)
                    await self._register()
                delay = self.ttl_s / 3
            except KvsvcError as e:
                log.warning("etcd keepalive of %s failed (%s); retrying", self.key, e.message)
                delay = min(1.0, self.ttl_s / 6)

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Deregister: revoke the lease so the key goes now (best effort: else it expires)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.lease_id:
            try:
                await asyncio.wait_for(self.client.revoke(self.lease_id), timeout_s)
            except (KvsvcError, TimeoutError) as e:
                log.warning("could not deregister %s from etcd (%s): it expires in %d s", self.key, e, self.ttl_s)
            self.lease_id = 0


async def resolve(client: EtcdClient, engine_id: str, prefix: str = DEFAULT_PREFIX) -> list[ServerRecord]:
    """The registered servers of engine_id, by their first hosted rank (records that do not
    parse are skipped with a warning)."""
    _, kvs = await client.get_prefix(engine_prefix(engine_id, prefix))
    return sorted((r for kv in kvs if (r := _parse(kv.key, kv.value)) is not None), key=_order)


async def list_engines(client: EtcdClient, prefix: str = DEFAULT_PREFIX) -> dict[str, list[ServerRecord]]:
    """Every registered engine id -> its servers."""
    _, kvs = await client.get_prefix(engines_prefix(prefix))
    out: dict[str, list[ServerRecord]] = {}
    for kv in kvs:
        rec = _parse(kv.key, kv.value)
        if rec is not None:
            out.setdefault(rec.engine_id, []).append(rec)
    return {e: sorted(rs, key=_order) for e, rs in sorted(out.items())}


@dataclass(frozen=True)
class ServerChange:
    """A server registered (record set) or gone (record None) under key."""

    key: str
    record: ServerRecord | None


async def watch_servers(client: EtcdClient, engine_id: str = "", prefix: str = DEFAULT_PREFIX,
                        ) -> AsyncIterator[ServerChange]:
    """The servers now (as changes), then every registration and departure as it happens.
    Ends with ETCD_WATCH_BROKEN / ETCD_UNAVAILABLE if etcd goes away."""
    where = engine_prefix(engine_id, prefix) if engine_id else engines_prefix(prefix)
    revision, kvs = await client.get_prefix(where)
    watch = client.watch_prefix(where, revision + 1)  # nothing between the read and the watch is lost
    try:
        for kv in kvs:
            rec = _parse(kv.key, kv.value)
            if rec is not None:
                yield ServerChange(kv.key, rec)
        async for ev in watch:
            change = _change(ev)
            if change is not None:
                yield change
    finally:
        watch.close()


def _change(ev: WatchEvent) -> ServerChange | None:
    if ev.kind == "DELETE":
        return ServerChange(ev.key, None)
    rec = _parse(ev.key, ev.value)
    return ServerChange(ev.key, rec) if rec is not None else None


def _parse(key: str, value: bytes) -> ServerRecord | None:
    try:
        return ServerRecord.from_json(value)
    except KvsvcError as e:
        log.warning("ignoring etcd key %s: %s", key[:300], e.message)
        return None


def _order(rec: ServerRecord) -> tuple[int, str]:
    return (min(rec.ranks, default=0), rec.address)
