"""`kvsvc demo`: a real prefill -> decode transfer between two server processes, verified byte for byte."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from kvsvc.cli.procs import ServerProcess, split_ranks, start_engine
from kvsvc.client import AsyncClient
from kvsvc.client.attach import attach_pool
from kvsvc.client.client import ReleaseStream
from kvsvc.codec import layout_from_proto
from kvsvc.errors import InvalidArgument
from kvsvc.layout.build import layout_from_dict
from kvsvc.layout.regions import build_pool_layout
from kvsvc.mapping.planner import Side, validate_pair
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb
from kvsvc.verify import RankMemory, check_rank, fill_rank

REQUEST_ID = "demo-1"


def demo_layout(args: argparse.Namespace, dcp_size: int = 1) -> dict[str, Any]:
    head = args.head_size or (576 if args.mla else 128)
    return {
        "model_id": "kvsvc-demo", "total_num_kv_heads": args.kv_heads, "block_size": args.block_size,
        "num_blocks": max(2 * args.blocks, 16), "dtype": args.dtype, "dcp_size": dcp_size,
        "groups": [{"name": "mla" if args.mla else "full", "kind": "mla" if args.mla else "full_attention",
                    "num_layers": args.layers, "head_size": head}],
    }


def num_tokens(args: argparse.Namespace) -> int:
    """The demo request's length: --blocks blocks, the last one half full."""
    return (args.blocks - 1) * args.block_size + (args.block_size + 1) // 2


