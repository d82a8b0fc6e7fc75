"""Discovery across hosts: etcd on its own host, P and D on two others register there and
are found from a fourth place (this test, on the bridge, as a router would be). With
etcd's host cut off, a transfer whose params are in hand still works; once etcd is back,
the servers' records return (their etcd leases ran out meanwhile) and resolve again."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.discovery import EtcdClient, resolve
from tests.e2e.harness import layout_table, session, transfer_and_check
from tests.hosts.harness import Host, hosts

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make etcd)")

PREFIX = "/kvsvc-hosts"
TTL_S = 2


def start_etcd(host: Host) -> tuple[subprocess.Popen[str], str]:
    url = f"http://{host.address}:2379"
    proc = host.popen(["etcd", "--name", "hosts", "--data-dir", f"{host.tmp}/etcd", "--listen-client-urls", url,
                       "--advertise-client-urls", url, "--listen-peer-urls", f"http://{host.address}:2380",
                       "--initial-advertise-peer-urls", f"http://{host.address}:2380",
                       "--initial-cluster", f"hosts=http://{host.address}:2380"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, url


async def _records(etcd: str, engine_id: str) -> list:
    try:
        return await resolve(EtcdClient(etcd, timeout_s=2), engine_id, PREFIX)
    except Exception:
        return []


async def _until(check, timeout_s: float = 30.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.2)
    return None


async def test_etcd_on_its_own_host_and_transfers_that_outlive_its_loss():
    layout = layout_table(k=4)
    with hosts(3) as (e, a, b):
        etcd_proc, etcd = start_etcd(e)
        settings = f'[server]\netcd_endpoints = ["{etcd}"]\netcd_prefix = "{PREFIX}"\netcd_ttl_s = {TTL_S}\n'
        assert await _until(lambda: _healthy(etcd)), "etcd did not start"
        p = start_server(engine_id="hosts-p", role="prefill", tp_size=1, layout=layout, listen=f"{a.address}:0",
                         launcher=a.launcher, config_file=a.write(f"{a.tmp}/kvsvc.toml", settings))
        d = None
        try:
            d = start_server(engine_id="hosts-d", role="decode", tp_size=1, layout=layout, listen=f"{b.address}:0",
                             launcher=b.launcher, config_file=b.write(f"{b.tmp}/kvsvc.toml", settings))
            [rec] = await _until(lambda: _records(etcd, "hosts-p"))
            assert rec.address == p.address and rec.address.startswith(a.address + ":")
            async with session(p, d, shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                await transfer_and_check(s, "found", [[1, 2]], [[3, 4]])
                s.pe.fill([[5, 6]])
                pub = await s.pc.publish_blocks("in-hand", [[5, 6]])
                e.link(False)  # etcd's host cut off: P and D lose discovery, not each other
                try:
                    await s.dc.transfer("d-in-hand", pub.params, [[7, 8]], timeout_s=30)
                    assert not s.de.check([[7, 8]])
                    await asyncio.sleep(2 * TTL_S + 1)  # their etcd leases run out meanwhile
                finally:
                    e.link(True)
                # Back: each server finds its record gone and registers again.
                [again] = await _until(lambda: _records(etcd, "hosts-p"), 60) or [None]
                assert again is not None and again.address == p.address, "P registered again"
                assert await _until(lambda: _records(etcd, "hosts-d"), 60), "D registered again"
        finally:
            if d is not None:
                assert d.stop() == 0
            assert p.stop() == 0
            etcd_proc.terminate()
            etcd_proc.wait(10)


async def _healthy(etcd: str) -> bool:
    import urllib.request

    def get() -> bool:
        try:
            with urllib.request.urlopen(f"{etcd}/health", timeout=2) as r:
                return b"true" in r.read()
        except OSError:
            return False
    return await asyncio.to_thread(get)
