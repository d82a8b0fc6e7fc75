"""D's clock of P's lease (service/legs.py, LeaseClock): what D may take as proof that P
still holds a claim is counted from when the call was sent, never from when its answer
was read -- an answer read late (a slow link, D's loop stalled) proves no more time."""

from __future__ import annotations

import time

from kvsvc.service.legs import HELD_MARGIN_S, LeaseClock


def test_held_until_counts_from_the_call_not_from_its_answer():
    sent = time.monotonic() - 2.0  # the answer is read two seconds after the call went out
    clock = LeaseClock(3000, sent)
    assert abs(clock.held_until - (sent + 3.0 - HELD_MARGIN_S)) < 1e-9
    assert clock.deadline > clock.held_until + 1.9  # the pacing deadline counts from the answer
    assert clock.holds


def test_an_answer_older_than_its_lease_proves_nothing():
    clock = LeaseClock(1000, time.monotonic() - 1.5)
    assert not clock.holds and not clock.expired  # P may still hold it; D cannot prove it


def test_a_renewal_never_moves_the_proof_back_and_one_without_a_send_time_proves_nothing():
    now = time.monotonic()
    clock = LeaseClock(5000, now)
    first = clock.held_until
    clock.renew(1000, now)  # an answer with less time left (sent at the same moment) moves nothing back
    assert clock.held_until == first
    clock.renew(10_000, now + 0.5)
    assert clock.held_until == now + 0.5 + 10.0 - HELD_MARGIN_S
    bare = LeaseClock(60_000)  # sent time unknown (an older caller): paced, but no proof
    assert not bare.holds and not bare.expired
