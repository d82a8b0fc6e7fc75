"""EmbeddedServer without an engine: the server a vLLM or SGLang worker embeds, driven in both
roles from plain threads, over plain arrays, with real NIXL.

What an engine relies on: P leases blocks and the params name its server; D's transfer
moves exactly those bytes, and its future ends only once nothing of it can write; P hears
each release once (consumed, or aborted when D gives up); a cancel before the transfer
starts runs nothing; a withdraw frees an unclaimed lease without a release event.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest

from kvsvc.config import Role, load_config
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.embedded import EmbeddedServer
from kvsvc.layout import layout_from_dict
from kvsvc.layout.regions import build_pool_layout
from kvsvc.leases.table import LeaseState

TABLE = {"model_id": "embedded", "total_num_kv_heads": 2, "block_size": 4, "num_blocks": 16, "dtype": "float16",
         "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 8}]}
TOKEN = "e" * 32


def buffers(seed: int | None) -> list[np.ndarray]:
    """One rank's regions as the engine's own arrays: random (P) or zero (D)."""
    regions = build_pool_layout(layout_from_dict(TABLE, tp_size=1)).regions
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (r.num_blocks, r.block_len), dtype=np.uint8) if seed is not None
            else np.zeros((r.num_blocks, r.block_len), np.uint8) for r in regions]


class Releases:
    def __init__(self) -> None:
        self.heard: list[tuple[str, LeaseState]] = []
        self.event = threading.Event()

    def __call__(self, rid: str, how: LeaseState) -> None:
        self.heard.append((rid, how))
        self.event.set()


@pytest.fixture
def pair():
    releases = Releases()
    p_bufs, d_bufs = buffers(3), buffers(None)
    servers = []
    for role, bufs in ((Role.PREFILL, p_bufs), (Role.DECODE, d_bufs)):
        config = load_config(listen="127.0.0.1:0", engine_id=f"embedded-{role.value}", role=role, tp_size=1,
                             ranks=[0], layout_table=TABLE)
        servers.append(EmbeddedServer(config, CacheDescription(config.layout(), bufs), advertise_host="127.0.0.1",
                                      on_release=releases if role is Role.PREFILL else None))
    p, d = servers
    p.start()
    try:
        d.start()
        try:
            yield p, d, p_bufs, d_bufs, releases
        finally:
            d.stop()
    finally:
        p.stop()


def test_both_roles_move_the_right_bytes_and_p_hears_each_release_once(pair):
    p, d, p_bufs, d_bufs, releases = pair
    params = p.lease("e-1", [[2, 5, 7]], TOKEN)
    assert [s.address for s in params.remote_servers] == [p.address] and params.remote_epoch == p.epoch
    resp = d.transfer("d-e-1", params, [[1, 8, 9]], 30).result(30)
    assert resp.total_bytes == sum(3 * b.shape[1] for b in p_bufs)
    for pb_, db in zip(p_bufs, d_bufs, strict=True):
        assert np.array_equal(db[[1, 8, 9]], pb_[[2, 5, 7]])
        assert not db[[0, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]].any()  # nothing else written
    assert releases.event.wait(10) and releases.heard == [("e-1", LeaseState.CONSUMED)]
    assert p.final_state("e-1") is LeaseState.CONSUMED

    # Taken back before anyone claimed it: gone, and no release event (its taker knows).
    p.lease("e-2", [[3]], TOKEN)
    assert p.withdraw("e-2", TOKEN) is True
    assert p.final_state("e-2") is LeaseState.ABORTED and releases.heard == [("e-1", LeaseState.CONSUMED)]


def test_a_transfer_cancelled_before_it_started_runs_nothing_and_p_keeps_its_lease(pair):
    p, d, _, d_bufs, releases = pair
    params = p.lease("e-3", [[4]], TOKEN)
    # The cancel reaches the loop before the transfer's task (both go in order to the loop).
    d.loop.loop.call_soon_threadsafe(d.cancel_here, "d-e-3")
    fut = d.transfer("d-e-3", params, [[6]], 30)
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(30)
    assert not d_bufs[0][6].any(), "nothing was read"
    # Unclaimed, so P still holds it for whoever claims; its engine takes it back.
    assert p.withdraw("e-3", TOKEN) is True and releases.heard == []


def test_the_roles_refuse_the_other_roles_calls(pair):
    p, d, _, _, _ = pair
    with pytest.raises(RuntimeError):
        d.lease("e-4", [[1]], TOKEN)
    with pytest.raises(RuntimeError):
        p.transfer("d-e-4", p.lease("e-4", [[1]], TOKEN), [[1]], 30).result(30)
