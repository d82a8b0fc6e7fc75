"""The start-up check of require_rdma_between_nodes (kvsvc/transport/rdma_check.py), against
a sysfs directory of the test's making and UCX_TLS values. A real server that requires RDMA
where there is none: tests/e2e/test_transport_honesty.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.transport.rdma_check import check_rdma


def sysfs(tmp_path: Path, *devices: str) -> Path:
    root = tmp_path / "infiniband"
    root.mkdir()
    for d in devices:
        (root / d).mkdir()
    return root


def test_nothing_is_said_unless_rdma_is_required(tmp_path):
    got = check_rdma(False, {}, sysfs(tmp_path))
    assert got.devices == () and got.unavailable_reason == ""


def test_no_rdma_device_is_reported_when_rdma_is_required(tmp_path):
    got = check_rdma(True, {}, sysfs(tmp_path))
    assert "no RDMA device" in got.unavailable_reason
    assert "no RDMA device" in check_rdma(True, {}, tmp_path / "absent").unavailable_reason


@pytest.mark.parametrize(("tls", "usable"), [
    ("", True), ("rc,sm,self", True), ("dc_x,cuda_ipc", True), ("ib", True), ("all", True), ("^tcp", True),
    ("tcp", False), ("tcp,sm,self,cuda_ipc", False), ("^ib", False), ("^rc,dc,ud", False),
])
def test_ucx_tls_without_an_rdma_transport_is_reported(tmp_path, tls, usable):
    got = check_rdma(True, {"UCX_TLS": tls} if tls else {}, sysfs(tmp_path, "mlx5_0", "mlx5_1"))
    assert got.devices == ("mlx5_0", "mlx5_1")
    assert (got.unavailable_reason == "") is usable, got.unavailable_reason
    if not usable:
        assert f"UCX_TLS={tls}" in got.unavailable_reason
