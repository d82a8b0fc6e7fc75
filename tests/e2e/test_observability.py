"""Observability of real servers: Prometheus metrics scraped over HTTP after real transfers and failures, and JSON log lines that name their request."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.client import AsyncClient
from kvsvc.errors import FailedPrecondition, PermissionDenied
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import layout_table

LAYOUT = layout_table(k=4)


def metrics_url(sp: ServerProcess) -> str:
    for line in sp.output:
        m = re.search(r"kvsvc metrics on (http://\S+/metrics)", line)
        if m:
            return m.group(1)
    raise AssertionError(f"no metrics address printed:\n{''.join(sp.output)}")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """sample name and sorted labels -> value, from the Prometheus text format."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, (key, sorted(k for k in samples if k[0] == name))
    return samples[key]


def start(engine: str, role: str, tmp_path) -> ServerProcess:
    cfg = tmp_path / f"{engine}.toml"
    cfg.write_text('[server]\nmetrics_listen = "127.0.0.1:0"\n')
    return start_server(engine_id=engine, role=role, tp_size=1, layout=LAYOUT, config_file=str(cfg))


async def test_metrics_after_transfers_and_failures(tmp_path):
    p, d = start("m-p", "prefill", tmp_path), start("m-d", "decode", tmp_path)
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            moved = 0
            for i in range(3):
                pub = await pc.publish_blocks(f"ok{i}", [[1 + i, 5 + i]])
                moved += (await dc.transfer(f"d-ok{i}", pub.params, [[10 + i, 20 + i]])).total_bytes
            short = await pc.publish_blocks("short", [[9]], lease_ttl_ms=200)
            await asyncio.sleep(0.6)
            with pytest.raises(FailedPrecondition):
                await dc.transfer("d-short", short.params, [[30]])
            await pc.publish_blocks("waiting", [[25]])

        ds = scrape(metrics_url(d))
        assert value(ds, "kvsvc_transfers_total", engine="m-d", peer_engine="m-p", outcome="ok", reason="") == 3
        assert value(ds, "kvsvc_transfers_total", engine="m-d", peer_engine="m-p", outcome="failed",
                     reason="LEASE_EXPIRED") == 1
        assert value(ds, "kvsvc_transfer_bytes_total", engine="m-d", peer_engine="m-p") == moved > 0
        assert value(ds, "kvsvc_transfer_seconds_count", engine="m-d", peer_engine="m-p") == 3
        assert value(ds, "kvsvc_transfer_wire_seconds_count", engine="m-d") == 3
        for phase in ("plan", "post", "reads", "confirm"):
            assert value(ds, "kvsvc_transfer_phase_seconds_count", engine="m-d", phase=phase) == 3
        # Each ok transfer ended in one lease message after its READs (claim_consumed), or --
        # a read that ran past EARLY_CLAIM_S -- a claim during the read and a confirm after it.
        calls = {c: value(ds, "kvsvc_lease_call_seconds_count", engine="m-d", call=c) if (
            "kvsvc_lease_call_seconds_count", (("call", c), ("engine", "m-d"))) in ds else 0
            for c in ("claim_consumed", "claim", "confirm")}
        assert calls["claim_consumed"] + calls["confirm"] == 3, calls
        assert calls["claim"] == calls["confirm"], calls
        assert value(ds, "kvsvc_handshakes_total", engine="m-d", peer_engine="m-p", outcome="ok") == 1
        assert value(ds, "kvsvc_peers", engine="m-d") == 1
        assert value(ds, "kvsvc_nixl_remote_agents", engine="m-d") >= 1  # P's rank, on D's agent and lanes
        assert value(ds, "kvsvc_running_transfers", engine="m-d") == 0

        ps = scrape(metrics_url(p))
        assert value(ps, "kvsvc_lease_releases_total", engine="m-p", reason="consumed") == 3
        assert value(ps, "kvsvc_lease_releases_total", engine="m-p", reason="expired") == 1
        assert value(ps, "kvsvc_live_leases", engine="m-p") == 1
        assert value(ps, "kvsvc_claimed_leases", engine="m-p") == 0
    finally:
        p.stop()
        d.stop()