class Steps:
    """A one-line-per-step progress indicator."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.n, self.quiet, self.t0 = total, 0, quiet, time.perf_counter()

    def start(self, what: str) -> None:
        self.n += 1
        if not self.quiet:
            print(f"[{self.n}/{self.total}] {what} ...", end="", flush=True)
        self.t0 = time.perf_counter()

    def done(self, detail: str = "") -> None:
        if not self.quiet:
            print(f" done ({time.perf_counter() - self.t0:.2f} s){'  ' + detail if detail else ''}", flush=True)

    def note(self, text: str) -> None:
        if not self.quiet:
            print(f"      {text}", flush=True)


async def _run(args: argparse.Namespace, prefill: list[ServerProcess], decode: list[ServerProcess],
               steps: Steps) -> bool:
    pcs = [AsyncClient(sp.address) for sp in prefill]
    dcs = [AsyncClient(sp.address) for sp in decode]
    try:
        return await _transfer(args, pcs, dcs, steps)
    finally:
        for c in (*pcs, *dcs):
            await c.close()


async def _transfer(args: argparse.Namespace, pcs: list[AsyncClient], dcs: list[AsyncClient], steps: Steps) -> bool:
    pinfos = [await c.get_info() for c in pcs]
    dinfos = [await c.get_info() for c in dcs]
    pinfo, dinfo = pinfos[0], dinfos[0]
    rng = random.Random(7)
    p_layout = layout_from_proto(pinfo.layout, tp_size=pinfo.tp_size)
    d_layout = layout_from_proto(dinfo.layout, tp_size=dinfo.tp_size)
    tokens = num_tokens(args)
    # With DCP each rank holds every dcp-th block of the request: fewer ids per rank.
    p_ids = [rng.sample(range(p_layout.num_blocks), -(-args.blocks // p_layout.dcp_size))]
    d_ids = [rng.sample(range(d_layout.num_blocks), -(-args.blocks // d_layout.dcp_size))]

    held = f"{len(p_ids[0])} of its blocks" if p_layout.dcp_size > 1 else f"{args.blocks} blocks"
    steps.start(f"prefill engine writes {held} ({tokens} tokens) on each of its {pinfo.tp_size} ranks and publishes")
    p_regions = build_pool_layout(p_layout).regions
    for info in pinfos:
        for pool in info.pools:
            with attach_pool(pool) as ap:
                fill_rank(RankMemory(p_regions, ap.buffer), pool.tp_rank, pinfo.tp_size,
                          p_layout.total_num_kv_heads, p_ids, p_layout.block_size, p_layout.dcp_size)
    # Subscribed on every prefill server before anything can be released.
    streams = [await c.open_release_stream() for c in pcs]
    watches = [asyncio.ensure_future(_first_release(s)) for s in streams]
    pub = await pcs[0].publish_blocks(REQUEST_ID, p_ids, num_tokens=tokens)
    steps.done(f"lease until unix ms {pub.lease_expires_unix_ms}")
    if len(pub.params.remote_servers) > 1:
        steps.note("the params name every prefill server: " + ", ".join(
            f"{s.address} ranks {list(s.ranks)}" for s in pub.params.remote_servers))

    steps.start("decode servers plan the transfer")
    plans = [await c.plan_transfer(pb.PlanTransferRequest(
        remote_address=pcs[0].address, local_block_ids_per_group=[pb.BlockIds(block_ids=d_ids[0])],
        remote_block_ids_per_group=[pb.BlockIds(block_ids=p_ids[0])], summary_only=True,
        remote_num_tokens=tokens)) for c in dcs]
    steps.done()
    for plan in plans:
        for rp in plan.rank_plans:
            steps.note(f"decode rank {rp.local_rank}: tp_ratio {rp.tp_ratio}, reads prefill ranks "
                       f"{list(rp.source_ranks)}, notifies {list(rp.handshake_target_ranks)}, "
                       f"{rp.num_descriptors} descriptors, {rp.bytes / 2**20:.2f} MiB")

    steps.start("decode engine calls Transfer on each of its servers (NIXL READ on every rank, then claim + consumed at P)")
    resps = await asyncio.gather(*(c.transfer("decode-req-1", pub.params, d_ids, timeout_s=60) for c in dcs))
    total = sum(r.total_bytes for r in resps)
    secs = max(r.duration_us for r in resps) / 1e6
    steps.done(f"{total / 2**20:.2f} MiB in {secs * 1e3:.1f} ms = {total / secs / 1e9:.2f} GB/s")
    for resp in resps:
        for r in resp.ranks:
            steps.note(f"rank {r.local_rank}: {r.bytes / 2**20:.2f} MiB, {r.num_descriptors} descriptors, "
                       f"{r.duration_us / 1e3:.1f} ms on the wire")
    transports = (await dcs[0].get_info()).transport.ucx_transports
    steps.note(f"UCX picked: {', '.join(transports) or 'unknown'} (first transfer to a peer includes wire-up)")

    steps.start("verifying decode pools against the reference")
    d_regions = build_pool_layout(d_layout).regions
    errors = []
    for info in dinfos:
        for pool in info.pools:
            with attach_pool(pool) as ap:
                errs = check_rank(RankMemory(d_regions, ap.buffer), pool.tp_rank, dinfo.tp_size,
                                  d_layout.total_num_kv_heads, d_ids, d_layout.block_size,
                                  dcp_size=d_layout.dcp_size, num_tokens=tokens)
                errors += [f"rank {pool.tp_rank}: {e}" for e in errs[:5]]
    steps.done("VERIFIED: every decode rank holds exactly its KV, byte for byte" if not errors else "MISMATCH")
    for e in errors:
        print("      " + e, file=sys.stderr)
    for info, watch in zip(pinfos, watches, strict=True):
        release = await asyncio.wait_for(watch, 10)
        steps.note(f"prefill server {info.advertised_address} released {release.request_id}: "
                   f"{pb.ReleaseReason.Name(release.reason)}")
    return not errors


async def _first_release(stream: ReleaseStream) -> pb.WatchReleasesResponse:
    try:
        async for ev in stream:
            return ev
        raise RuntimeError("release stream ended")
    finally:
        stream.cancel()


def check_shape(args: argparse.Namespace) -> None:
    """Refuse an impossible demo up front, with the reason the service would give."""
    p_layout = layout_from_dict(demo_layout(args, args.prefill_dcp), args.prefill_tp)
    d_layout = layout_from_dict(demo_layout(args, args.decode_dcp), args.decode_tp)
    validate_pair(Side.of(d_layout, args.decode_tp), Side.of(p_layout, args.prefill_tp))
    if args.blocks <= 0:
        raise InvalidArgument(Reason.INVALID_ARGUMENT, f"--blocks must be positive, got {args.blocks}")
    for side, tp, n in (("prefill", args.prefill_tp, args.prefill_servers), ("decode", args.decode_tp,
                                                                            args.decode_servers)):
        if not 1 <= n <= tp:
            raise InvalidArgument(Reason.INVALID_ARGUMENT, f"--{side}-servers must be between 1 and the {side} TP "
                                  f"size {tp}, got {n}", {"servers": n, "tp_size": tp})


def run_demo(args: argparse.Namespace) -> int:
    layout = demo_layout(args)
    check_shape(args)
    kind = "MLA" if args.mla else f"GQA K={args.kv_heads}"
    dcp = [f"{side} DCP {n}" for side, n in (("prefill", args.prefill_dcp), ("decode", args.decode_dcp)) if n > 1]
    kind += f" ({', '.join(dcp)})" if dcp else ""
    if not args.quiet:
        print(f"kvsvc demo: prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, {kind}, {args.layers} layers, "
              f"head {layout['groups'][0]['head_size']}, {args.dtype}, {args.blocks} blocks x {args.block_size} tokens")
    steps = Steps(5, args.quiet)
    steps.start(f"starting the prefill engine on {args.prefill_servers} and the decode engine on "
                f"{args.decode_servers} server process(es) (one NIXL agent per rank)")
    prefill = start_engine(engine_id="demo-prefill", role="prefill", tp_size=args.prefill_tp,
                           layout=demo_layout(args, args.prefill_dcp), servers=args.prefill_servers)
    try:
        decode = start_engine(engine_id="demo-decode", role="decode", tp_size=args.decode_tp,
                              layout=demo_layout(args, args.decode_dcp), servers=args.decode_servers)
    except BaseException:
        for sp in prefill:
            sp.stop()
        raise
    steps.done()
    for name, procs in (("prefill", prefill), ("decode", decode)):
        for sp, ranks in zip(procs, split_ranks(args.prefill_tp if name == "prefill" else args.decode_tp,
                                                 len(procs)), strict=True):
            steps.note(f"{name} ranks {ranks} on {sp.address}")
    try:
        ok = asyncio.run(_run(args, prefill, decode, steps))
    finally:
        codes = [sp.stop() for sp in (*prefill, *decode)]
        if not args.quiet:
            print(f"stopped {len(codes)} servers (exit codes {', '.join(map(str, codes))})")
    return 0 if ok else 1
