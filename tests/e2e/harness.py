"""E2E helpers: real server processes, engine-side pool access, reference fill and check."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.client.attach import attach_pool
from kvsvc.codec import layout_from_proto
from kvsvc.layout.engine import EngineLayout
from kvsvc.layout.regions import build_pool_layout
from kvsvc.leases.records import LeaseState
from kvsvc.transport.ports import Flight
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.verify import RankMemory, check_rank, fill_rank


def layout_table(*, k: int = 4, layers: int = 2, head: int = 4, block: int = 4, nb: int = 32, mla: bool = False,
                 dtype: str = "float32", extra: list[dict[str, Any]] | None = None, groups=None,
                 **kw: Any) -> dict[str, Any]:
    main = [{"name": "mla" if mla else "full", "kind": "mla" if mla else "full_attention", "num_layers": layers,
             "head_size": head}]
    return {"model_id": "e2e", "total_num_kv_heads": k, "block_size": block, "num_blocks": nb, "dtype": dtype,
            "groups": groups if groups is not None else main + (extra or []), **kw}


@contextlib.contextmanager
def servers(p_tp: int, d_tp: int, p_layout: Mapping[str, Any], d_layout: Mapping[str, Any] | None = None,
            ) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    # INFO logs (handshakes, refusals): shown with the stack dumps when a test fails.
    p = start_server(engine_id="e2e-prefill", role="prefill", tp_size=p_tp, layout=p_layout, global_args=["-v"])
    try:
        d = start_server(engine_id="e2e-decode", role="decode", tp_size=d_tp, layout=d_layout or p_layout,
                         global_args=["-v"])
    except BaseException:
        p.stop()
        raise
    with running(p, d):
        yield p, d


@contextlib.contextmanager
def running(p: ServerProcess, d: ServerProcess) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A started pair: reported if the test fails, stopped after it, and both must exit 0."""
    try:
        yield p, d
    except BaseException:
        report_servers(p, d)
        raise
    finally:
        codes = (p.stop(), d.stop())
        assert codes == (0, 0), f"servers exited {codes}:\n{''.join(p.output[-20:])}\n{''.join(d.output[-20:])}"


def report_servers(*procs: ServerProcess, lines: int = 150) -> None:
    """After a failed test: where each server's threads and tasks wait, and what it logged."""
    for sp in procs:
        sp.dump_stacks()
    time.sleep(1.0)  # the dump is written from the servers' signal handlers and event loops
    for sp in procs:
        sys.stderr.write(f"---- server {sp.address} (last {lines} lines) ----\n{''.join(sp.output[-lines:])}")


@dataclass
class Engine:
    """The engine side of one server: its info, layout and pools as an engine maps them."""

    info: pb.GetInfoResponse
    layout: EngineLayout
    mem: dict[int, RankMemory] = field(default_factory=dict)
    _attached: list[Any] = field(default_factory=list)

    @classmethod
    async def of(cls, client: AsyncClient, shm_dir: str | None = None) -> Engine:
        """shm_dir: where the server's /dev/shm is seen from here (a server on a simulated host)."""
        info = await client.get_info()
        layout = layout_from_proto(info.layout, tp_size=info.tp_size)
        eng = cls(info, layout)
        regions = build_pool_layout(layout).regions
        for pool in info.pools:
            if shm_dir is None:
                ap = attach_pool(pool)
                eng._attached.append(ap)
                buffer = ap.buffer
            else:
                buffer = np.memmap(f"{shm_dir}/{pool.shm_name.lstrip('/')}", dtype=np.uint8, mode="r+",
                                   shape=(pool.size_bytes,))
            eng.mem[pool.tp_rank] = RankMemory(regions, buffer)
        return eng

    def fill(self, ids: list[list[int]]) -> None:
        for rank, mem in self.mem.items():
            fill_rank(mem, rank, self.info.tp_size, self.layout.total_num_kv_heads, ids, self.layout.block_size,
                      self.layout.dcp_size)

    def check(self, ids: list[list[int]], first_position: list[int] | None = None,
              num_tokens: int | None = None) -> dict[int, list[str]]:
        out = {}
        for rank, mem in self.mem.items():
            errs = check_rank(mem, rank, self.info.tp_size, self.layout.total_num_kv_heads, ids,
                              self.layout.block_size, first_position, self.layout.dcp_size, num_tokens)
            if errs:
                out[rank] = errs[:3]
        return out

    def snapshot(self) -> dict[int, bytes]:
        return {r: bytes(m.buf) for r, m in self.mem.items()}

    def restore_blocks(self, snapshot: dict[int, bytes], ids: list[list[int]]) -> None:
        """Put back, from a snapshot, the bytes of these blocks (one list per group): what is
        left to compare afterwards is everything outside them."""
        for rank, mem in self.mem.items():
            old = np.frombuffer(snapshot[rank], np.uint8)
            for region in mem.regions:
                for b in ids[region.group_index]:
                    start = region.pool_offset + b * region.block_stride
                    mem.buf[start:start + region.block_len] = old[start:start + region.block_len]

    def close(self) -> None:
        self.mem.clear()
        for ap in self._attached:
            ap.close()


