"""A D server's byte bound on remembered transfers holds for the RSS the process really spends.

D keeps each finished transfer's outcome (for retries and WaitTransfer) under a bound of
64 MiB, kept on its own estimate per record (the gauge kvsvc_transfer_record_bytes). A
bound on an estimate is only as good as the estimate: here real P and D processes move
1,000-block requests whose leases were released before D's claim (D read, P refused, D
answers with TransferFailure), and D's RSS growth per kept failed record must not exceed what D
estimates for it. benchmarks/record_memory.py is the measurement (its figures are in
docs/SECURITY.md); successful records are measured beside them and reported.
"""

from __future__ import annotations

from benchmarks.record_memory import main


async def test_a_kept_failed_record_costs_no_more_rss_than_d_counts_for_it():
    results = await main(1500, 3)
    failed = [b for b in results["batches"] if b["kind"] == "failed"]
    assert all(b["failed"] == b["transfers"] for b in failed), failed  # every one took the failure path
    grown = sum(b["rss_after_kib"] - b["rss_before_kib"] for b in failed)
    kept = sum(b["transfers"] for b in failed)
    estimated = min(b["estimated_kib_per_transfer"] for b in failed)
    print(f"RSS per kept failed record {grown / kept:.2f} KiB, estimated {estimated} KiB; batches: {results['batches']}")
    # Over every failed batch: one batch alone may catch an arena the allocator grew for all.
    assert grown / kept <= estimated, results["batches"]
    assert estimated < 4, "the estimate must stay an estimate of the record, not a cap nobody reaches"
