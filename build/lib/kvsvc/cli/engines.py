"""`kvsvc engines --etcd ENDPOINTS`: the engines registered in etcd and their servers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from kvsvc.discovery.etcd import EtcdClient
from kvsvc.discovery.registry import DEFAULT_PREFIX, ServerRecord, list_engines, resolve, watch_servers


def _line(rec: ServerRecord) -> str:
    return (f"  {rec.address}  {rec.role}  ranks {','.join(map(str, rec.ranks))}/{rec.tp_size}  "
            f"epoch {rec.epoch}  layout {rec.layout_hash[:12] or '-'}")


async def _list(client: EtcdClient, engine_id: str, prefix: str, as_json: bool) -> int:
    engines = {engine_id: await resolve(client, engine_id, prefix)} if engine_id else await list_engines(client, prefix)
    if as_json:
        print(json.dumps({e: [asdict(r) for r in rs] for e, rs in engines.items()}, indent=2))
        return 0
    if not any(engines.values()):
        print(f"no kvsvc server registered{' for engine ' + engine_id if engine_id else ''} under {prefix}")
        return 0 if not engine_id else 1
    for e, rs in engines.items():
        print(f"{e}: {len(rs)} server{'s' if len(rs) != 1 else ''}")
        for r in rs:
            print(_line(r))
    return 0


async def _watch(client: EtcdClient, engine_id: str, prefix: str, as_json: bool) -> int:
    async for change in watch_servers(client, engine_id, prefix):
        if as_json:
            print(json.dumps({"key": change.key, "record": asdict(change.record) if change.record else None}),
                  flush=True)
        elif change.record is None:
            print(f"gone {change.key}", flush=True)
        else:
            print(f"up   {change.record.engine_id}{_line(change.record)}", flush=True)
    return 0


def run_engines(endpoints: str, engine_id: str = "", prefix: str = DEFAULT_PREFIX, as_json: bool = False,
                watch: bool = False) -> int:
    client = EtcdClient(endpoints)
    return asyncio.run((_watch if watch else _list)(client, engine_id, prefix or DEFAULT_PREFIX, as_json))
