"""Discovery on a real etcd: real servers register, resolve, leave on shutdown, expire when
killed, come back with a new epoch; bad records and bad settings are refused clearly."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.cli.procs import ServerProcess, start_engine, start_server
from kvsvc.client import AsyncClient
from kvsvc.config import load_config
from kvsvc.discovery import EtcdClient, ServerRecord, list_engines, resolve, watch_servers
from kvsvc.errors import InvalidArgument, Unavailable
from tests.e2e.harness import layout_table

LAYOUT = layout_table(k=4)
TTL_S = 2
_prefixes = itertools.count()


def config(tmp_path: Path, etcd: str, prefix: str) -> str:
    path = tmp_path / f"etcd{next(_prefixes)}.toml"
    path.write_text(f'[server]\netcd_endpoints = ["{etcd}"]\netcd_prefix = "{prefix}"\netcd_ttl_s = {TTL_S}\n')
    return str(path)


def unique_prefix() -> str:
    return f"/kvsvc-test/{next(_prefixes)}"


async def wait_until(check, timeout_s: float = 10.0):
    end = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_a_server_registers_and_leaves_on_shutdown(etcd, tmp_path):
    prefix = unique_prefix()
    sp = start_server(engine_id="reg-p", role="prefill", tp_size=2, layout=LAYOUT, memory="none",
                      config_file=config(tmp_path, etcd, prefix))
    client = EtcdClient(etcd)
    try:
        async with AsyncClient(sp.address) as c:
            info = await c.get_info()
        [rec] = await resolve(client, "reg-p", prefix)
        assert (rec.engine_id, rec.role, rec.tp_size, rec.ranks, rec.address) == ("reg-p", "prefill", 2, [0, 1],
                                                                                 sp.address)
        assert (rec.epoch, rec.layout_hash) == (info.epoch, info.layout_hash)
        out = subprocess.run([sys.executable, "-m", "kvsvc.cli.main", "engines", "--etcd", etcd, "--etcd-prefix",
                              prefix], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "reg-p: 1 server" in out.stdout and sp.address in out.stdout, out
    finally:
        assert sp.stop() == 0
    assert await resolve(client, "reg-p", prefix) == []  # revoked at shutdown, not left to expire


async def test_an_engine_over_two_servers_a_killed_one_expires_and_returns_with_a_new_epoch(etcd, tmp_path):
    prefix = unique_prefix()
    cfg = config(tmp_path, etcd, prefix)
    procs = start_engine(engine_id="reg-d", role="decode", tp_size=4, layout=LAYOUT, servers=2, memory="none",
                         config_file=cfg)
    client = EtcdClient(etcd)
    changes: asyncio.Queue = asyncio.Queue()

    async def follow():
        async for change in watch_servers(client, "reg-d", prefix):
            await changes.put(change)

    watcher = asyncio.ensure_future(follow())
    restarted: ServerProcess | None = None
    try:
        recs = await resolve(client, "reg-d", prefix)
        assert [r.ranks for r in recs] == [[0, 1], [2, 3]]
        assert {r.address for r in recs} == {sp.address for sp in procs}
        seen = {(await asyncio.wait_for(changes.get(), 10)).record.address for _ in range(2)}
        assert seen == {sp.address for sp in procs}  # the watch starts with the servers there now

        victim = next(sp for sp in procs if sp.address == recs[1].address)
        old_epoch = recs[1].epoch
        victim.kill()  # no shutdown: the key goes when its etcd lease runs out
        gone = await asyncio.wait_for(changes.get(), TTL_S + 10)
        assert gone.record is None and gone.key.endswith(victim.address)
        assert [r.address for r in await resolve(client, "reg-d", prefix)] == [recs[0].address]

        restarted = start_server(engine_id="reg-d", role="decode", tp_size=4, layout=LAYOUT, ranks=[2, 3],
                                 listen=victim.address, memory="none", config_file=cfg)
        back = await asyncio.wait_for(changes.get(), 10)
        assert back.record is not None and back.record.address == victim.address
        assert back.record.epoch != old_epoch and back.record.ranks == [2, 3]
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        for sp in [*procs, *([restarted] if restarted else [])]:
            sp.stop()


async def test_a_lease_lost_behind_the_servers_back_is_registered_again(etcd, tmp_path):
    """etcd forgot the lease (etcd restarted empty, or the server was cut off past the TTL):
    the keepalive notices and the server registers again."""
    prefix = unique_prefix()
    sp = start_server(engine_id="reg-again", role="prefill", tp_size=1, layout=LAYOUT, memory="none",
                      config_file=config(tmp_path, etcd, prefix))
    client = EtcdClient(etcd)
    try:
        _, [kv] = await client.get_prefix(prefix)
        assert kv.lease
        await client.revoke(kv.lease)
        assert (await client.get_prefix(prefix))[1] == []
        async def registered():
            return (await client.get_prefix(prefix))[1]

        kvs = await wait_until(registered, TTL_S + 10)
        assert kvs[0].lease != kv.lease and ServerRecord.from_json(kvs[0].value).address == sp.address
    finally:
        assert sp.stop() == 0


async def test_records_that_do_not_parse_are_skipped_not_fatal(etcd):
    prefix = unique_prefix()
    client = EtcdClient(etcd)
    good = ServerRecord(engine_id="mix", role="prefill", tp_size=2, ranks=[0, 1], address="10.0.0.1:5000", epoch=7)
    await client.put(f"{prefix}/engines/mix/servers/10.0.0.1:5000", good.to_json())
    await client.put(f"{prefix}/engines/mix/servers/garbage", b"{not json")
    await client.put(f"{prefix}/engines/mix/servers/bad-ranks",
                     ServerRecord(engine_id="mix", role="prefill", tp_size=2, ranks=[5], address="x:1",
                                  epoch=1).to_json())
    await client.put(f"{prefix}/engines/mix/servers/huge", b"x" * 100_000)
    assert await resolve(client, "mix", prefix) == [good]
    assert await list_engines(client, prefix) == {"mix": [good]}


async def test_an_unreachable_etcd_fails_the_start_with_a_clear_error(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\netcd_endpoints = ["http://127.0.0.1:1"]\n')
    out = subprocess.run([sys.executable, "-m", "kvsvc.cli.main", "serve", "--listen", "127.0.0.1:0", "--engine-id",
                          "e", "--role", "prefill", "--tp-size", "1", "--memory", "none", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "ETCD_UNAVAILABLE" in out.stderr and "Traceback" not in out.stderr, out.stderr
    with pytest.raises(Unavailable) as e:
        await EtcdClient("127.0.0.1:1", timeout_s=2).grant(5)
    assert e.value.reason == "ETCD_UNAVAILABLE"


@pytest.mark.parametrize("settings, reason", [
    ({"etcd_endpoints": ("ftp://h:1",)}, "ETCD_ENDPOINTS_INVALID"),
    ({"etcd_endpoints": ("http://h:1/path",)}, "ETCD_ENDPOINTS_INVALID"),
    ({"etcd_endpoints": ("h:1",), "etcd_ttl_s": 1}, "ETCD_TTL_INVALID"),
    ({"etcd_endpoints": ("h:1",), "engine_id": "a/b"}, "INVALID_ENGINE_ID"),
])
def test_bad_etcd_settings_are_refused_at_load(settings, reason):
    with pytest.raises(InvalidArgument) as e:
        load_config(tp_size=1, **settings)
    assert e.value.reason == reason
