"""kvsvc where P and D do not share a machine: servers on simulated hosts (tests/hosts/harness.py).

Each host has its own network address, /dev/shm, /tmp and hostname, so nothing of the
same-host paths exists between P and D: UCX must move the bytes over the network, the lease
calls cannot use P's Unix socket (its path is in another /tmp) and go over gRPC, and the
engine fills and checks its pools through the host's own /dev/shm. Byte for byte, with
every lease released CONSUMED and none left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvsvc.cli.procs import ServerProcess, start_server
from tests.e2e.harness import layout_table, session, transfer_and_check
from tests.hosts.harness import Host, hosts

SAME_HOST_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem", "self")


@contextlib.contextmanager
def across(p_host: Host, d_host: Host, p_tp: int, d_tp: int, layout: dict, env: dict[str, str]
           ) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    p = start_server(engine_id="hosts-p", role="prefill", tp_size=p_tp, layout=layout, listen=f"{p_host.address}:0",
                     extra_env=env, global_args=["-v"], launcher=p_host.launcher)
    try:
        d = start_server(engine_id="hosts-d", role="decode", tp_size=d_tp, layout=layout,
                         listen=f"{d_host.address}:0", extra_env=env, global_args=["-v"], launcher=d_host.launcher)
    except BaseException:
        p.stop()
        raise
    try:
        yield p, d
    finally:
        d.stop()
        p.stop()


CASES = [
    pytest.param(2, 1, layout_table(k=4), {"UCX_TLS": "tcp"}, id="p2-d1-tcp"),
    pytest.param(1, 2, layout_table(k=4), {}, id="p1-d2-ucx-default"),
    pytest.param(2, 1, layout_table(mla=True, head=8), {}, id="mla-p2-d1"),
]


@pytest.mark.parametrize(("p_tp", "d_tp", "layout", "env"), CASES)
async def test_a_transfer_between_two_hosts_is_exact(p_tp, d_tp, layout, env):
    with hosts(2) as (a, b), across(a, b, p_tp, d_tp, layout, env) as (p, d):
        assert p.address.startswith(a.address + ":") and d.address.startswith(b.address + ":")
        async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
            await transfer_and_check(s, "x-1", [[5, 9, 2, 11]], [[0, 3, 4, 7]])
            await transfer_and_check(s, "x-2", [[1, 2, 3]], [[10, 11, 12]])
            reads = [t for t in (await s.dc.get_info()).transport.ucx_transports if t.startswith("rma_get:")]
        assert reads, "GetInfo names the transport of D's READs"
        assert not [t for t in reads if t.split(":")[1].split("/")[0] in SAME_HOST_TRANSPORTS], reads
        if env.get("UCX_TLS") == "tcp":
            assert all(t.startswith("rma_get:tcp/") for t in reads), reads
        # P's lease socket lies in P's /tmp: D could not use it and called over gRPC.
        assert any("lease calls go over gRPC" in line for line in d.output), "".join(d.output[-40:])