class ReleaseWatch:
    """Collects P's WatchReleases events in the background (use `await ReleaseWatch.open(client)`)."""

    def __init__(self, stream: Any) -> None:
        self.events: list[pb.WatchReleasesResponse] = []
        self._stream = stream
        self._task = asyncio.ensure_future(self._run())

    @classmethod
    async def open(cls, client: AsyncClient) -> ReleaseWatch:
        return cls(await client.open_release_stream())  # subscribed when this returns

    async def _run(self) -> None:
        async for ev in self._stream:
            self.events.append(ev)

    async def wait_for(self, request_id: str, timeout_s: float = 10.0) -> list[pb.WatchReleasesResponse]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            got = [e for e in self.events if e.request_id == request_id]
            if got:
                await asyncio.sleep(0.2)  # a duplicate would arrive right behind the first
                return [e for e in self.events if e.request_id == request_id]
            await asyncio.sleep(0.02)
        return []

    async def close(self) -> None:
        self._stream.cancel()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


async def assert_consumed_everywhere(watches: list[ReleaseWatch], clients: list[AsyncClient],
                                     request_id: str) -> None:
    """Each P server released request_id exactly once, CONSUMED, and holds no lease at all."""
    for w in watches:
        events = await w.wait_for(request_id)
        assert [e.reason for e in events] == [pb.RELEASE_REASON_CONSUMED], events
    for c in clients:
        assert (await c.get_info()).live_leases == 0


@dataclass
class Session:
    """Clients of a P/D pair, both engines' pools, and P's release stream."""

    pc: AsyncClient
    dc: AsyncClient
    pe: Engine
    de: Engine
    watch: ReleaseWatch


@contextlib.asynccontextmanager
async def session(p: ServerProcess, d: ServerProcess, options: ClientOptions | None = None,
                  d_options: ClientOptions | None = None, shm_dirs: tuple[str | None, str | None] = (None, None),
                  ) -> AsyncIterator[Session]:
    """Clients of P and D (d_options: D's, when the engines hold different certificates;
    shm_dirs: where P's and D's /dev/shm are seen from here, for servers on simulated hosts)."""
    async with AsyncClient(p.address, options) as pc, AsyncClient(d.address, d_options or options) as dc:
        pe, de = await Engine.of(pc, shm_dirs[0]), await Engine.of(dc, shm_dirs[1])
        watch = await ReleaseWatch.open(pc)
        try:
            yield Session(pc, dc, pe, de, watch)
        finally:
            await watch.close()
            pe.close()
            de.close()


async def transfer_and_check(s: Session, request_id: str, p_ids: list[list[int]], d_ids: list[list[int]],
                             first_position: list[int] | None = None) -> pb.TransferResponse:
    """Fill P, publish, Transfer on D, and assert D's bytes, one CONSUMED release and no lease left."""
    s.pe.fill(p_ids)
    pub = await s.pc.publish_blocks(request_id, p_ids)
    resp = await s.dc.transfer("d-" + request_id, pub.params, d_ids, timeout_s=120)
    errors = s.de.check(d_ids, first_position)
    assert not errors, errors
    events = await s.watch.wait_for(request_id)
    assert [e.reason for e in events] == [pb.RELEASE_REASON_CONSUMED], events
    assert (await s.pc.get_info()).live_leases == 0
    return resp


@contextlib.asynccontextmanager
async def in_process_pair(name: str, d_overrides: Mapping[str, Any] | None = None,
                          **p_overrides: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A TP 1 P server and D server in this process (for tests that look inside them or
    hold their calls), engine ids <name>-p and <name>-d; stopped D first. A layout_table
    in p_overrides is D's too."""
    from kvsvc.config import Role, load_config
    from kvsvc.service.server import create_server

    p, _ = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, engine_id=f"{name}-p",
                                           role=Role.PREFILL, **p_overrides))
    d_config = {k: v for k, v in p_overrides.items() if k == "layout_table"} | dict(d_overrides or {})
    try:
        d, _ = await create_server(load_config(listen="127.0.0.1:0", tp_size=1, engine_id=f"{name}-d",
                                               role=Role.DECODE, **d_config))
    except BaseException:
        await p.stop(0)
        raise
    try:
        yield p, d
    finally:  # a claim left behind is not held to its deadline: this process's memory is no engine's
        await d.stop(0, hold_claims=False)
        await p.stop(0, hold_claims=False)


async def lease_ended(p: Any, request_id: str) -> LeaseState:
    """How request_id's lease on the in-process P server p ended, once it did -- an event
    (the table's release stream, subscribed before looking), not a poll: a transfer's
    answer may come before P heard its CONSUMED (RELIABILITY.md, promise 1)."""
    sub = p.node.leases.subscribe()
    try:
        state = p.node.leases.final_state(request_id)
        if state is not None:
            return state
        async for ev in sub:
            if ev.request_id == request_id:
                return p.node.leases.final_state(request_id)
        raise AssertionError("the lease table closed before the lease ended")
    finally:
        sub.close()


