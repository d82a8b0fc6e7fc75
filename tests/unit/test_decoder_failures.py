"""Transfer's failure paths with a fake data plane and peer (the real path is covered end to end).

A deadline or a cancellation mid-read must (1) wait until the posted READs settle, so
nothing writes D's blocks after the caller hears they are invalid, (2) tell P the
request was aborted, keyed by the P-side id, and (3) say that no block is valid.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvsvc.config import MemoryMode, load_config
from kvsvc.errors import DeadlineExceeded, ErrorCode, FailedPrecondition, KvsvcError
from kvsvc.layout import build_pool_layout
from kvsvc.mapping import Side
from kvsvc.service.decode import Decoder
from kvsvc.service.node import Node
from kvsvc.service.peers import Peer, RemoteRank
from kvsvc.transport.ports import Flight, TransferError
from kvsvc.v1 import kv_transfer_pb2 as pb


class FakeData:
    """Posts READs that the test completes or settles; like NIXL with a transfer it cannot cancel."""

    alive = True

    def __init__(self) -> None:
        self.flights: list[Flight] = []
        self.aborted: list[Flight] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def need_progress(self, delta: int) -> None:
        pass

    async def abort(self, flights: list[Flight]) -> None:
        self.aborted.extend(flights)

    def read_now(self, *args, **kw) -> None:
        return None  # READs here are long ones (the test ends them): posted through read()

    async def read(self, *args, **kw) -> list[Flight]:
        loop = asyncio.get_running_loop()
        fl = Flight(None, None, loop, loop.create_future(), asyncio.Event())
        self.flights.append(fl)
        return [fl]


class FakePeerClient:
    def __init__(self, data: FakeData) -> None:
        self.notified: list[pb.NotifyRequest] = []
        self.settled_when_notified: list[bool] = []
        self.data = data

    claim_behaviour = "grant"

    async def claim_lease(self, req, **kw):
        if self.claim_behaviour == "hang":
            await asyncio.sleep(60)
        if self.claim_behaviour == "refuse":
            raise FailedPrecondition("LEASE_CLAIMED", "claimed by another engine", {"claimed_by": "other"})
        return pb.ClaimLeaseResponse(lease_remaining_ms=self.claim_ms)

    claim_ms = 30_000

    async def notify(self, req, **kw):
        self.notified.append(req)
        self.settled_when_notified.append(all(f.settled.is_set() for f in self.data.flights))
        if req.kind == pb.NOTIFY_KIND_HEARTBEAT:
            return pb.NotifyResponse(state=pb.LEASE_STATE_CLAIMED, lease_remaining_ms=self.claim_ms)
        if req.kind == pb.NOTIFY_KIND_CONSUMED:
            return pb.NotifyResponse(state=pb.LEASE_STATE_CONSUMED)
        return pb.NotifyResponse(state=pb.LEASE_STATE_ABORTED)

    async def close(self):
        pass


class FakePeers:
    """The decoder's peer cache with one P server already handshaken."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    @contextlib.asynccontextmanager
    async def use(self, address, expected_engine_id, want_epoch):
        yield self.peer

    def listing(self) -> list[Peer]:
        return [self.peer]

    async def side_of(self, address: str) -> Side:
        return self.peer.side

    @property
    def cached(self) -> int:
        return 1

    async def close(self) -> None:
        pass


@contextlib.asynccontextmanager
async def decoder_over(data: FakeData, client: FakePeerClient) -> AsyncIterator[Decoder]:
    """A started Node over a buffer of its own, with data as its data plane and client's P server."""
    config = load_config(listen="127.0.0.1:0", tp_size=1, role=None, memory=MemoryMode.DRAM)
    size = Side.of(config.layout(), 1).pool.size_bytes
    node = Node(config, external_pools={0: np.zeros(size, np.uint8)}, data_plane=lambda *_: data)
    await node.start()
    regions = build_pool_layout(node.layout).regions
    peer = Peer("p:1", "P", 42, Side.of(node.layout, 1),
                {0: RemoteRank(0, "P/r0", [(1 << 30) + r.pool_offset for r in regions])}, client)  # type: ignore[arg-type]
    dec = Decoder(node, peers=FakePeers(peer))
    try:
        yield dec
    finally:
        await dec.close()
        await node.close()


