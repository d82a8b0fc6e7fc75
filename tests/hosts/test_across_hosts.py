"""kvsvc where P and D do not share a machine: servers on simulated hosts (tests/hosts/harness.py).

Each host has its own network address, /dev/shm, temp dir and hostname, so nothing of the
same-host paths exists between P and D: UCX must move the bytes over the network, the lease
calls cannot use P's Unix socket (its path is in another host's temp dir) and go over gRPC, and the
engine fills and checks its pools through the host's own /dev/shm. Byte for byte, with
every lease released CONSUMED and none left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.client import AsyncClient
from kvsvc.v1 import kv_transfer_pb2 as pb
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
            info = await s.dc.get_info()
            reads = [t for t in info.transport.ucx_transports if t.startswith("rma_get:")]
        assert reads, "GetInfo names the transport of D's READs"
        # Each host is a node of its own (hostname and boot id), as UCX sees it too: READs over the
        # link are no downgrade when RDMA is not asked for.
        [peer] = info.transport.peers
        assert (peer.address, peer.locality, peer.warning_reason) == (p.address, "inter-node", ""), peer
        assert {t.split("/")[0] for t in peer.read_transports} == {t.split(":")[1].split("/")[0] for t in reads}
        assert not [t for t in reads if t.split(":")[1].split("/")[0] in SAME_HOST_TRANSPORTS], reads
        if env.get("UCX_TLS") == "tcp":
            assert all(t.startswith("rma_get:tcp/") for t in reads), reads
        # P's lease socket lies in P's /tmp: D could not use it and called over gRPC.
        assert any("lease calls go over gRPC" in line for line in d.output), "".join(d.output[-40:])


async def test_a_lease_streamed_between_two_hosts_over_tcp_is_exact():
    """A growing lease read chunk by chunk over TCP, where P's process moves the bytes of each
    READ as it progresses UCX -- which it does only while D may be reading: D asks for the
    next commit once its READs ended (reads_done), and P then sleeps until it hands more."""
    import asyncio

    from tests.e2e.test_progressive import LAYOUT, claimed_on_p, committing, landed_on_d, opening

    with hosts(2) as (a, b), across(a, b, 1, 1, LAYOUT, {"UCX_TLS": "tcp"}) as (p, d):
        async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
            p_ids, d_ids = [1, 2, 5, 6, 9], [11, 12, 13, 14, 15]
            s.pe.fill([p_ids])
            params = (await s.pc.publish_blocks_request(opening("stream", [1, 2]))).params
            moving = asyncio.ensure_future(s.dc.transfer("d-stream", params, [d_ids], timeout_s=60))
            await claimed_on_p(s, "stream")
            await landed_on_d(s, d_ids[:2])  # the first chunk, while P "prefills" the next
            await s.pc.commit_blocks(committing(params, 2, [5, 6], 16))
            await landed_on_d(s, d_ids[:4])
            await s.pc.commit_blocks(committing(params, 3, [9], 18, final=True))
            resp = await asyncio.wait_for(moving, 60)
            assert not s.de.check([d_ids], num_tokens=18)
            assert (resp.chunks_read_growing, resp.chunks_read_final) == (2, 1)
            (ev,) = await s.watch.wait_for("stream")
            assert ev.reason == pb.RELEASE_REASON_CONSUMED
            assert (await s.pc.get_info()).live_leases == 0


async def test_p_unplugged_during_a_transfer_fails_it_in_time_and_the_next_one_succeeds():
    """P's host loses its link while D reads (the cable of P's host pulled): D's transfer
    ends with a typed error by its deadline; the engine reuses its blocks only once D says
    the transfer settled -- which, for a READ the link cut off, is when UCX ends it after
    the link is back (its reply may still land: then, not later); P's lease is not left
    held for ever (its TTL frees it: D's abort cannot reach P); once the link is back the
    same engines serve the next request, with the right bytes in the reused blocks."""
    import asyncio
    import time

    from kvsvc.errors import KvsvcError

    layout = layout_table(k=4) | {"num_blocks": 64, "block_size": 1024}  # 64 MiB a side: reads take a while
    with hosts(2) as (a, b):
        config = a.write(f"{a.tmp}/p.toml", "[server]\nlease_ttl_s = 3\n")
        p = start_server(engine_id="hosts-p", role="prefill", tp_size=1, layout=layout, listen=f"{a.address}:0",
                         extra_env={"UCX_TLS": "tcp"}, global_args=["-v"], launcher=a.launcher,
                         config_file=config)
        try:
            d = start_server(engine_id="hosts-d", role="decode", tp_size=1, layout=layout,
                             listen=f"{b.address}:0", extra_env={"UCX_TLS": "tcp"}, global_args=["-v"],
                             launcher=b.launcher)
            try:
                async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                    await transfer_and_check(s, "warm", [[1]], [[2]])  # handshake and wire-up done
                    ids = list(range(64))
                    s.pe.fill([ids])
                    pub = await s.pc.publish_blocks("cut", [ids])
                    call = asyncio.ensure_future(s.dc.transfer("d-cut", pub.params, [ids], timeout_s=8))
                    await asyncio.sleep(0.02)
                    a.link(False)
                    t0 = time.monotonic()
                    try:
                        with pytest.raises(KvsvcError) as e:
                            await call
                        assert e.value.code.name in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "INTERNAL"), e.value
                        assert time.monotonic() - t0 < 8 + 5, "answered by the transfer's deadline"
                    finally:
                        a.link(True)
                    # As an engine must before it reuses the blocks (the "after" transfer writes 5 and 6).
                    await asyncio.wait_for(s.dc.settled("d-cut", e.value), 120)
                    # P's lease: freed by its TTL at the latest (D's abort may not have reached it).
                    deadline = time.monotonic() + 15
                    while (await s.pc.get_info()).live_leases and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)
                    assert (await s.pc.get_info()).live_leases == 0
                # New clients of this test (the old ones' TCP connections may still be backing
                # off from the outage); the servers themselves are the same. D's own channel to
                # P may still be waiting out its reconnect backoff (at most 5 s, ClientOptions.
                # max_reconnect_backoff_ms): a request that meets it fails PEER_UNAVAILABLE,
                # typed (an engine recomputes it), and a later one is served.
                async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                    s.pe.fill([[3, 4]])
                    served_at, give_up = None, time.monotonic() + 30
                    for attempt in range(1000):
                        pub = await s.pc.publish_blocks(f"after-{attempt}", [[3, 4]])
                        try:
                            await s.dc.transfer(f"d-after-{attempt}", pub.params, [[5, 6]], timeout_s=60)
                        except KvsvcError as err:
                            assert err.reason == "PEER_UNAVAILABLE", err
                            assert time.monotonic() < give_up, "D never reached P again"
                            await asyncio.sleep(0.5)  # an engine's next request, not a wait for an event
                            continue
                        served_at = attempt
                        break
                    assert served_at is not None and not s.de.check([[5, 6]])
                    print(f"served again at request {served_at + 1} after the link came back")
                    deadline = time.monotonic() + 15  # the refused attempts' leases: their TTL frees them
                    while (await s.pc.get_info()).live_leases and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)
                    assert (await s.pc.get_info()).live_leases == 0
            finally:
                d.stop()
        finally:
            p.stop()


async def test_a_p_engine_over_two_hosts_feeds_a_d_on_a_third():
    """Multi-node TP: P's ranks 0 and 1 are servers on hosts a and b (a lists b as its
    sibling, so one publish leases on both), D (TP 1) on host c reads from both."""
    from kvsvc.client import AsyncClient
    from tests.e2e.harness import Engine, ReleaseWatch, assert_consumed_everywhere

    layout = layout_table(k=4)
    with hosts(3) as (a, b, c):
        common = {"engine_id": "hosts-p", "role": "prefill", "tp_size": 2, "layout": layout, "global_args": ["-v"]}
        p1 = start_server(ranks=[1], listen=f"{b.address}:0", launcher=b.launcher, **common)
        p0 = d = None
        try:
            p0 = start_server(ranks=[0], listen=f"{a.address}:0", launcher=a.launcher, siblings=[p1.address], **common)
            d = start_server(engine_id="hosts-d", role="decode", tp_size=1, layout=layout,
                             listen=f"{c.address}:0", global_args=["-v"], launcher=c.launcher)
            async with AsyncClient(p0.address) as c0, AsyncClient(p1.address) as c1, AsyncClient(d.address) as dc:
                pes = [await Engine.of(c0, a.shm_dir), await Engine.of(c1, b.shm_dir)]
                de = await Engine.of(dc, c.shm_dir)
                p_ids, d_ids = [[5, 9, 2, 11]], [[0, 3, 4, 7]]
                for e in pes:
                    e.fill(p_ids)
                watches = [await ReleaseWatch.open(x) for x in (c0, c1)]
                try:
                    pub = await c0.publish_blocks("mn", p_ids)
                    assert [s.address for s in pub.params.remote_servers] == [p0.address, p1.address]
                    await dc.transfer("d-mn", pub.params, d_ids, timeout_s=60)
                    assert not de.check(d_ids), de.check(d_ids)
                    await assert_consumed_everywhere(watches, [c0, c1], "mn")
                finally:
                    for w in watches:
                        await w.close()
        finally:
            for sp in (d, p0, p1):
                if sp is not None:
                    sp.stop()


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _gauge(url: str, name: str) -> float:
    import re

    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", _metrics(url), re.M)
    assert m, f"{name} not in {url}"
    return float(m.group(1))


def _total(text: str, name: str, label: str = "") -> float:
    """The sum of a labelled counter's samples that carry `label` (0 where none was counted)."""
    import re

    return sum(float(v) for labels, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M) if label in labels)