async def leases_drained(pc: AsyncClient, bound_s: float = 30.0) -> int:
    """P's live leases, once none is left (or as many as there are after bound_s): a
    transfer's answer may come before P heard its CONSUMED (RELIABILITY.md, promise 1), so a
    check that P let go waits for P to have done so."""
    deadline = time.monotonic() + bound_s
    while (live := (await pc.get_info()).live_leases) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return live


def same_block_bytes(pe: Engine, p_block: int, de: Engine, d_block: int) -> bool:
    """D's block d_block holds P's block p_block in every region (TP 1 to TP 1, one layout)."""
    return all(
        bytes(de.mem[0].buf[r.pool_offset + d_block * r.block_stride:][:r.block_len])
        == bytes(pe.mem[0].buf[r.pool_offset + p_block * r.block_stride:][:r.block_len])
        for r in de.mem[0].regions)


class HeldReads:
    """Holds the READs a server posts: each is posted for real, but its caller gets a flight
    of its own that completes and settles only after release() (and after the real READ
    ended). `posted` is set once a READ was handed to NIXL. Tests wait on these events,
    never on time. An abort of held flights aborts their real READs and lets them end then;
    with abort=False it leaves them held (they end on release, as READs NIXL could not
    cancel would)."""

    def __init__(self, server: Any, *, abort: bool = True) -> None:
        data = server.node.data
        assert data is not None
        self.posted, self.released = asyncio.Event(), asyncio.Event()
        self._real_read, self._real_abort = data.read, data.abort
        self._held: dict[int, tuple[Flight, asyncio.Event]] = {}  # id(held flight) -> (real, let go)
        self._tasks: list[asyncio.Future[None]] = []  # held: an unreferenced task may be collected
        self._abort_lets_go = abort
        data.read = self._read
        data.abort = self._abort
        data.read_now = lambda *args, **kw: None  # every READ through _read

    def release(self) -> None:
        self.released.set()

    async def _read(self, *args: Any, **kw: Any) -> list[Flight]:
        held = []
        loop = asyncio.get_running_loop()
        for real in await self._real_read(*args, **kw):
            fl, let_go = Flight(None, None, loop, loop.create_future(), asyncio.Event()), asyncio.Event()
            self._held[id(fl)] = (real, let_go)
            self._tasks.append(asyncio.ensure_future(self._complete_later(fl, real, let_go)))
            held.append(fl)
        self.posted.set()
        return held

    async def _abort(self, flights: list[Flight]) -> None:
        if not self._abort_lets_go:
            return
        pairs = [self._held[id(fl)] for fl in flights if id(fl) in self._held]
        await self._real_abort([real for real, _ in pairs])
        for _, let_go in pairs:
            let_go.set()

    async def _complete_later(self, fl: Flight, real: Flight, let_go: asyncio.Event) -> None:
        released, aborted = asyncio.ensure_future(self.released.wait()), asyncio.ensure_future(let_go.wait())
        await asyncio.wait([released, aborted], return_when=asyncio.FIRST_COMPLETED)
        released.cancel()
        aborted.cancel()
        try:
            duration = await real.result
        except Exception as exc:
            if not fl.result.done():  # done: cancelled with its transfer
                fl.result.set_exception(exc)
        else:
            if not fl.result.done():
                fl.result.set_result(duration)
        await real.settled.wait()
        fl.settled.set()


class ClaimsSeen:
    """An in-process P server's granted claims, as events per P request id: a test waits
    for P to have granted a claim instead of polling its lease table."""

    def __init__(self, server: Any) -> None:
        table = server.node.leases
        real = table.claim
        self._granted: dict[str, asyncio.Event] = {}

        def claim(request_id: str, *args: Any, **kw: Any) -> Any:
            lease = real(request_id, *args, **kw)  # raises when refused: nothing seen
            self.granted(request_id).set()
            return lease

        table.claim = claim

    def granted(self, request_id: str) -> asyncio.Event:
        return self._granted.setdefault(request_id, asyncio.Event())


def reads_end_before_post_returns(server: Any) -> None:
    """Every READ the server posts has ended by the time its post returns: the transfer finds
    them done and takes its short path (one claim-and-consumed, no early claim), whatever the
    machine's speed."""
    data = server.node.data
    assert data is not None
    real_read = data.read

    async def read(*args: Any, **kw: Any) -> list[Flight]:
        flights = await real_read(*args, **kw)
        for fl in flights:
            with contextlib.suppress(Exception):  # a failed READ is the transfer's to report
                await asyncio.shield(fl.result)
            await fl.settled.wait()
        return flights

    data.read = read
    data.read_now = lambda *args, **kw: None  # every READ through read