@pytest.fixture
async def decoder():
    data = FakeData()
    client = FakePeerClient(data)
    async with decoder_over(data, client) as dec:
        yield dec, client, data


def request() -> pb.TransferRequest:
    params = pb.TransferParams(remote_address="p:1", remote_engine_id="P", remote_request_id="p-side-id",
                               remote_epoch=42, remote_block_ids_per_group=[pb.BlockIds(block_ids=[1, 2])])
    return pb.TransferRequest(request_id="d-side-id", params=params,
                              local_block_ids_per_group=[pb.BlockIds(block_ids=[3, 4])])


async def posted(data: FakeData, timeout_s: float = 5.0) -> None:
    """Wait until the transfer posted its reads (planning takes a while on a loaded machine)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not data.flights:
        assert loop.time() < end, "reads were never posted"
        await asyncio.sleep(0.001)


def settle_later(data: FakeData, delay_s: float) -> None:
    def settle() -> None:
        for f in data.flights:
            f.result.cancel()
            f.settled.set()

    asyncio.get_running_loop().call_later(delay_s, settle)


def complete_later(data: FakeData, delay_s: float) -> None:
    def complete() -> None:
        for f in data.flights:
            f.result.set_result(delay_s)
            f.settled.set()

    asyncio.get_running_loop().call_later(delay_s, complete)


async def test_deadline_waits_for_reads_then_aborts(decoder):
    dec, client, data = decoder
    task = asyncio.ensure_future(dec.transfer(request(), 0.2))
    await posted(data)
    settle_later(data, 0.2)
    with pytest.raises(DeadlineExceeded) as e:
        await task
    (note,) = client.notified
    assert note.kind == pb.NOTIFY_KIND_ABORTED and note.request_id == "p-side-id"
    assert client.settled_when_notified == [True]
    failure = [d for d in e.value.details if isinstance(d, pb.TransferFailure)]
    assert failure and not failure[0].valid_local_block_ids_per_group and failure[0].remote_notified
    assert data.aborted == data.flights, "the reads were cancelled, not left to run"


async def test_cancel_waits_for_reads_then_aborts(decoder):
    dec, client, data = decoder
    task = asyncio.ensure_future(dec.transfer(request(), None))
    await posted(data)
    settle_later(data, 0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The caller is gone at once; WaitTransfer says when the blocks are settled.
    state = await dec.wait(pb.WaitTransferRequest(request_id="d-side-id", wait_ms=5000))
    assert state.state == pb.TRANSFER_STATE_FAILED and state.error_reason == "CANCELLED"
    assert all(f.settled.is_set() for f in data.flights)
    assert [n.kind for n in client.notified] == [pb.NOTIFY_KIND_ABORTED]
    assert client.settled_when_notified == [True]
    with pytest.raises(KvsvcError) as e:  # a late retry of the same request learns what happened
        await dec.transfer(request(), None)
    assert (e.value.code, e.value.reason) == (ErrorCode.CANCELLED, "TRANSFER_CANCELLED")


async def test_cancel_during_claim_aborts_the_lease(decoder):
    # The READs went out with the claim; the claim may already have been granted when the
    # caller gave up: the READs settle first, then P hears ABORTED.
    dec, client, data = decoder
    client.claim_behaviour = "hang"
    task = asyncio.ensure_future(dec.transfer(request(), None))
    await posted(data)
    settle_later(data, 0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    state = await dec.wait(pb.WaitTransferRequest(request_id="d-side-id", wait_ms=5000))
    assert state.state == pb.TRANSFER_STATE_FAILED
    assert [(n.kind, n.request_id) for n in client.notified] == [(pb.NOTIFY_KIND_ABORTED, "p-side-id")]
    assert client.settled_when_notified == [True]
    assert data.aborted == data.flights, "the reads were cancelled, not left to run"


async def test_refused_claim_aborts_nothing(decoder):
    # Another engine's claim stands: the READs that raced the claim are cancelled and
    # settled before the answer, and D does not abort a lease that is not its own.
    dec, client, data = decoder
    client.claim_behaviour = "refuse"
    task = asyncio.ensure_future(dec.transfer(request(), None))
    await posted(data)
    settle_later(data, 0.1)
    with pytest.raises(FailedPrecondition) as e:
        await task
    assert e.value.reason == "LEASE_CLAIMED" and e.value.metadata == {"claimed_by": "other"}
    assert all(f.settled.is_set() for f in data.flights), "answered before the READs settled"
    failure = [d for d in e.value.details if isinstance(d, pb.TransferFailure)]
    assert failure and not failure[0].valid_local_block_ids_per_group
    await asyncio.sleep(0.05)  # nothing in the background either
    assert client.notified == []


async def test_long_reads_keep_the_lease_alive(decoder):
    # Reads outlive the lease (150 ms): heartbeats renew it, and the transfer succeeds.
    dec, client, data = decoder
    client.claim_ms = 150

    task = asyncio.ensure_future(dec.transfer(request(), None))
    await posted(data)
    complete_later(data, 0.5)
    resp = await task
    kinds = [n.kind for n in client.notified]
    assert kinds.count(pb.NOTIFY_KIND_HEARTBEAT) >= 3 and kinds[-1] == pb.NOTIFY_KIND_CONSUMED
    assert resp.total_bytes > 0


async def test_reads_past_an_unrenewed_lease_fail(decoder):
    # Heartbeats cannot renew (P answers an expired lease): the transfer must not report success.
    dec, client, data = decoder
    client.claim_ms = 100

    async def expired(req, **kw):
        client.notified.append(req)
        return pb.NotifyResponse(state=pb.LEASE_STATE_EXPIRED)

    client.notify = expired

    task = asyncio.ensure_future(dec.transfer(request(), None))
    await posted(data)
    complete_later(data, 0.3)
    with pytest.raises(FailedPrecondition) as e:
        await task
    assert e.value.reason == "LEASE_EXPIRED"


class SlowAbortData(FakeData):
    """A data plane whose cancel takes a while and whose READs outlive their post (as over
    RDMA): a cancel of the job that lands meanwhile must not end it before they settled."""

    async def abort(self, flights: list[Flight]) -> None:
        self.aborted.extend(flights)
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.02, 0.06, 0.1])
async def test_a_cancel_on_the_failure_path_still_waits_for_the_reads(cancel_after_s):
    data = SlowAbortData()
    client = FakePeerClient(data)
    client.claim_behaviour = "hang"
    async with decoder_over(data, client) as dec:
        task = asyncio.ensure_future(dec.transfer(request(), 0.1))  # fails at its deadline, READs still running
        await posted(data)
        await asyncio.sleep(0.09 + cancel_after_s)  # then the caller cancels, somewhere on the failure path
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, KvsvcError):
            await task
        job = dec.jobs.find("d-side-id")
        assert job is not None
        settle_later(data, 0.3)
        state = await dec.wait(pb.WaitTransferRequest(request_id="d-side-id", wait_ms=5000))
        assert state.state == pb.TRANSFER_STATE_FAILED
        assert all(f.settled.is_set() for f in data.flights), "reported settled while a READ could still write"


class StalledPeerClient(FakePeerClient):
    """A P server that takes calls and never answers (SIGSTOPped): each call ends at its timeout."""

    async def claim_lease(self, req, timeout_s: float = 10.0, **kw):
        await asyncio.sleep(timeout_s)
        raise DeadlineExceeded("DEADLINE_EXCEEDED", "no answer")

    async def notify(self, req, timeout_s: float = 10.0, **kw):
        self.notified.append(req)
        self.settled_when_notified.append(all(f.settled.is_set() for f in self.data.flights))
        await asyncio.sleep(timeout_s)
        raise DeadlineExceeded("DEADLINE_EXCEEDED", "no answer")


@pytest.mark.parametrize("deadline_s", [0.3, 1.0])
async def test_a_stalled_p_still_gets_a_typed_settled_answer_before_the_deadline(deadline_s):
    """The READs end at once but P never answers the claim: the answer (with TransferFailure,
    remote_notified false) comes before the caller's deadline, and P is told in the background."""
    data = FakeData()
    async with decoder_over(data, StalledPeerClient(data)) as dec:
        stalled = dec.peers.listing()[0].client
        task = asyncio.ensure_future(dec.transfer(request(), deadline_s))
        await posted(data)
        complete_later(data, 0.0)
        try:
            async with asyncio.timeout(deadline_s):  # the caller's own deadline
                await task
        except KvsvcError as e:
            failure = [d for d in e.details if isinstance(d, pb.TransferFailure)]
            assert failure and not failure[0].remote_notified, e
        else:
            raise AssertionError("a transfer whose claim was never answered succeeded")
        assert all(f.settled.is_set() for f in data.flights)
        await asyncio.sleep(0.05)
        assert [n.kind for n in stalled.notified] == [pb.NOTIFY_KIND_ABORTED], "P is still told to let go"


