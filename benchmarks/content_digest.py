"""What content digests cost, against the READ they check (docs/RELIABILITY.md).

    .venv/bin/python -m benchmarks.content_digest --json benchmarks/content-digest.json

Two P/D pairs of real server processes on this host, alike but for content_digest (off,
on), move the same requests: 1, 8 and 64 blocks of 256 KiB (4 layers, K and V). Rounds
alternate between the pairs. Per size and pair, the p50 of: P's PublishBlocks (with digests
on it answers once it hashed the blocks), D's Transfer (D hashes what landed while P
confirms) and the wire (the READs alone, TransferResponse.duration_us of the ranks). The
cost is what digests add to P's publish and to D's transfer, as a fraction of the wire
time without them. Beside it: BLAKE2b's rate on this CPU, and memcpy's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.client import AsyncClient

LAYOUT = {"model_id": "kvsvc-digest", "total_num_kv_heads": 8, "block_size": 16, "num_blocks": 160,
          "dtype": "bfloat16", "groups": [{"name": "full", "kind": "full_attention", "num_layers": 4,
                                           "head_size": 128}]}
BLOCK_BYTES = 4 * 2 * 16 * 8 * 128 * 2  # layers, K and V, tokens, heads, head size, bf16: 256 KiB
SIZES = (1, 8, 64)


def start_pair(digest: bool, where: Path) -> tuple[ServerProcess, ServerProcess]:
    cfg = where / f"digest-{digest}.toml"
    cfg.write_text(f"[server]\ncontent_digest = {str(digest).lower()}\n")
    p = start_server(engine_id=f"p-{digest}", role="prefill", tp_size=1, layout=LAYOUT, config_file=str(cfg))
    d = start_server(engine_id=f"d-{digest}", role="decode", tp_size=1, layout=LAYOUT, config_file=str(cfg))
    return p, d


async def one(pc: AsyncClient, dc: AsyncClient, rid: str, blocks: int) -> tuple[float, float, float]:
    """Publish ms, Transfer ms, wire ms of one request."""
    t0 = time.perf_counter()
    pub = await pc.publish_blocks(rid, [list(range(blocks))])
    t1 = time.perf_counter()
    resp = await dc.transfer("d-" + rid, pub.params, [list(range(blocks, 2 * blocks))])
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), max(r.duration_us for r in resp.ranks) / 1e3


def rate_gbps(fn, nbytes: int, runs: int = 5) -> float:
    best = min(_timed(fn) for _ in range(runs))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def run(rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        pairs = {digest: start_pair(digest, Path(tmp)) for digest in (False, True)}
        try:
            samples: dict[tuple[bool, int], list[tuple[float, float, float]]] = {k: [] for k in
                                                                                 ((d, s) for d in (False, True)
                                                                                  for s in SIZES)}
            clients = {d: (AsyncClient(p.address), AsyncClient(dd.address)) for d, (p, dd) in pairs.items()}
            try:
                for digest, (pc, dc) in clients.items():  # handshakes and wire-up, untimed
                    await one(pc, dc, f"warm-{digest}", 1)
                for i in range(rounds):
                    for size in SIZES:
                        for digest in ((False, True) if i % 2 == 0 else (True, False)):
                            pc, dc = clients[digest]
                            samples[(digest, size)].append(await one(pc, dc, f"r{i}-{size}-{digest}", size))
            finally:
                for pc, dc in clients.values():
                    await pc.close()
                    await dc.close()
        finally:
            for p, d in pairs.values():
                p.stop()
                d.stop()
    rows = []
    for size in SIZES:
        off = [statistics.median(x) for x in zip(*samples[(False, size)], strict=True)]
        on = [statistics.median(x) for x in zip(*samples[(True, size)], strict=True)]
        added_p, added_d = on[0] - off[0], on[1] - off[1]
        rows.append({"blocks": size, "bytes": size * BLOCK_BYTES,
                     "off": {"publish_ms": off[0], "transfer_ms": off[1], "wire_ms": off[2]},
                     "on": {"publish_ms": on[0], "transfer_ms": on[1], "wire_ms": on[2]},
                     "added_publish_ms": added_p, "added_transfer_ms": added_d,
                     "added_over_wire": (added_p + added_d) / off[2] if off[2] > 0 else None})
    buf = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    dst = np.empty_like(buf)
    return {"rounds": rounds, "sizes": rows,
            "blake2b_gbps": rate_gbps(lambda: hashlib.blake2b(memoryview(buf), digest_size=8).digest(), buf.nbytes),
            "memcpy_gbps": rate_gbps(lambda: np.copyto(dst, buf), buf.nbytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = asyncio.run(run(args.rounds))
    print(f"{'size':>9} {'wire ms':>8} | {'publish ms off/on':>18} | {'transfer ms off/on':>19} | added / wire")
    for r in out["sizes"]:
        print(f"{r['bytes'] / 2**20:7.2f}Mi {r['off']['wire_ms']:8.2f} | {r['off']['publish_ms']:8.2f} / "
              f"{r['on']['publish_ms']:7.2f} | {r['off']['transfer_ms']:8.2f} / {r['on']['transfer_ms']:8.2f} | "
              f"{r['added_over_wire']:.0%}")
    print(f"BLAKE2b {out['blake2b_gbps']:.2f} GB/s, memcpy {out['memcpy_gbps']:.2f} GB/s on this CPU")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
