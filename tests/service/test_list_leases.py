"""ListLeases on a real P server in-process: what it shows, that it changes nothing, its limits."""

from __future__ import annotations

import pytest

from kvsvc.errors import InvalidArgument
from kvsvc.limits import MAX_LIST_LEASES
from kvsvc.v1 import kv_transfer_pb2 as pb


async def test_lists_offered_and_claimed_leases_without_extending_them(prefill):
    server, client = prefill
    a = await client.publish_blocks("job-a", [[1, 2, 3]], lease_ttl_ms=60_000)
    b = await client.publish_blocks("job-b", [[4]], lease_ttl_ms=20_000)
    await client.publish_blocks("other", [[5]], lease_ttl_ms=40_000)
    p = a.params
    await client.claim_lease(pb.ClaimLeaseRequest(request_id="job-a", lease_epoch=p.remote_epoch, engine_id="D",
                                                  tp_size=2, lease_token=p.lease_token, claim_id="c" * 16,
                                                  extend_ms=50_000))
    deadlines = {r: server.node.leases.get(r).expires_at for r in ("job-a", "job-b", "other")}

    resp = await client.list_leases()
    assert (resp.live_leases, resp.claimed_leases, resp.running_transfers) == (3, 1, 0)
    assert [x.request_id for x in resp.leases] == ["job-b", "other", "job-a"]  # soonest to expire first
    listed_a = resp.leases[2]
    assert listed_a.state == pb.LEASE_STATE_CLAIMED and listed_a.num_blocks == 3
    assert (listed_a.claimed_by_engine_id, listed_a.claimed_by_tp_size, listed_a.num_claims) == ("D", 2, 1)
    assert sorted(listed_a.pending_d_ranks) == [0, 1]
    listed_b = resp.leases[0]
    assert listed_b.state == pb.LEASE_STATE_OFFERED and not listed_b.claimed_by_engine_id
    assert 0 < listed_b.remaining_ms <= 20_000 and listed_b.published_unix_ms <= listed_b.expires_unix_ms
    # Secrets never leave the server this way.
    wire = resp.SerializeToString()
    assert p.lease_token.encode() not in wire and b.params.lease_token.encode() not in wire
    assert b"c" * 16 not in wire

    again = await client.list_leases()
    assert {r: server.node.leases.get(r).expires_at for r in deadlines} == deadlines, "listing extended a lease"
    assert again.leases[0].remaining_ms <= listed_b.remaining_ms

    only = await client.list_leases(limit=1, request_id_prefix="job-")
    assert [x.request_id for x in only.leases] == ["job-b"] and only.live_leases == 3


async def test_limit_and_prefix_are_bounded(prefill):
    _, client = prefill
    with pytest.raises(InvalidArgument) as e:
        await client.list_leases(limit=MAX_LIST_LEASES + 1)
    assert e.value.reason == "FIELD_TOO_LARGE" and e.value.metadata["field"] == "limit"
    with pytest.raises(InvalidArgument) as e:
        await client.list_leases(request_id_prefix="x" * 1000)
    assert e.value.reason == "FIELD_TOO_LARGE"
    assert (await client.list_leases(limit=MAX_LIST_LEASES)).live_leases == 0


async def test_a_lookup_by_exact_ids_answers_every_live_one_and_never_a_prefix_match(prefill):
    """'cmpl-1' beside 70 ids that start with it ('cmpl-10'..'cmpl-169'): a prefix lookup of
    64 misses it (published last, it expires last); the lookup by id finds it, and only the
    ids asked for."""
    _, client = prefill
    others = [f"cmpl-1{i}" for i in range(70)]
    for rid in others:
        await client.publish_blocks(rid, [[1]], lease_ttl_ms=60_000)
    await client.publish_blocks("cmpl-1", [[2]], lease_ttl_ms=60_000)
    by_prefix = await client.list_leases(limit=64, request_id_prefix="cmpl-1")
    assert "cmpl-1" not in {x.request_id for x in by_prefix.leases}  # what a prefix lookup got wrong
    got = await client.list_leases(request_ids=["cmpl-1", "cmpl-2", "never-published", "cmpl-1"], limit=1)
    assert [x.request_id for x in got.leases] == ["cmpl-1"], "limit does not apply, ids are exact, once each"
    many = await client.list_leases(request_ids=others)
    assert len(many.leases) == 70


async def test_a_lookup_by_ids_is_bounded(prefill):
    _, client = prefill
    with pytest.raises(InvalidArgument) as e:
        await client.list_leases(request_ids=["x"] * (MAX_LIST_LEASES + 1))
    assert e.value.reason == "FIELD_TOO_LARGE" and e.value.metadata["field"] == "request_ids"
    with pytest.raises(InvalidArgument) as e:
        await client.list_leases(request_ids=["ok", "y" * 1000])
    assert e.value.reason == "FIELD_TOO_LARGE" and e.value.metadata["field"] == "request_ids[1]"