class DyingData(FakeData):
    """A data plane whose NIXL thread dies with READs in flight: their results fail, and
    `settled` stays unset (a NIC may still write: nobody can say they ended)."""

    def die(self) -> None:
        self.alive = False  # type: ignore[misc]
        for f in self.flights:
            if not f.result.done():
                f.result.set_exception(TransferError("the NIXL thread stopped"))

    async def abort(self, flights: list[Flight]) -> None:  # pragma: no cover - must not be asked
        raise AssertionError("a dead data plane was asked to cancel")


async def test_reads_in_flight_when_the_data_plane_dies_are_quarantined_never_settled():
    """Trust four, fix 5: the failure path asked the dead data plane first, failed, and the
    job was reported settled (FAILED) with READs in flight. Now the answer is typed with
    TransferFailure.quarantined, WaitTransfer says QUARANTINED (the blocks are not free) and
    the gauge counts it, until the READs do end; then FAILED."""
    data = DyingData()
    client = FakePeerClient(data)
    async with decoder_over(data, client) as dec:
        task = asyncio.ensure_future(dec.transfer(request(), None))
        await posted(data)
        data.die()
        with pytest.raises(KvsvcError) as e:
            await task
        (failure,) = [d for d in e.value.details if isinstance(d, pb.TransferFailure)]
        assert failure.quarantined and not failure.valid_local_block_ids_per_group
        state = await dec.wait(pb.WaitTransferRequest(request_id="d-side-id", wait_ms=50))
        assert state.state == pb.TRANSFER_STATE_QUARANTINED and state.failure.quarantined
        assert dec.jobs.quarantined == 1 and not dec.jobs.find("d-side-id").settled.is_set()
        with pytest.raises(KvsvcError) as again:  # a retry is answered at once (the data plane is down)
            await asyncio.wait_for(dec.transfer(request(), None), 10)
        assert again.value.reason == "DATA_PLANE_UNAVAILABLE"
        for f in data.flights:  # the READs end after all (say the NIC finished)
            f.settled.set()
        state = await dec.wait(pb.WaitTransferRequest(request_id="d-side-id", wait_ms=5000))
        assert state.state == pb.TRANSFER_STATE_FAILED and not state.failure.quarantined
        assert dec.jobs.quarantined == 0


