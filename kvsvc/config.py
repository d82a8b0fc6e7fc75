"""Server configuration: a frozen dataclass, loadable from TOML and overridable by flags."""

from __future__ import annotations

import enum
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.layout.build import layout_from_dict
from kvsvc.layout.engine import EngineLayout
from kvsvc.reasons import Reason

DEFAULT_LISTEN = "127.0.0.1:50051"
MAX_COPY_THREADS = 16


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class MemoryMode(enum.Enum):
    """Where pools live: DRAM (shared memory), VRAM (CUDA), or none (control plane only)."""

    DRAM = "dram"
    VRAM = "vram"
    NONE = "none"


# The built-in layout of `kvsvc serve` with no arguments: small enough to poke at once.
DEFAULT_LAYOUT: Mapping[str, Any] = {
    "model_id": "kvsvc-tiny", "total_num_kv_heads": 8, "block_size": 16, "num_blocks": 64,
    "dtype": "bfloat16", "groups": [{"name": "full", "kind": "full_attention", "num_layers": 2, "head_size": 64}],
}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One kvsvc server: the ranks of one engine on one node."""

    listen: str = DEFAULT_LISTEN
    """host:port to bind; port 0 picks a free port."""
    engine_id: str = "kvsvc-engine"
    """This engine's id, unique in the deployment."""
    role: Role = Role.BOTH
    """Prefill, decode, or both."""
    tp_size: int = 1
    """The engine's TP size."""
    ranks: tuple[int, ...] = (0,)
    """The TP ranks this server hosts (one NIXL agent each)."""
    layout_table: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_LAYOUT))
    """Model-level layout description (see README, Config); per-rank layout derived."""
    engine_layout: EngineLayout | None = None
    """This rank's layout as an engine integration built it (integrations/description.py);
    when set, layout_table is not read. Never from a config file."""
    memory: MemoryMode = MemoryMode.DRAM
    """Where the KV pools live."""
    cuda_device: int = 0
    """CUDA device of the first hosted rank's VRAM pool (see cuda_devices)."""
    cuda_devices: tuple[int, ...] = ()
    """CUDA device of each hosted rank's VRAM pool, in the order of ranks (empty: hosted
    rank i of this server goes to device cuda_device + i, one GPU per rank, folded onto the
    devices present when there are fewer)."""
    advertised_address: str = ""
    """Address peers should dial (defaults to the bound address)."""
    lease_ttl_s: float = 30.0
    """Default lease lifetime of published blocks, seconds."""
    max_lease_ttl_s: float = 600.0
    """Largest lease lifetime a publisher may ask for, seconds."""
    shutdown_grace_s: float = 5.0
    """How long in-flight RPCs may finish after SIGTERM, seconds."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long a prefill server waits for claimed leases (D may be reading)
    to be consumed or aborted before it stops, seconds. New publishes are refused meanwhile."""
    max_live_leases: int = 65_536
    """Most leases a prefill server keeps at once; PublishBlocks beyond is RESOURCE_EXHAUSTED
    (TOO_MANY_LEASES)."""
    max_leased_blocks: int = 16 * 1024 * 1024
    """Most block ids a prefill server's live leases hold together (4 bytes each: 64 MiB at
    the default); PublishBlocks beyond is RESOURCE_EXHAUSTED (TOO_MANY_LEASED_BLOCKS)."""
    max_claims_per_engine: int = 16_384
    """Most leases one D engine may hold claimed at once on a prefill server (a claim extends
    a lease and heartbeats keep it: one engine must not pin the whole table); a claim beyond
    is RESOURCE_EXHAUSTED (TOO_MANY_CLAIMS)."""
    max_waiting_claims_per_engine: int = 4096
    """Most claims of one D engine a prefill server holds waiting for leases its engine has not
    made yet (ClaimLeaseRequest.wait_ms; 16,384 across engines); a claim beyond is
    RESOURCE_EXHAUSTED (TOO_MANY_WAITING_CLAIMS)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message accepted or sent, bytes (plans of long requests are big)."""
    peer_timeout_s: float = 10.0
    """Deadline of server-to-server RPCs (handshake, claim, notify), seconds."""
    copy_threads: int = 2
    """On a decode server: threads, each with NIXL agents of its own, that a long READ between
    DRAM pools is split across (same-host copies run in the reading thread; two threads
    read a 64 MiB request ~1.5x faster here, see transport/copy_lanes.py). 0: every READ
    runs on the one NIXL thread."""
    content_digest: bool = False
    """A digest of every leased block's bytes, taken by P when the lease is made and checked
    by D against what landed (service/content.py): a difference fails the transfer
    (DIGEST_MISMATCH) instead of serving it. Both servers need it on. Host memory only. Off
    by default: benchmarks/content_digest.py measures what it costs against the READ."""
    require_rdma_between_nodes: bool = False
    """On a decode server: READs from a prefill server on another node must use RDMA; one
    that UCX serves otherwise (TCP) is reported TRANSPORT_DEGRADED (GetInfo's
    TransportInfo.peers, a warning, kvsvc_peer_read_transport). Within a node, TCP is
    always reported: shared memory or CUDA IPC was possible."""
    lease_socket: bool = True
    """A prefill server without TLS offers D servers on its host a Unix socket for their
    lease calls (a tenth of a gRPC stream message's cost; see service/lease_socket.py).
    False: lease calls always go over gRPC."""
    transfer_socket: bool = True
    """A decode server without TLS offers its engine on the same host a Unix socket for
    TransferStream's messages (GetInfo says where; a tenth of a gRPC stream message's cost,
    see service/transfer_socket.py). False: transfers always go over gRPC."""
    allowed_peers: tuple[str, ...] = ()
    """Engine ids this server exchanges KV with (empty: any): on P, who may handshake, claim
    and notify; on D, which P engines a Transfer may read from. With mutual TLS the engine
    id must also be the peer certificate's common name or a DNS name in it."""
    sibling_servers: tuple[str, ...] = ()
    """Addresses of this engine's other kvsvc servers (an engine whose ranks sit on several
    servers). PublishBlocks here fans out to them, so the params name every server."""
    allowed_engines: tuple[str, ...] = ()
    """Under mutual TLS: certificate names that may act as this server's engine (publish,
    watch releases, transfer, see pools). Empty: this server's own engine_id."""
    tls_cert_file: str = ""
    """PEM certificate chain of this server; with tls_key_file, the port serves TLS only."""
    tls_key_file: str = ""
    """PEM private key of this server."""
    tls_client_ca_file: str = ""
    """PEM roots that client certificates must chain to; set: mutual TLS is required."""
    peer_tls_ca_file: str = ""
    """PEM roots to verify peer servers with; set: peers are dialed over TLS (presenting this
    server's certificate when it has one)."""
    otlp_endpoint: str = ""
    """`kvsvc serve` exports trace spans over OTLP/gRPC to this collector (e.g.
    http://localhost:4317; needs opentelemetry-exporter-otlp-proto-grpc); empty: none."""
    metrics_listen: str = ""
    """host:port to serve Prometheus metrics on (/metrics, plain HTTP; port 0 picks one);
    empty: no metrics endpoint."""
    etcd_endpoints: tuple[str, ...] = ()
    """etcd endpoints (http://host:2379, ...) to register this server in while it runs, under
    {etcd_prefix}/engines/{engine_id}/servers/{address}; empty: no registration."""
    etcd_prefix: str = "/kvsvc/v1"
    """Key prefix of kvsvc's records in etcd (one per deployment sharing an etcd)."""
    etcd_ttl_s: int = 10
    """Lifetime of the registration's etcd lease, seconds: a killed server's key goes this long after."""

    def device_of(self, rank: int) -> int:
        """The CUDA device of hosted rank `rank`'s VRAM pool."""
        i = self.ranks.index(rank)
        return self.cuda_devices[i] if self.cuda_devices else self.cuda_device + i

    def layout(self) -> EngineLayout:
        if self.engine_layout is not None:
            self.engine_layout.validate(self.tp_size)
            return self.engine_layout
        return layout_from_dict(self.layout_table, self.tp_size)

    def validate(self) -> None:
        if self.tp_size <= 0:
            raise InvalidArgument(Reason.INVALID_CONFIG, f"tp_size must be positive, got {self.tp_size}")
        bad = [r for r in self.ranks if not 0 <= r < self.tp_size]
        if bad or not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise InvalidArgument(Reason.INVALID_CONFIG, f"ranks {list(self.ranks)} must be distinct and in [0, {self.tp_size})")
        if not self.engine_id:
            raise InvalidArgument(Reason.INVALID_CONFIG, "engine_id must be set")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument(Reason.INVALID_CONFIG, "tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise InvalidArgument(Reason.INVALID_CONFIG, "tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.cuda_devices and len(self.cuda_devices) != len(self.ranks):
            raise InvalidArgument(Reason.INVALID_CONFIG, f"cuda_devices names {len(self.cuda_devices)} devices for "
                                  f"{len(self.ranks)} hosted ranks")
        if not isinstance(self.copy_threads, int) or not 0 <= self.copy_threads <= MAX_COPY_THREADS:
            raise InvalidArgument(Reason.INVALID_CONFIG, f"copy_threads must be in [0, {MAX_COPY_THREADS}], "
                                  f"got {self.copy_threads}")
        if self.max_live_leases <= 0 or self.drain_timeout_s < 0:
            raise InvalidArgument(Reason.INVALID_CONFIG, "max_live_leases must be positive and drain_timeout_s >= 0")
        if self.max_waiting_claims_per_engine < 0:
            raise InvalidArgument(Reason.INVALID_CONFIG, "max_waiting_claims_per_engine must be >= 0 (0: no claim waits)")
        if self.etcd_endpoints:
            from kvsvc.discovery.etcd import parse_endpoints
            from kvsvc.discovery.registry import check_ttl, engine_prefix

            parse_endpoints(self.etcd_endpoints)
            check_ttl(self.etcd_ttl_s)
            engine_prefix(self.engine_id, self.etcd_prefix)
        self.layout()

    def with_overrides(self, **kw: Any) -> ServerConfig:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


# The [server] keys a config file may set: the ServerConfig fields except the layout,
# each read as its field's type says (no list of keys per type to keep in step).
_SERVER_KEYS = frozenset(f for f in ServerConfig.__dataclass_fields__ if f not in ("layout_table", "engine_layout"))
_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(ServerConfig)


def server_settings(where: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """[server] settings given elsewhere (an engine's connector config, as JSON values): each
    read as its field's type, strictly; an unknown key is INVALID_CONFIG naming it."""
    unknown = sorted(str(k) for k in settings if k not in _SERVER_KEYS)
    if unknown:
        raise InvalidArgument(Reason.INVALID_CONFIG, f"{where}: unknown keys {unknown}", {"unknown": ",".join(unknown)})
    return {key: _from_toml(f"{where}: {key}", value, _FIELD_TYPES[key]) for key, value in settings.items()}


def _from_toml(where: str, value: Any, kind: Any) -> Any:
    """value as a field of type kind (str, int, float, bool, an enum or tuple[T, ...]), strictly:
    a TOML value of another type is INVALID_CONFIG naming the key, never converted by guess."""
    def bad(expected: str) -> InvalidArgument:
        return InvalidArgument(Reason.INVALID_CONFIG, f"{where} must be {expected}, not {type(value).__name__} "
                               f"{str(value)[:80]!r}", {"key": where.rsplit(" ", 1)[-1], "expected": expected})

    if typing.get_origin(kind) is tuple:
        if not isinstance(value, list):
            raise bad("a list")
        item = typing.get_args(kind)[0]
        return tuple(_from_toml(f"{where}[{i}]", v, item) for i, v in enumerate(value))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        choices = [m.value for m in kind]
        if value not in choices:
            raise bad(f"one of {choices}")
        return kind(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad("a number")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    raise bad(str(kind))  # a field type this reader does not know: a bug, said plainly


def load_config(path: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """ServerConfig from a TOML file ([server] and [layout] tables) plus flag overrides."""
    cfg = ServerConfig()
    if path is not None:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        srv = dict(doc.get("server", {}))
        unknown = sorted(set(doc) - {"server", "layout"}) + sorted(f"server.{k}" for k in set(srv) - _SERVER_KEYS)
        if unknown:
            raise InvalidArgument(Reason.INVALID_CONFIG, f"{path}: unknown keys {unknown}; the [server] keys are "
                                  f"{sorted(_SERVER_KEYS)}", {"unknown": ",".join(unknown)})
        kw = {key: _from_toml(f"{path}: server.{key}", value, _FIELD_TYPES[key]) for key, value in srv.items()}
        if "layout" in doc:
            kw["layout_table"] = doc["layout"]
        cfg = replace(cfg, **kw)
    cfg = cfg.with_overrides(**overrides)
    if overrides.get("ranks") is None and (path is None or "ranks" not in doc.get("server", {})):
        cfg = replace(cfg, ranks=tuple(range(cfg.tp_size)))
    cfg.validate()
    return cfg
