"""LeaseTable: states, expiry order, claims, idempotent notifications, release events."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.errors import ErrorCode, FailedPrecondition, InvalidArgument, KvsvcError
from kvsvc.leases.table import LeaseState, LeaseTable


@pytest.fixture
async def table():
    claims: list[int] = []
    t = LeaseTable(epoch=7, hosted_ranks=[0, 1], tp_size=2, default_ttl_s=5.0, max_ttl_s=60.0,
                   on_claim_change=claims.append)
    t.claims = claims  # type: ignore[attr-defined]
    t.start()
    yield t
    await t.close()


async def collect(table, n, timeout=3.0):
    out = []
    sub = table.subscribe()

    async def take():
        async for ev in sub:
            out.append(ev)
            if len(out) == n:
                return

    try:
        await asyncio.wait_for(take(), timeout)
    finally:
        sub.close()
    return out


async def test_consumed_after_every_d_rank(table):
    watcher = asyncio.ensure_future(collect(table, 1))
    await asyncio.sleep(0)  # the watcher task subscribes
    table.publish("r", [[1, 2]], None)
    table.claim("r", 7, "D", 4, None)
    assert table.notify("r", "consumed", [0, 1], 7) == (LeaseState.CLAIMED, [2, 3])
    assert table.notify("r", "consumed", [2, 3], 7) == (LeaseState.CONSUMED, [])
    (ev,) = await watcher
    assert (ev.request_id, ev.reason, ev.block_ids) == ("r", LeaseState.CONSUMED, [[1, 2]])
    assert table.notify("r", "consumed", [0], 7) == (LeaseState.CONSUMED, [])  # duplicate: harmless
    assert table.claims == [1, -1] and table.live_count == 0


async def test_expiry_does_not_assume_publish_order(table):
    watcher = asyncio.ensure_future(collect(table, 1))
    await asyncio.sleep(0)  # the watcher task subscribes
    table.publish("long", [[1]], 0.4)
    table.publish("short", [[2]], 0.1)
    table.notify("short", "heartbeat", [], 7)  # extends "short" past "long" (default ttl 5 s)
    (ev,) = await watcher
    assert (ev.request_id, ev.reason) == ("long", LeaseState.EXPIRED)
    assert table.get("short").state is LeaseState.OFFERED


async def test_claim_refusals(table):
    table.publish("r", [[1]], 0.05)
    await asyncio.sleep(0.15)
    with pytest.raises(FailedPrecondition) as e:
        table.claim("r", 7, "D", 2, None)
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["state"] == "expired"
    table.publish("q", [[1]], None)
    with pytest.raises(FailedPrecondition) as e:
        table.claim("q", 8, "D", 2, None)
    assert e.value.reason == "LEASE_EXPIRED" and e.value.metadata["server_epoch"] == "7"
    with pytest.raises(FailedPrecondition) as e:
        table.claim("q", 7, "D", 3, None)
    assert e.value.reason == "TP_NOT_DIVISIBLE"
    table.claim("q", 7, "D", 2, None)
    with pytest.raises(FailedPrecondition) as e:
        table.claim("q", 7, "other", 2, None)
    assert e.value.reason == "LEASE_CLAIMED"


async def test_publish_refusals(table):
    table.publish("r", [[1]], None)
    with pytest.raises(KvsvcError) as e:
        table.publish("r", [[1]], None)
    assert e.value.reason == "LEASE_EXISTS" and e.value.code is ErrorCode.ALREADY_EXISTS
    with pytest.raises(InvalidArgument) as e:
        table.publish("x", [[1]], 61.0)
    assert e.value.reason == "LEASE_TTL_TOO_LONG"
    with pytest.raises(InvalidArgument):
        table.publish("", [[1]], None)


async def test_abort_releases_and_epoch_mismatch_reports_expired(table):
    table.publish("r", [[1]], None)
    table.claim("r", 7, "D", 1, None)
    assert table.notify("r", "aborted", [], 7)[0] is LeaseState.ABORTED
    assert table.notify("r", "consumed", [0], 99) == (LeaseState.EXPIRED, [])
    assert table.notify("nope", "consumed", [0], 7) == (None, [])
    assert table.claims == [1, -1]


async def test_notify_rank_out_of_range(table):
    table.publish("r", [[1]], None)
    table.claim("r", 7, "D", 2, None)
    with pytest.raises(InvalidArgument) as e:
        table.notify("r", "consumed", [5], 7)
    assert e.value.reason == "RANK_OUT_OF_RANGE"
