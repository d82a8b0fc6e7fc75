"""TransferJobs: one job per D request id, joined by retries, replaced only after a failure, fenced."""

from __future__ import annotations

import asyncio

import pytest

from kvsvc.errors import ErrorCode, FailedPrecondition, KvsvcError
from kvsvc.service.transfers import TransferJobs
from kvsvc.v1 import kv_transfer_pb2 as pb


async def test_retries_join_and_ids_are_not_reused_for_other_work():
    jobs, gate, runs = TransferJobs(), asyncio.Event(), []

    async def run() -> pb.TransferResponse:
        runs.append(1)
        await gate.wait()
        return pb.TransferResponse(total_bytes=7)

    a = jobs.start_or_join("r", b"same", run)
    assert jobs.start_or_join("r", b"same", run) is a  # a retry joins
    with pytest.raises(KvsvcError) as e:
        jobs.start_or_join("r", b"other", run)
    assert (e.value.code, e.value.reason) == (ErrorCode.ALREADY_EXISTS, "TRANSFER_EXISTS")
    assert (await jobs.wait("r", 0)).state == pb.TRANSFER_STATE_RUNNING
    gate.set()
    assert (await a.task).total_bytes == 7
    done = await jobs.wait("r", 0)
    assert done.state == pb.TRANSFER_STATE_SUCCEEDED and done.result.total_bytes == 7
    assert jobs.start_or_join("r", b"same", run) is a and len(runs) == 1  # replayed, not re-run
    with pytest.raises(KvsvcError):
        jobs.start_or_join("r", b"other", run)  # succeeded: the id is spent


async def test_a_failed_request_may_be_tried_again_with_new_params():
    jobs = TransferJobs()

    async def fail() -> pb.TransferResponse:
        raise FailedPrecondition("LEASE_EXPIRED", "gone", details=[pb.TransferFailure()])

    async def ok() -> pb.TransferResponse:
        return pb.TransferResponse(total_bytes=1)

    first = jobs.start_or_join("r", b"old", fail)
    with pytest.raises(FailedPrecondition):
        await first.task
    assert (await jobs.wait("r", 0)).error_reason == "LEASE_EXPIRED"
    assert jobs.start_or_join("r", b"old", ok) is first  # the same params: the same (failed) outcome
    second = jobs.start_or_join("r", b"new", ok)
    assert second is not first and (await second.task).total_bytes == 1


async def test_an_unknown_id_is_fenced_once_asked_about():
    jobs = TransferJobs()
    assert (await jobs.wait("late", 0)).state == pb.TRANSFER_STATE_UNKNOWN

    async def run() -> pb.TransferResponse:
        return pb.TransferResponse()

    with pytest.raises(FailedPrecondition) as e:
        jobs.start_or_join("late", b"x", run)
    assert e.value.reason == "TRANSFER_FENCED"


async def _fail_with_big_locals(kind: str) -> pb.TransferResponse:
    plans = [list(range(5_000)) for _ in range(4)]  # ~700 KB of locals, as a decode path's plans
    addresses = bytearray(256 * 1024)

    def inner() -> None:
        if kind == "kvsvc":
            raise FailedPrecondition("LEASE_EXPIRED", "x" * 10_000, {"request_id": "r", "big": "y" * 10_000},
                                     details=[pb.TransferFailure(remote_notified=True)])
        try:
            raise OSError("the cause, with its own traceback")
        except OSError as cause:
            raise RuntimeError("a bug") from cause

    assert plans and addresses
    inner()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("kind", ["kvsvc", "internal"])
async def test_a_failed_record_keeps_only_its_answer(kind):
    """A failed job's record must not keep the run's frames (its traceback) alive: 200 failed
    transfers whose frames held ~1 MB each must cost under 2.5 KiB each, not megabytes."""
    import gc
    import tracemalloc

    jobs = TransferJobs()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            job = jobs.start_or_join(f"r{i}", b"x", lambda: _fail_with_big_locals(kind))
            await asyncio.wait([job.task])  # type: ignore[list-item]
        del job
        await asyncio.sleep(0)
        gc.collect()
        per_record = (tracemalloc.get_traced_memory()[0] - before) / 200
    finally:
        tracemalloc.stop()
    assert jobs.remembered == 200
    # ~1.4 KiB measured (its answer as one serialized status, the Job, dict slots); 1.6 KiB
    # with the answer's fields as objects, and 3.3 KiB while each record kept two asyncio.Events
    # of its own (a deque each), long after they were set. tests/e2e/test_record_memory.py
    # checks D's estimate of a record against RSS.
    assert per_record < 2.5 * 1024, f"{per_record:.0f} bytes per failed record"
    assert jobs.remembered_bytes < 200 * 8 * 1024
    with pytest.raises(KvsvcError) as e:  # the answer is still whole (message and values clipped)
        jobs.find("r7").answer()  # type: ignore[union-attr]
    assert e.value.reason == ("LEASE_EXPIRED" if kind == "kvsvc" else "INTERNAL")
    assert e.value.__traceback__ is not None and len(e.value.message) < 1_000
    if kind == "kvsvc":
        assert isinstance(e.value, FailedPrecondition)
        assert [d.remote_notified for d in e.value.details if isinstance(d, pb.TransferFailure)] == [True]


async def _ok() -> pb.TransferResponse:
    return pb.TransferResponse(total_bytes=1)


async def test_records_pushed_out_early_stay_fences_until_their_time():
    """A record pushed out by the count or byte bound still fences its id for history_s: a late
    Transfer of it is refused, never run again into blocks the engine may have reused."""
    jobs = TransferJobs(history_s=0.3, history_max=2)
    for i in range(5):
        await jobs.start_or_join(f"r{i}", b"x", _ok).task  # type: ignore[misc]
    assert jobs.remembered == 2 and jobs.fences == 3
    with pytest.raises(FailedPrecondition) as e:
        jobs.start_or_join("r0", b"x", _ok)  # its outcome is forgotten; its id is not
    assert e.value.reason == "TRANSFER_FENCED"
    assert (await jobs.wait("r1", 0)).state == pb.TRANSFER_STATE_UNKNOWN  # settled, outcome gone
    await asyncio.sleep(0.35)  # past history_s: the id may be used again
    assert (await jobs.start_or_join("r0", b"x", _ok).task).total_bytes == 1  # type: ignore[union-attr]


async def test_fences_are_never_dropped_early_new_ids_are_refused_instead():
    jobs = TransferJobs(history_s=0.3, fences_max=4)
    for i in range(4):
        assert (await jobs.wait(f"f{i}", 0)).state == pb.TRANSFER_STATE_UNKNOWN
    with pytest.raises(KvsvcError) as e:
        jobs.start_or_join("new", b"x", _ok)
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TRANSFER_HISTORY_FULL")
    with pytest.raises(KvsvcError) as e:
        await jobs.wait("other", 0)  # it would need a fence too
    assert (e.value.code, e.value.reason) == (ErrorCode.RESOURCE_EXHAUSTED, "TRANSFER_HISTORY_FULL")
    with pytest.raises(FailedPrecondition):
        jobs.start_or_join("f0", b"x", _ok)  # still fenced
    await asyncio.sleep(0.35)
    assert (await jobs.start_or_join("f0", b"x", _ok).task).total_bytes == 1  # type: ignore[union-attr]
