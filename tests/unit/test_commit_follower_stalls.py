"""D's waits for a progressive lease's next commit when P does not answer in time
(service/commit_follower.py): the same question is asked again while P's lease holds by D's
clock and the transfer has time; a lease D's clock says ended, or a transfer out of time,
ends the wait with the call's DEADLINE_EXCEEDED. A fake client for these failure paths; the
real stalled P server (SIGSTOP) is tests/e2e/test_progressive.py's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvsvc.errors import DeadlineExceeded, Unavailable
from kvsvc.service import commit_follower
from kvsvc.service.commit_follower import CommitFollower
from kvsvc.service.legs import LeaseClock
from kvsvc.v1 import kv_transfer_pb2 as pb


class SilentThenAnswering:
    """A P server's client: the first `silent` waits end at the caller's timeout unanswered."""

    def __init__(self, silent: int, error: type[Exception] = DeadlineExceeded) -> None:
        self.silent, self.error = silent, error
        self.asked: list[pb.WaitCommitRequest] = []

    async def wait_commit(self, req: pb.WaitCommitRequest, *, timeout_s: float) -> pb.WaitCommitResponse:
        asked = pb.WaitCommitRequest()
        asked.CopyFrom(req)
        self.asked.append(asked)
        if len(self.asked) <= self.silent:
            raise self.error("DEADLINE_EXCEEDED", "Deadline Exceeded")
        return pb.WaitCommitResponse(commit_epoch=req.after_epoch + 1, block_ids_per_group=[pb.BlockIds(block_ids=[7])],
                                     num_tokens=4, final=True, lease_remaining_ms=30_000)


def follower(client, clock: LeaseClock | None) -> tuple[CommitFollower, list[int]]:
    leg = SimpleNamespace(peer=SimpleNamespace(address="p:1", ranks={0: None}, epoch=1, client=client), clock=clock)
    own = SimpleNamespace(params=pb.TransferParams(remote_request_id="r"), engine_id="d", claim_id="c")
    unanswered: list[int] = []
    f = CommitFollower([leg], own, [2], on_unanswered=lambda: unanswered.append(1))  # type: ignore[list-item, arg-type]
    return f, unanswered


async def test_a_wait_p_did_not_answer_is_asked_again_the_same_while_the_lease_holds():
    client = SilentThenAnswering(silent=2)
    f, unanswered = follower(client, LeaseClock(30_000))
    await f.wait(60.0, reads_done=True)
    assert f.final and f.epoch == 1 and [b.tolist() for b in f.committed()] == [[7]]
    assert len(unanswered) == 2 and len(client.asked) == 3
    assert all(a.after_epoch == 0 and a.reads_done and a.reads_layers for a in client.asked)  # the same question
    assert all(0 < a.wait_ms <= commit_follower.COMMIT_WAIT_S * 1000 for a in client.asked)


async def test_a_lease_d_s_clock_says_ended_is_not_waited_on_again():
    client = SilentThenAnswering(silent=5)
    clock = LeaseClock(0)
    await asyncio.sleep(0.01)  # (its deadline is now past)
    f, unanswered = follower(client, clock)
    with pytest.raises(DeadlineExceeded):
        await f.wait(60.0)
    assert len(client.asked) == 1 and len(unanswered) == 1


async def test_a_transfer_out_of_time_ends_its_wait_with_the_calls_error():
    client = SilentThenAnswering(silent=5)
    f, unanswered = follower(client, LeaseClock(30_000))
    with pytest.raises(DeadlineExceeded):
        await f.wait(commit_follower.COMMIT_WAIT_MARGIN_S / 2)  # less than one wait's margin left
    assert len(client.asked) == 1 and client.asked[0].wait_ms == 0 and len(unanswered) == 1


async def test_other_errors_are_not_retried():
    client = SilentThenAnswering(silent=1, error=Unavailable)
    f, unanswered = follower(client, LeaseClock(30_000))
    with pytest.raises(Unavailable):
        await f.wait(60.0)
    assert len(client.asked) == 1 and not unanswered
