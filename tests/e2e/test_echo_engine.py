"""The echo engine (tests/e2e/echo_engine.py), a third engine integrated in one file over
the engine-neutral layer: D ends up with the KV its own prefill would have computed, in the
blocks it chose, and P gets its blocks back once, when kvsvc says D is done."""

from __future__ import annotations

import numpy as np

from kvsvc.config import Role
from tests.e2e.echo_engine import BLOCKS, LAYERS, EchoEngine, token_kv

TOKEN = "0e" * 16


def test_a_third_engine_in_one_file_moves_its_kv_and_gets_its_blocks_back_once():
    p = EchoEngine(Role.PREFILL, "echo-p", TOKEN)
    try:
        d = EchoEngine(Role.DECODE, "echo-d", TOKEN)
        try:
            d._take(3)  # D's first free blocks differ from P's: the bytes must land where D says
            tokens = [17, 4, 99, 23, 5, 61, 8, 42, 11, 7]
            params = p.prefill("echo-1", tokens)
            with p.freed:  # held until D is done with them (then released on P's loop thread)
                assert p.held["echo-1"] == [0, 1, 2]
            blocks = d.load("d-echo-1", params, len(tokens))
            assert blocks == [3, 4, 5]
            for layer in range(LAYERS):
                assert np.array_equal(d.read(blocks, len(tokens), layer), token_kv(tokens, layer))
                assert not d.kv[layer][6:].any() and not d.kv[layer][:3].any()  # nothing else written
            with p.freed:
                assert p.freed.wait_for(lambda: "echo-1" not in p.held, 30)
            assert sorted(p.free) == list(range(BLOCKS))  # back once: no block twice
        finally:
            d.stop()
    finally:
        p.stop()