async def test_p_host_rebooted_is_read_from_again_at_once_and_nothing_of_the_old_p_stays_in_d():
    """P's host power-cycled (everything on it killed, its /dev/shm gone, a new boot id) and
    P served again at the same address: D, untouched on its own host, makes its first
    successful transfer from the new P with no failed read on the way (no NIXL error, no
    failed transfer counted), and holds nothing of the
    old P -- its NIXL agents forgotten (kvsvc_nixl_remote_agents as before the reboot) and
    no TCP connection to P's host that the new P does not also have (none half-open to the
    old run)."""
    import asyncio
    import time

    layout = layout_table(k=4)
    with hosts(2) as (a, b):
        metrics = f"{b.address}:9400"
        d_config = b.write(f"{b.tmp}/d.toml", f'[server]\nmetrics_listen = "{metrics}"\n')
        p = start_server(engine_id="hosts-p", role="prefill", tp_size=1, layout=layout, listen=f"{a.address}:0",
                         global_args=["-v"], launcher=a.launcher)
        d = start_server(engine_id="hosts-d", role="decode", tp_size=1, layout=layout, listen=f"{b.address}:0",
                         global_args=["-v"], launcher=b.launcher, config_file=d_config)
        try:
            async with AsyncClient(d.address) as dc:
                async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                    await transfer_and_check(s, "before", [[1, 2]], [[3, 4]])
                agents = _gauge(f"http://{metrics}/metrics", "kvsvc_nixl_remote_agents")
                assert agents >= 1
                a.reboot()
                assert p.stop() != 0, "P died with its host"
                p = start_server(engine_id="hosts-p", role="prefill", tp_size=1, layout=layout, listen=p.address,
                                 global_args=["-v"], launcher=a.launcher)
                async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                    await transfer_and_check(s, "after", [[5, 6, 7]], [[8, 9, 10]])
                    # Its first read went to the new P: nothing of D's reached the old run and failed.
                    text = _metrics(f"http://{metrics}/metrics")
                    assert _total(text, "kvsvc_nixl_errors_total") == 0, text
                    assert _total(text, "kvsvc_transfers_total", 'outcome="failed"') == 0, text
                    assert _total(text, "kvsvc_transfers_total", 'outcome="ok"') == 2, text
                    peers = (await dc.list_leases()).peers
                    assert [(x.address, x.epoch) for x in peers] == [(p.address, (await s.pc.get_info()).epoch)]
                # Nothing of the old P: its agents forgotten, no connection to it left.
                deadline = time.monotonic() + 10
                while _gauge(f"http://{metrics}/metrics", "kvsvc_nixl_remote_agents") != agents and \
                        time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert _gauge(f"http://{metrics}/metrics", "kvsvc_nixl_remote_agents") == agents
                deadline = time.monotonic() + 10
                while True:
                    on_p = a.connections()
                    to_p = {(mine, theirs) for mine, theirs in b.connections(d.proc.pid)
                            if theirs.startswith(a.address + ":")}
                    stale = {(mine, theirs) for mine, theirs in to_p if (theirs, mine) not in on_p}
                    if not stale or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                assert to_p, "D's connections to P are seen"
                assert not stale, f"D keeps connections to the old P: {stale}"
        finally:
            d.stop()
            p.stop()