def test_metrics_address_in_use_fails_at_start(tmp_path):
    d = start("m-busy", "decode", tmp_path)
    try:
        taken = metrics_url(d).removeprefix("http://").removesuffix("/metrics")
        cfg = tmp_path / "clash.toml"
        cfg.write_text(f'[server]\nmetrics_listen = "{taken}"\n')
        with pytest.raises(RuntimeError) as e:
            start_server(engine_id="m-clash", role="decode", tp_size=1, layout=LAYOUT, config_file=str(cfg))
        assert "ADDRESS_IN_USE" in str(e.value) and "Traceback" not in str(e.value)
    finally:
        d.stop()


async def test_json_logs_name_the_request(tmp_path):
    """--log-format json: one JSON object a line, each with the request it is about."""
    p = start_server(engine_id="log-p", role="prefill", tp_size=1, layout=LAYOUT, global_args=["-v", "--log-format",
                                                                                              "json"])
    d = start_server(engine_id="log-d", role="decode", tp_size=1, layout=LAYOUT)
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            pub = await pc.publish_blocks("p-logged", [[1]])
            await dc.transfer("d-logged", pub.params, [[2]])
            bad = await pc.publish_blocks("p-refused", [[3]])
            bad.params.lease_token = "wrong"
            with pytest.raises(PermissionDenied):
                await dc.transfer("d-refused", bad.params, [[4]])
    finally:
        assert p.stop() == 0
        d.stop()
    records = [json.loads(line) for line in p.output if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message", "request_id"} <= set(r) for r in records)
    released = [r for r in records if r["message"].startswith("released p-logged")]
    assert released and released[0]["request_id"] == "p-logged", records
    refused = [r for r in records if "LEASE_TOKEN_MISMATCH" in r["message"]]
    assert refused and refused[0]["request_id"] == "p-refused", records
    others = [line for line in p.output if not line.startswith("{") and line.strip()]
    assert not others, others  # the ready line too is a JSON record
    assert [r["address"] for r in records if r.get("event") == "listening"] == [p.address]


async def test_sigusr1_dumps_thread_stacks_and_task_chains():
    """kill -USR1 on a running server: every thread's stack, then each pending asyncio task
    with the coroutines it waits in; the server keeps serving."""
    sp = start_server(engine_id="stacks", role="prefill", tp_size=1, layout=LAYOUT)
    try:
        sp.dump_stacks()
        text = ""
        for _ in range(100):
            await asyncio.sleep(0.1)
            text = "".join(sp.output)
            if "task " in text and "asyncio tasks pending" in text:
                break
        assert re.search(r"Thread 0x[0-9a-f]+", text), text[-2000:]  # faulthandler's per-thread header
        assert "kvsvc-nixl" in text or "nixl_thread.py" in text, text[-2000:]  # the NIXL thread is one of them
        assert re.search(r"task \S+: serve server\.py:\d+ -> wait ", text), text[-2000:]  # main task's chain
        async with AsyncClient(sp.address) as client:
            assert (await client.get_info()).engine_id == "stacks"
    finally:
        assert sp.stop() == 0


async def test_a_progressive_transfer_reports_its_part_after_p_final_commit(tmp_path):
    p, d = start("g-p", "prefill", tmp_path), start("g-d", "decode", tmp_path)
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            opened = await pc.publish_blocks_request(pb.PublishBlocksRequest(
                request_id="grow", block_ids_per_group=[pb.BlockIds(block_ids=[1, 2])], num_tokens=8,
                progressive=True))
            await pc.commit_blocks(pb.CommitBlocksRequest(
                request_id="grow", lease_token=opened.params.lease_token, commit_epoch=2,
                block_ids_per_group=[pb.BlockIds(block_ids=[3])], num_tokens=12, final=True))
            resp = await dc.transfer("d-grow", opened.params, [[10, 11, 12]])
            pub = await pc.publish_blocks("whole", [[5, 6]])
            await dc.transfer("d-whole", pub.params, [[20, 21]])
        ds = scrape(metrics_url(d))
        # One observation, the progressive transfer's (final before D came: all of it after);
        # the whole lease's transfer has no final commit and adds none.
        assert value(ds, "kvsvc_progressive_after_final_seconds_count", engine="g-d") == 1
        assert value(ds, "kvsvc_progressive_after_final_seconds_sum", engine="g-d") == pytest.approx(
            resp.after_final_us / 1e6)
        assert value(ds, "kvsvc_progressive_reads_total", engine="g-d", when="final") == 1
    finally:
        p.stop()
        d.stop()
