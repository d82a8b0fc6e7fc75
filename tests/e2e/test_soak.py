"""The soak (benchmarks/soak.py, `make soak`: 250,000 transfers) in small: 2,400 stamped
transfers through one D server while its P is killed and then stopped gracefully, with
transfers in flight each time. No transfer that answered OK may hold other bytes than the
ones just stamped into P's block, every failure must be typed, and after each restart a
new transfer must succeed again (how soon is the soak's figure, not asserted here)."""

from __future__ import annotations

from benchmarks.soak import IN_FLIGHT, Soak


async def test_restarts_under_load_cost_typed_failures_and_never_wrong_bytes():
    soak = Soak(2400, 800)
    results = await soak.run()
    print({k: v for k, v in results.items() if k != "segments"})
    assert results["wrong_bytes"] == 0 and results["untyped_failures"] == {}, results
    assert results["faults"] == 2 and len(soak.recoveries) == 2  # a success after each restart
    # Each fault costs at most the transfers in flight when P went (and the publishes to it).
    assert sum(results["typed_failures"].values()) <= 2 * 2 * IN_FLIGHT, results["typed_failures"]
    assert results["ok"] >= results["transfers"] - 2 * 2 * IN_FLIGHT
    assert results["d_growth_after_first_segment"]["fds"] <= 0 and results["d_growth_after_first_segment"]["threads"] <= 0