async def test_dcp_sharded_mla_across_hosts():
    """P (TP 2, DCP 2: each rank keeps every other block) on one host, D (TP 1, no DCP) on
    another: D gathers the request's blocks from both of P's ranks over the network."""
    from tests.e2e.test_dcp import TOKENS, layout, positions

    with hosts(2) as (a, b):
        p = start_server(engine_id="hosts-p", role="prefill", tp_size=2, layout=layout(2), listen=f"{a.address}:0",
                         global_args=["-v"], launcher=a.launcher)
        try:
            d = start_server(engine_id="hosts-d", role="decode", tp_size=1, layout=layout(1),
                             listen=f"{b.address}:0", global_args=["-v"], launcher=b.launcher)
            try:
                async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                    p_ids = [[31 - i for i in range(positions(2))]]
                    d_ids = [[2 * i + 1 for i in range(positions(1))]]
                    s.pe.fill(p_ids)
                    pub = await s.pc.publish_blocks("dcp", p_ids, num_tokens=TOKENS)
                    await s.dc.transfer("d-dcp", pub.params, d_ids, timeout_s=60)
                    assert not s.de.check(d_ids, [0], num_tokens=TOKENS), s.de.check(d_ids, [0], num_tokens=TOKENS)
                    events = await s.watch.wait_for("dcp")
                    assert [e.reason for e in events] == [pb.RELEASE_REASON_CONSUMED], events
            finally:
                assert d.stop() == 0
        finally:
            assert p.stop() == 0
