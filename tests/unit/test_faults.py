"""The fault injection switch (service/faults.py): off unless KVSVC_FAULTS names points; a
cycle gives the n-th transfer (D) or lease (P) its fault; a misspelt point is refused."""

from __future__ import annotations

import pytest

from kvsvc.service.faults import Faults


def test_off_unless_the_environment_names_points():
    assert Faults.from_environment({}) is None
    assert Faults.from_environment({"KVSVC_FAULTS": " "}) is None


def test_the_cycle_gives_each_transfer_and_lease_its_fault_in_turn():
    f = Faults.from_environment({"KVSVC_FAULTS": "read_error,-,lease_released"})
    assert f is not None
    assert [f.next_transfer() for _ in range(6)] == ["read_error", None, None, "read_error", None, None]
    assert [f.next_lease() for _ in range(4)] == [None, None, "lease_released", None]
    seen: list[str] = []
    f.on_inject = seen.append
    f.injected_now("read_error")
    assert f.injected["read_error"] == 1 and seen == ["read_error"]


@pytest.mark.parametrize("spec", ["read_eror", "read_error,,-", ",".join(["-"] * 1025)])
def test_a_misspelt_or_empty_point_is_refused(spec):
    with pytest.raises(ValueError, match="KVSVC_FAULTS"):
        Faults.from_environment({"KVSVC_FAULTS": spec})
