"""kvsvc across hosts: `kvsvc bench` with P and D on two simulated hosts (tests/hosts).

    sudo .venv/bin/python -m benchmarks.hosts --json benchmarks/hosts.json      (make bench-hosts; needs root)

P's server runs on host a, D's on host b, joined by a bridge (veth pairs: a real network
path through the kernel's TCP stack, with no RDMA and no link latency beyond the kernel's
own). `kvsvc bench --prefill P --decode D` runs on D's host, where an engine would call its
D server: kvsvc's transfers, raw NIXL (an agent of the bench process on D's host reading
P's blocks over the same link, with the same UCX transports) and memcpy side by side, and
a bare gRPC call to P (a round trip of the link) in the same run. The 1-block control
overhead (Transfer p50 minus wire p50) is given in those round trips.

P's pool is filled with random bytes first (from this process, through P's host's
/dev/shm), so the link carries data, not zeros; the bench cannot map P's pool from D's
host and so cannot compare bytes itself: one transfer after the run is checked byte for
byte here, where both hosts' /dev/shm are visible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvsvc.bench.sweep import bench_layout
from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.client import AsyncClient
from tests.e2e.harness import Engine
from tests.hosts.harness import Host, available, hosts

NUM_BLOCKS = 512  # 128 MiB a side at 4 layers: the sweep, cold blocks and concurrency slots


def fill_random(host: Host, shm_name: str) -> None:
    """P's whole pool, random bytes, written through its host's /dev/shm."""
    with open(f"{host.shm_dir}/{shm_name.lstrip('/')}", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        view[:] = np.random.default_rng(7).integers(0, 256, view.size, dtype=np.uint8)
        del view


async def check_one(p_addr: str, d_addr: str, a: Host, b: Host) -> bool:
    """One 64-block transfer between the same servers, D's bytes compared with P's."""
    async with AsyncClient(p_addr) as pc, AsyncClient(d_addr) as dc:
        pe, de = await Engine.of(pc, a.shm_dir), await Engine.of(dc, b.shm_dir)
        try:
            p_ids, d_ids = [list(range(64))], [list(range(100, 164))]
            pe.fill(p_ids)
            pub = await pc.publish_blocks("hosts-check", p_ids)
            await dc.transfer("d-hosts-check", pub.params, d_ids, timeout_s=60)
            return not de.check(d_ids)
        finally:
            pe.close()
            de.close()


@contextlib.contextmanager
def bench_pair(layout: dict[str, Any], env: dict[str, str]) -> Iterator[tuple[Host, Host, ServerProcess, ServerProcess]]:
    """Two simulated hosts, a P server on the first and a D server on the second (env: for
    both, e.g. UCX_TLS); stopped, and the hosts torn down, on the way out."""
    with hosts(2) as (a, b):
        p = start_server(engine_id="bench-prefill", role="prefill", tp_size=1, layout=layout,
                         listen=f"{a.address}:0", launcher=a.launcher, extra_env=env)
        try:
            d = start_server(engine_id="bench-decode", role="decode", tp_size=1, layout=layout,
                             listen=f"{b.address}:0", launcher=b.launcher, extra_env=env)
            try:
                yield a, b, p, d
            finally:
                d.stop()
        finally:
            p.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = available()
    if reason:
        raise SystemExit(f"benchmarks.hosts: {reason}")
    layout = bench_layout(args.layers, NUM_BLOCKS)
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    with bench_pair(layout, env) as (a, b, p, d):
        info = asyncio.run(_info(p.address))
        fill_random(a, info.pools[0].shm_name)
        out = f"{b.tmp}/hosts.json"
        argv = [sys.executable, "-m", "kvsvc.cli.main", "bench", "--prefill", p.address, "--decode",
                d.address, "--json", out, "--runs", str(args.runs), "--max-mib", str(args.max_mib),
                "--layers", str(args.layers), "--concurrency", args.concurrency, "--requests",
                str(args.requests)]
        done = b.run(["env", *(f"{k}={v}" for k, v in env.items()), *argv], timeout_s=1800, check=False)
        print(done.stdout, end="")
        if done.returncode:
            raise SystemExit(f"kvsvc bench on host {b.name} failed ({done.returncode}):\n{done.stderr}")
        res: dict[str, Any] = json.loads(Path(f"/proc/{b.pid}/root{out}").read_text())
        res["verified"] = asyncio.run(check_one(p.address, d.address, a, b))
    rtt = res["grpc_round_trip_p50_ms_prefill"]
    res["hosts"] = {"link": "veth pairs on a Linux bridge (network namespaces)", "ucx_tls": args.ucx_tls or "default",
                    "link_round_trip_p50_ms": rtt,
                    "overhead_in_round_trips": res["overhead_p50_ms"] / rtt if rtt else None}
    return res


async def _info(address: str) -> Any:
    async with AsyncClient(address) as c:
        return await c.get_info()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--max-mib", type=float, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for both servers and the bench (default: UCX's choice)")
    args = ap.parse_args(argv)
    res = run(args)
    h = res["hosts"]
    ratios = ", ".join(f"{k}: {res.get(f'kvsvc_over_raw_nixl_{k}') or 0:.3f}" for k in ("shuffled", "contiguous"))
    print(f"\nacross hosts (UCX {h['ucx_tls']}: {', '.join(res['ucx_transports'])}): kvsvc / raw NIXL at "
          f"{res['bytes_per_transfer'] / (1 << 20):.0f} MiB {ratios}; control overhead "
          f"{res['overhead_p50_ms']:.3f} ms = {h['overhead_in_round_trips']:.2f} round trips of the link "
          f"(bare gRPC call to P: {h['link_round_trip_p50_ms']:.3f} ms); bytes checked: {res['verified']}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if res["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
