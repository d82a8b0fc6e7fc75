"""A lease does not expire because P's own event loop stalled (leases/table.py, LOOP_STALL_S).

While P's loop does not run (a GC pause, a thread starved by its engine), D's renewals sit
unread in its sockets; when it runs again, the leases that fell due meanwhile get as long
again as the stall was, so those renewals are read before any lease expires. A lease nobody
renews still expires (once per renewal: a loop late every time does not keep it forever).
The stall here is the loop's own thread blocked, as in the real thing; the renewal is the
call read first after it (asyncio runs a resumed task before the reaper's due timer)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvsvc.leases.table import LOOP_STALL_S, LeaseState, LeaseTable, NotifyKind

TTL_S = 0.2


@pytest.fixture
async def table():
    t = LeaseTable(epoch=7, hosted_ranks=[0], tp_size=1, default_ttl_s=5.0, max_ttl_s=60.0)
    t.start()
    yield t
    await t.close()


async def planned(table: LeaseTable) -> None:
    """Until the reaper sleeps towards the earliest deadline (it runs once the publish woke it)."""
    for _ in range(100):
        if table._planned is not None:
            return
        await asyncio.sleep(0)
    raise AssertionError("the reaper never planned a wake-up")


def stall(seconds: float) -> None:
    time.sleep(seconds)  # the loop's own thread blocked: nothing on the loop runs meanwhile


def heartbeat(table: LeaseTable, rid: str) -> None:
    table.notify(rid, NotifyKind.HEARTBEAT, [], 7, token=table.get(rid).token)


@pytest.mark.parametrize("first", ["reaper", "claim"])
async def test_a_renewal_read_right_after_a_stall_finds_the_lease_alive(table, first):
    """first: what runs first once the loop runs again -- the reaper's due timer (uvloop
    runs timers before reading sockets) or a claim read from a socket."""
    table.publish("kept", [[1]], TTL_S)
    table.publish("idle", [[2]], TTL_S)
    await planned(table)
    stall(TTL_S + 3 * LOOP_STALL_S)  # both fell due while the loop was stalled
    if first == "reaper":
        table.expire_due()
        heartbeat(table, "kept")  # the renewal D sent meanwhile, read now: the lease is alive
    else:
        table.claim("kept", 7, token=table.get("kept").token, claim_id="c" * 32, d_engine_id="D", d_tp_size=1,
                    d_ranks=())
    assert table.get("kept").state in (LeaseState.OFFERED, LeaseState.CLAIMED)
    assert table.get("idle").state is LeaseState.OFFERED  # given as long again, not expired at once
    sub = table.subscribe()
    try:
        ev = await asyncio.wait_for(anext(aiter(sub)), 10)  # nobody renews "idle": it expires after its grace
    finally:
        sub.close()
    assert (ev.request_id, ev.reason) == ("idle", LeaseState.EXPIRED)
    assert table.get("kept") is not None  # renewed for the default 5 s


async def test_the_grace_is_given_once_per_renewal(table):
    token = table.publish("idle", [[2]], TTL_S).token
    await planned(table)
    stall(TTL_S + 3 * LOOP_STALL_S)
    table.expire_due()  # the reaper, late: the lease gets a grace, not expiry
    assert table.get("idle").state is LeaseState.OFFERED
    stall(TTL_S + 6 * LOOP_STALL_S)  # past the grace, the loop stalled again
    table._planned = time.monotonic() - 2 * LOOP_STALL_S  # (the reaper was late again)
    table.expire_due()
    assert table.get("idle") is None  # no second grace without a renewal in between
    assert table.notify("idle", NotifyKind.HEARTBEAT, [], 7, token=token)[0] is LeaseState.EXPIRED


async def test_a_loop_on_time_expires_leases_as_before(table):
    table.publish("idle", [[2]], TTL_S)
    sub = table.subscribe()
    try:
        ev = await asyncio.wait_for(anext(aiter(sub)), 10)
    finally:
        sub.close()
    assert (ev.request_id, ev.reason) == ("idle", LeaseState.EXPIRED)
