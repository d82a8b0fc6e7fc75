"""UCX settings for GPU memory: kvsvc allows cuda_ipc READs, and keeps an operator's choice."""

from __future__ import annotations

import os

import pytest

from kvsvc.transport.ucx_cuda import CUDA_IPC_GET, allow_cuda_ipc_reads


def test_cuda_ipc_reads_are_allowed_when_nobody_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDA_IPC_GET, raising=False)
    allow_cuda_ipc_reads()
    assert os.environ[CUDA_IPC_GET] == "y"


def test_an_operators_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_IPC_GET, "n")
    allow_cuda_ipc_reads()
    assert os.environ[CUDA_IPC_GET] == "n"
