"""`kvsvc bench`: the arguments, then kvsvc.bench does the run."""

from __future__ import annotations

import argparse
import asyncio


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--json", help="write every figure here as JSON (default: not written)")
    b.add_argument("--plot", metavar="DIR", help="draw bandwidth.png and latency.png here, with matplotlib (default: no charts)")
    b.add_argument("--runs", type=int, default=10, help="timed requests per size and path (default 10)")
    b.add_argument("--max-mib", type=float, default=64, help="largest request, MiB (default 64)")
    b.add_argument("--layers", type=int, default=4, help="layers of the benchmark model (default 4: 256 KiB blocks)")
    b.add_argument("--concurrency", default="1,8,32", help="requests in flight to try (default 1,8,32)")
    b.add_argument("--requests", type=int, default=400, help="1-block requests per concurrency level (default 400)")
    b.add_argument("--memory", choices=("dram", "vram"), default="dram",
                   help="pools of the servers started here, the raw NIXL reader's and memcpy's buffers: host memory "
                        "(dram, default) or GPU memory (vram: needs CUDA; memcpy is then a device-to-device copy)")
    b.add_argument("--prefill", metavar="ADDR", help="a running P server, with --decode (default: start a P and a D server)")
    b.add_argument("--decode", metavar="ADDR", help="a running D server, whose blocks are overwritten (default: started here)")
    b.add_argument("--ca", help="PEM roots for TLS to --prefill/--decode (default: plaintext)")
    b.add_argument("--cert", help="PEM client certificate, for mutual TLS (default: none)")
    b.add_argument("--key", help="PEM client key, for mutual TLS (default: none)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def run_bench(args: argparse.Namespace) -> int:
    from kvsvc.bench.report import print_report, write_json
    from kvsvc.bench.sweep import run

    res = asyncio.run(run(args))
    print_report(res)
    if args.json:
        write_json(res, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from kvsvc.bench.plots import draw

        for path in draw(res, args.plot):
            print(f"wrote {path}")
    return 0 if res["verified"] is not False else 1