async def test_reads_that_do_not_end_after_a_failure_are_quarantined_within_a_bound(monkeypatch):
    """Trust four, fix 8: a READ cut by a dead link kept the transfer RUNNING without bound.
    Past QUARANTINE_AFTER_S the job answers (quarantined) instead; it settles when they end."""
    from kvsvc.service import transfer_run

    monkeypatch.setattr(transfer_run, "QUARANTINE_AFTER_S", 0.2)  # the bound itself, not a race: nothing ends them
    data = FakeData()
    client = FakePeerClient(data)
    async with decoder_over(data, client) as dec:
        task = asyncio.ensure_future(dec.transfer(request(), 0.2))  # fails at its deadline, READs never end
        await posted(data)
        with pytest.raises(DeadlineExceeded) as e:
            await asyncio.wait_for(task, 30)
        (failure,) = [d for d in e.value.details if isinstance(d, pb.TransferFailure)]
        assert failure.quarantined and data.aborted == data.flights
        assert (await dec.wait(pb.WaitTransferRequest(request_id="d-side-id"))).state == \
            pb.TRANSFER_STATE_QUARANTINED
        assert client.settled_when_notified == [False]  # P was told to let go; D's blocks stay held
        settle_later(data, 0.0)
        state = await dec.wait(pb.WaitTransferRequest(request_id="d-side-id", wait_ms=5000))
        assert state.state == pb.TRANSFER_STATE_FAILED
