"""`kvsvc serve | info | leases | demo | bench`: the command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from kvsvc.client import ClientOptions


def _serve(args: argparse.Namespace) -> int:
    import json

    from kvsvc.config import MemoryMode, Role, load_config
    from kvsvc.service.server import run

    cfg = load_config(
        args.config, listen=args.listen, engine_id=args.engine_id,
        role=Role(args.role) if args.role else None, tp_size=args.tp_size,
        ranks=tuple(int(r) for r in args.ranks.split(",")) if args.ranks else None,
        memory=MemoryMode(args.memory) if args.memory else None,
        advertised_address=args.advertise, metrics_listen=args.metrics_listen, otlp_endpoint=args.otlp_endpoint,
        sibling_servers=tuple(a for a in args.siblings.split(",") if a) if args.siblings else None,
        etcd_endpoints=tuple(a for a in args.etcd.split(",") if a) if args.etcd else None,
        etcd_prefix=args.etcd_prefix,
        layout_table=json.loads(args.layout_json) if args.layout_json else None,
    )
    run(cfg)
    return 0


def _info(args: argparse.Namespace) -> int:
    from kvsvc.cli.info import print_info

    return print_info(args.address, _client_options(args), as_json=args.json)


def _engines(args: argparse.Namespace) -> int:
    from kvsvc.cli.engines import run_engines

    return run_engines(args.etcd, args.engine, args.etcd_prefix, args.json, args.watch)


def _health(args: argparse.Namespace) -> int:
    from kvsvc.cli.health import run_health

    return run_health(args.address, _client_options(args), args.service)


def _leases(args: argparse.Namespace) -> int:
    from kvsvc.cli.leases import print_leases

    return print_leases(args.address, _client_options(args), limit=args.limit, prefix=args.prefix,
                        as_json=args.json)


def _connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (proto field names) instead of text")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server's answer")
    p.add_argument("--ca", help="PEM roots: speak TLS to the server (default: plaintext)")
    p.add_argument("--cert", help="PEM client certificate, for mutual TLS (default: none)")
    p.add_argument("--key", help="PEM client key, for mutual TLS (default: none)")
    p.add_argument("--server-name", help="name the server's certificate carries, e.g. its engine id (default: the "
                   "address's host)")


def _client_options(args: argparse.Namespace) -> ClientOptions:
    from kvsvc.client import ClientOptions

    if (args.cert or args.key) and not args.ca:
        raise SystemExit("kvsvc: --cert and --key go with --ca (TLS)")
    opts = ClientOptions(timeout_s=args.timeout, retries=1)
    return opts.with_pem_files(args.ca, args.cert, args.key, args.server_name) if args.ca else opts


def _demo(args: argparse.Namespace) -> int:
    from kvsvc.cli.demo import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    from kvsvc.cli.bench import run_bench

    return run_bench(args)


def _logging_arguments(p: argparse.ArgumentParser, default: Any) -> None:
    """-v and --log-format, before the subcommand or after it (default: the top parser's
    defaults, or SUPPRESS in a subcommand so that one given before it stands)."""
    p.add_argument("-v", "--verbose", action="count", default=0 if default is None else default,
                   help="log at INFO (-vv: DEBUG)")
    p.add_argument("--log-format", choices=["text", "json"], default="text" if default is None else default,
                   help="log lines as text or as one JSON object each (with request_id and trace_id)")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written, and every flag's default shown where its help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def build_parser() -> argparse.ArgumentParser:
    from kvsvc import __version__

    ap = argparse.ArgumentParser(prog="kvsvc", description="KV-cache transfer service for disaggregated inference",
                                 formatter_class=_Help, epilog=_examples(
                                     "kvsvc demo", "kvsvc serve --config node.toml", "kvsvc info 127.0.0.1:50051",
                                     "kvsvc SUBCOMMAND --help"))
    ap.add_argument("--version", action="version", version=f"kvsvc {__version__}")
    _logging_arguments(ap, None)
    common = argparse.ArgumentParser(add_help=False)
    _logging_arguments(common, argparse.SUPPRESS)
    sub = _Subcommands(ap.add_subparsers(dest="cmd", required=True), common)
    _add_serve(sub)
    _add_inspection(sub)
    _add_engines(sub)
    _add_demo(sub)
    b = sub.add_parser("bench", help="kvsvc Transfer vs raw NIXL vs memcpy, side by side: sizes, concurrency, "
                       "cold vs warm", epilog=_examples(
                           "kvsvc bench --json benchmarks/results.json --plot docs/bench",
                           "kvsvc bench --prefill 10.0.0.5:50051 --decode 10.0.0.6:50051 --ca ca.pem",
                           "kvsvc bench --memory vram --max-mib 256"))
    from kvsvc.cli.bench import add_arguments

    add_arguments(b)
    b.set_defaults(func=_bench)
    return ap


class _Subcommands:
    """add_subparsers' result, every subcommand taking the logging arguments too and showing
    its defaults and examples."""

    def __init__(self, action: Any, common: argparse.ArgumentParser) -> None:
        self._action, self._common = action, common

    def add_parser(self, name: str, **kw: Any) -> argparse.ArgumentParser:
        kw.setdefault("formatter_class", _Help)
        parser: argparse.ArgumentParser = self._action.add_parser(name, parents=[self._common], **kw)
        return parser


def _add_serve(sub: _Subcommands) -> None:
    s = sub.add_parser("serve", help="run a server (defaults: 127.0.0.1:50051, a tiny built-in layout)",
                       description="Run a kvsvc server. Flags override the config file, which overrides the "
                       "built-in defaults.", epilog=_examples(
                           "kvsvc serve", "kvsvc serve --config node.toml",
                           "kvsvc serve --listen 0.0.0.0:50051 --advertise 10.0.0.5:50051 --role prefill --tp-size 8 "
                           "--memory vram --metrics-listen 0.0.0.0:9464",
                           "kvsvc --log-format json serve --config node.toml --etcd http://etcd:2379"))
    s.add_argument("--config", help="TOML file with [server] and [layout] tables (default: none, the built-in "
                   "defaults)")
    s.add_argument("--listen", help="host:port to bind, port 0 for any free port (default: the config's, else "
                   "127.0.0.1:50051)")
    s.add_argument("--advertise", help="address peers should dial (default: the config's, else the bound address)")
    s.add_argument("--metrics-listen", help="host:port to serve Prometheus /metrics on, port 0 for any free port "
                   "(default: the config's, else none)")
    s.add_argument("--otlp-endpoint", help="export trace spans over OTLP/gRPC to this collector (default: the "
                   "config's, else none)")
    s.add_argument("--etcd", help="etcd endpoints, comma-separated: register this server there while it runs "
                   "(default: the config's, else none)")
    s.add_argument("--etcd-prefix", help="key prefix of kvsvc's records in etcd (default /kvsvc/v1)")
    s.add_argument("--engine-id", help="the engine this server belongs to, unique in the deployment (default "
                   "kvsvc-engine)")
    s.add_argument("--role", choices=["prefill", "decode", "both"], help="what the engine does (default both)")
    s.add_argument("--tp-size", type=int, help="the engine's tensor-parallel size (default 1)")
    s.add_argument("--ranks", help="hosted TP ranks, comma-separated (default: all)")
    s.add_argument("--memory", choices=["dram", "vram", "none"], help="where pools live, none for the control "
                   "plane only (default dram)")
    s.add_argument("--layout-json", help="the [layout] table as JSON, overriding the config file's (default: the "
                   "config's, else a tiny built-in layout)")
    s.add_argument("--siblings", help="addresses of this engine's other servers, comma-separated: PublishBlocks "
                   "here leases the request on them too (default: none)")
    s.set_defaults(func=_serve)


_ADDRESS_HELP = "the server's host:port (default 127.0.0.1:50051)"
_TLS_EXAMPLE = "--ca ca.pem --cert me.pem --key me.key --server-name prefill-0"


def _add_inspection(sub: _Subcommands) -> None:
    i = sub.add_parser("info", help="print a server's GetInfo readably (--json: as JSON)", epilog=_examples(
        "kvsvc info", "kvsvc info 10.0.0.5:50051 --json", f"kvsvc info 10.0.0.5:50051 {_TLS_EXAMPLE}"))
    i.add_argument("address", nargs="?", default="127.0.0.1:50051", help=_ADDRESS_HELP)
    _connection_arguments(i)
    i.set_defaults(func=_info)

    h = sub.add_parser("health", help="the gRPC health check (exit 0: SERVING), over TLS when asked: for probes",
                       epilog=_examples("kvsvc health", f"kvsvc health 127.0.0.1:50051 {_TLS_EXAMPLE} --timeout 4"))
    h.add_argument("address", nargs="?", default="127.0.0.1:50051", help=_ADDRESS_HELP)
    h.add_argument("--service", default="", help="service name to check (default: the whole server)")
    _connection_arguments(h)
    h.set_defaults(func=_health)

    ls = sub.add_parser("leases", help="list a server's live leases, peers and running transfers (read only)",
                        epilog=_examples("kvsvc leases", "kvsvc leases 10.0.0.5:50051 --prefix chat- --limit 20",
                                         f"kvsvc leases 10.0.0.5:50051 {_TLS_EXAMPLE} --json"))
    ls.add_argument("address", nargs="?", default="127.0.0.1:50051", help=_ADDRESS_HELP)
    ls.add_argument("--limit", type=int, default=0, help="at most this many leases (default 0: the server's "
                    "limit, 1000)")
    ls.add_argument("--prefix", default="", help="only request ids starting with this (default: all)")
    _connection_arguments(ls)
    ls.set_defaults(func=_leases)


def _add_engines(sub: _Subcommands) -> None:
    e = sub.add_parser("engines", help="the engines registered in etcd and their servers (--watch: follow changes)",
                       epilog=_examples("kvsvc engines --etcd http://127.0.0.1:2379",
                                        "kvsvc engines --etcd http://127.0.0.1:2379 --engine prefill-0 --json",
                                        "kvsvc engines --etcd http://127.0.0.1:2379 --watch"))
    e.add_argument("--etcd", required=True, help="etcd endpoints, comma-separated, e.g. http://host:2379 (required)")
    e.add_argument("--engine", default="", help="only this engine id (default: all)")
    e.add_argument("--etcd-prefix", default="", help="key prefix of kvsvc's records (default /kvsvc/v1)")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.add_argument("--watch", action="store_true", help="print the servers, then each one that comes or goes")
    e.set_defaults(func=_engines)


def _add_demo(sub: _Subcommands) -> None:
    d = sub.add_parser("demo", help="a real P->D transfer between two server processes on loopback",
                       description="Start prefill and decode servers, publish a request's KV on P, transfer it to D "
                       "and verify every byte against an independent reference.", epilog=_examples(
                           "kvsvc demo",
                           "kvsvc demo --prefill-tp 4 --decode-tp 2 --kv-heads 8 --layers 8 --blocks 128",
                           "kvsvc demo --prefill-tp 2 --decode-tp 1 --mla --layers 4",
                           "kvsvc demo --prefill-tp 4 --decode-tp 2 --prefill-servers 2 --decode-servers 2"))
    d.add_argument("--prefill-tp", type=int, default=2, help="tensor parallelism of the prefill engine")
    d.add_argument("--decode-tp", type=int, default=1, help="tensor parallelism of the decode engine")
    d.add_argument("--kv-heads", type=int, default=8, help="KV heads of the model (ignored with --mla)")
    d.add_argument("--head-size", type=int, default=None, help="elements per head (default 128, or 576 with "
                   "--mla)")
    d.add_argument("--mla", action="store_true", help="an MLA layout (one latent head per token)")
    d.add_argument("--layers", type=int, default=4, help="layers of the model")
    d.add_argument("--blocks", type=int, default=64, help="blocks per request")
    d.add_argument("--block-size", type=int, default=16, help="tokens per block")
    d.add_argument("--dtype", default="bfloat16", help="KV cache dtype")
    d.add_argument("--prefill-servers", type=int, default=1,
                   help="split the prefill engine's ranks evenly over this many server processes")
    d.add_argument("--decode-servers", type=int, default=1,
                   help="split the decode engine's ranks evenly over this many server processes")
    d.add_argument("--prefill-dcp", type=int, default=1,
                   help="decode context parallelism of the prefill engine (MLA only: 1 or --prefill-tp)")
    d.add_argument("--decode-dcp", type=int, default=1,
                   help="decode context parallelism of the decode engine (MLA only: 1 or --decode-tp)")
    d.add_argument("--quiet", action="store_true", help="no progress lines")
    d.set_defaults(func=_demo)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    from kvsvc.logs import setup

    setup(level, args.log_format)
    from kvsvc.errors import KvsvcError

    try:
        return int(args.func(args) or 0)
    except KvsvcError as e:
        print(f"kvsvc: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cli() -> None:
    """The `kvsvc` command: main(), then leave without the interpreter's teardown.

    On RDMA hosts (libibverbs1, librdmacm1 and libnl-3-200 installed, as on every such
    node) a process that loaded NIXL holds two copies of libnl and libibverbs -- the NIXL
    wheel's bundled ones and the system's -- and tearing both down at interpreter exit
    crashes (SIGSEGV) after kvsvc's own shutdown finished: supervisors read exit -11, not
    0. By the time main() returns everything kvsvc owns is released (pools unlinked,
    sockets and logs removed, agents destroyed), so the process flushes what it wrote
    and ends with os._exit, which runs no library teardown.
    """
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and usage errors, or a message (as Python says it)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    _leave(code)


def _leave(code: int) -> NoReturn:
    """Flush spans, logs and stdio, then end the process with code, skipping teardown."""
    trace = sys.modules.get("opentelemetry.trace")  # loaded only where tracing was in use
    with contextlib.suppress(Exception):
        shutdown = getattr(trace.get_tracer_provider(), "shutdown", None) if trace is not None else None
        if shutdown is not None:
            shutdown()  # the OTLP exporter's queued spans (what its atexit hook would do)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
