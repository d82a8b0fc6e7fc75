"""Apply a plan's byte ranges with numpy copies: a stand-in for NIXL in pure unit tests."""

from __future__ import annotations

from kvsvc.mapping.planner import RankPlan
from kvsvc.verify import RankMemory


def apply_plan(plan: RankPlan, local: RankMemory, remotes: dict[int, RankMemory]) -> None:
    for reads in plan.reads:
        src = remotes[reads.remote_rank]
        for lr, lo, rr, ro, ln in zip(reads.local_region.tolist(), reads.local_offset.tolist(),
                                      reads.remote_region.tolist(), reads.remote_offset.tolist(),
                                      reads.length.tolist(), strict=True):
            a, b = local.regions[lr], src.regions[rr]
            assert 0 <= lo and lo + ln <= a.extent, "local range outside its region"
            assert 0 <= ro and ro + ln <= b.extent, "remote range outside its region"
            dst = a.pool_offset + lo
            s0 = b.pool_offset + ro
            local.buf[dst:dst + ln] = src.buf[s0:s0 + ln]
