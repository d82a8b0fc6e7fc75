"""D's side of a progressive lease's content digests (service/commit_follower.py): what each
WaitCommit answer brings is kept per P rank and block, and an answer whose digests do not
fit what was committed -- a gap, more digests than blocks, a rank the server does not host,
another number of groups -- is refused PARAMS_INCONSISTENT rather than guessed at. The
servers' side is tests/e2e/test_progressive_digests.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsvc.errors import InvalidArgument
from kvsvc.service.commit_follower import CommitFollower
from kvsvc.v1 import kv_transfer_pb2 as pb


def follower(ranks=(0, 1)) -> tuple[CommitFollower, SimpleNamespace]:
    leg = SimpleNamespace(peer=SimpleNamespace(address="p:1", ranks={r: None for r in ranks}), clock=None)
    own = SimpleNamespace(params=pb.TransferParams(remote_request_id="r"))
    return CommitFollower([leg], own, [2], want_content=True), leg  # type: ignore[list-item, arg-type]


def answer(epoch: int, blocks: list[int], digests: dict[int, tuple[int, list[int]]]) -> pb.WaitCommitResponse:
    return pb.WaitCommitResponse(
        commit_epoch=epoch, block_ids_per_group=[pb.BlockIds(block_ids=blocks)], num_tokens=4 * epoch,
        lease_remaining_ms=1000,
        content=[pb.BlockContent(rank=r, groups=[pb.GroupContent(first_block=first, digests=ds)])
                 for r, (first, ds) in digests.items()])


def test_digests_are_kept_per_rank_and_block_across_answers():
    f, leg = follower()
    f._take(leg, answer(1, [7, 8], {0: (0, [70]), 1: (0, [71])}))  # block 8 not whole yet
    f._take(leg, answer(2, [9], {0: (1, [80, 90]), 1: (1, [81, 91])}))
    assert f.expected_content() == {0: {(0, 7): 70, (0, 8): 80, (0, 9): 90},
                                    1: {(0, 7): 71, (0, 8): 81, (0, 9): 91}}
    f._take(leg, answer(2, [], {}))  # nothing new (a wait that timed out): nothing changes
    assert f.expected_content()[0] == {(0, 7): 70, (0, 8): 80, (0, 9): 90}


@pytest.mark.parametrize("digests", [
    {0: (1, [70])},  # a gap: block 0's digest never came
    {0: (0, [70, 80, 90])},  # more digests than the two blocks committed
    {5: (0, [70])},  # a rank this server does not host
], ids=["gap", "too-many", "foreign-rank"])
def test_digests_that_do_not_fit_the_commits_are_refused(digests):
    f, leg = follower()
    with pytest.raises(InvalidArgument) as e:
        f._take(leg, answer(1, [7, 8], digests))
    assert e.value.reason == "PARAMS_INCONSISTENT" and e.value.metadata["address"] == "p:1"


def test_digests_in_another_number_of_groups_are_refused():
    f, leg = follower()
    resp = answer(1, [7], {})
    resp.content.append(pb.BlockContent(rank=0, groups=[pb.GroupContent(digests=[1]), pb.GroupContent(digests=[2])]))
    with pytest.raises(InvalidArgument) as e:
        f._take(leg, resp)
    assert e.value.reason == "PARAMS_INCONSISTENT" and e.value.metadata["rank"] == "0"
