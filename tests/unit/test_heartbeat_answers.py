"""Which heartbeat answers are P's word on a lease, and which only say P did not answer."""

from kvsvc.client.leases import LEASE_NOT_YET_MADE, heartbeat_is_transient
from kvsvc.reasons import Reason


def test_not_reached_or_not_answered_in_time_is_transient():
    for reason in (Reason.UNAVAILABLE, Reason.DEADLINE_EXCEEDED, Reason.PEER_UNAVAILABLE, Reason.SHUTTING_DOWN):
        assert heartbeat_is_transient(reason), reason


def test_lease_states_and_refusals_are_final():
    for answer in ("LEASE_STATE_OFFERED", "LEASE_STATE_EXPIRED", "LEASE_STATE_CONSUMED", "LEASE_STATE_UNKNOWN",
                   LEASE_NOT_YET_MADE, Reason.LEASE_EXPIRED, Reason.LEASE_TOKEN_MISMATCH, Reason.INVALID_ARGUMENT):
        assert not heartbeat_is_transient(answer), answer
