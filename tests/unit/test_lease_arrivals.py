"""LeaseArrivals: claims waiting on P for a lease not made yet.

A waiter wakes when its request id arrives (and only then, or at its timeout); waiters are
bounded per engine and in all, with a typed refusal; every way a wait ends (arrival,
timeout, cancellation, shutdown) leaves nothing counted or kept.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.errors import ErrorCode, KvsvcError, Unavailable
from kvsvc.leases.arrivals import LeaseArrivals
from kvsvc.leases.table import LeaseTable


def _empty(arrivals: LeaseArrivals) -> bool:
    return arrivals.waiting == 0 and not arrivals._waiting and not arrivals._of_engine


async def _started(arrivals: LeaseArrivals, n: int) -> None:
    """Until n waiters wait: each registers before its first suspension, so one loop turn."""
    await asyncio.sleep(0)
    assert arrivals.waiting == n


async def test_a_waiter_wakes_on_its_own_request_only():
    arrivals = LeaseArrivals()
    a = asyncio.ensure_future(arrivals.wait("a", "d", 60))
    b = asyncio.ensure_future(arrivals.wait("b", "d", 60))
    await _started(arrivals, 2)
    arrivals.arrived("a")
    await asyncio.wait_for(a, 5)
    assert not b.done() and arrivals.waiting == 1
    arrivals.arrived("b")
    await asyncio.wait_for(b, 5)
    assert _empty(arrivals)


async def test_a_wait_ends_at_its_timeout_and_when_cancelled():
    arrivals = LeaseArrivals()
    await arrivals.wait("a", "d", 0.01)  # nothing arrives: returns, the caller looks again
    w = asyncio.ensure_future(arrivals.wait("a", "d", 60))
    await _started(arrivals, 1)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert _empty(arrivals)
    arrivals.arrived("a")  # nobody left to wake: a no-op


@pytest.mark.parametrize("bound", ["engine", "total"])
async def test_waiters_are_bounded_with_a_typed_refusal(bound):
    arrivals = LeaseArrivals(max_per_engine=2, max_total=3)
    engines = ["d1", "d1"] if bound == "engine" else ["d1", "d2", "d3"]
    waits = [asyncio.ensure_future(arrivals.wait(f"r{i}", e, 60)) for i, e in enumerate(engines)]
    await _started(arrivals, len(waits))
    with pytest.raises(KvsvcError) as e:
        await arrivals.wait("over", "d1" if bound == "engine" else "d4", 60)
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TOO_MANY_WAITING_CLAIMS")
    assert e.value.metadata["max_per_engine"] == "2" and e.value.metadata["max_total"] == "3"
    assert arrivals.waiting == len(waits), "a refused waiter is not counted"
    for i in range(len(waits)):
        arrivals.arrived(f"r{i}")
    await asyncio.gather(*waits)
    assert _empty(arrivals)
    await arrivals.wait("again", "d1", 0.001)  # room again


async def test_close_ends_every_waiter_with_shutting_down_and_refuses_new_ones():
    arrivals = LeaseArrivals()
    w = asyncio.ensure_future(arrivals.wait("a", "d", 60))
    await _started(arrivals, 1)
    arrivals.close()
    for aw in (w, arrivals.wait("b", "d", 60)):
        with pytest.raises(Unavailable) as e:
            await asyncio.wait_for(aw, 5)
        assert e.value.reason == "SHUTTING_DOWN"
    assert _empty(arrivals)


async def test_the_lease_table_wakes_waiters_on_publish_refusal_and_early_abort():
    from kvsvc.leases.table import NotifyKind

    table = LeaseTable(epoch=7, hosted_ranks=[0], tp_size=1)
    arrivals = table.arrivals
    waits = {rid: asyncio.ensure_future(arrivals.wait(rid, "d", 60)) for rid in ("pub", "ref", "abo")}
    await _started(arrivals, 3)
    table.publish("pub", [[1]], None, token="t" * 32)
    table.refuse("ref", "t" * 32)
    table.notify("abo", NotifyKind.ABORTED, [], 7, token="t" * 32)
    await asyncio.wait_for(asyncio.gather(*waits.values()), 5)
    assert _empty(arrivals)
    # A claim under the token given up early is refused as aborted, not "not made yet".
    with pytest.raises(KvsvcError) as e:
        table.claim("abo", 7, token="t" * 32, claim_id="c" * 16, d_engine_id="d", d_tp_size=1)
    assert e.value.metadata["state"] == "aborted"
    await table.close()
