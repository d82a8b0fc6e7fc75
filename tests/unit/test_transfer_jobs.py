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
