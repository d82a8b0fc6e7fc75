"""Server configuration: a frozen dataclass, loadable from TOML and overridable by flags."""

from __future__ import annotations

import enum
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.layout.build import layout_from_dict
from kvsvc.layout.engine import EngineLayout

DEFAULT_LISTEN = "127.0.0.1:50051"


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
    memory: MemoryMode = MemoryMode.DRAM
    """Where the KV pools live."""
    cuda_device: int = 0
    """CUDA device of VRAM pools."""
    advertised_address: str = ""
    """Address peers should dial (defaults to the bound address)."""
    lease_ttl_s: float = 30.0
    """Default lease lifetime of published blocks, seconds."""
    max_lease_ttl_s: float = 600.0
    """Largest lease lifetime a publisher may ask for, seconds."""
    shutdown_grace_s: float = 5.0
    """How long in-flight RPCs may finish after SIGTERM, seconds."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message accepted or sent, bytes (plans of long requests are big)."""
    peer_timeout_s: float = 10.0
    """Deadline of server-to-server RPCs (handshake, claim, notify), seconds."""
    allowed_peers: tuple[str, ...] = ()
    """Engine ids allowed to handshake, claim and notify (empty: any). With mutual TLS the
    engine id must also be the peer certificate's common name or a DNS name in it."""
    tls_cert_file: str = ""
    """PEM certificate chain of this server; with tls_key_file, the port serves TLS only."""
    tls_key_file: str = ""
    """PEM private key of this server."""
    tls_client_ca_file: str = ""
    """PEM roots that client certificates must chain to; set: mutual TLS is required."""
    peer_tls_ca_file: str = ""
    """PEM roots to verify peer servers with; set: peers are dialed over TLS (presenting this
    server's certificate when it has one)."""

    def layout(self) -> EngineLayout:
        return layout_from_dict(self.layout_table, self.tp_size)

    def validate(self) -> None:
        if self.tp_size <= 0:
            raise InvalidArgument("INVALID_CONFIG", f"tp_size must be positive, got {self.tp_size}")
        bad = [r for r in self.ranks if not 0 <= r < self.tp_size]
        if bad or not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise InvalidArgument("INVALID_CONFIG", f"ranks {list(self.ranks)} must be distinct and in [0, {self.tp_size})")
        if not self.engine_id:
            raise InvalidArgument("INVALID_CONFIG", "engine_id must be set")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("INVALID_CONFIG", "tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise InvalidArgument("INVALID_CONFIG", "tls_client_ca_file needs tls_cert_file and tls_key_file")
        self.layout()

    def with_overrides(self, **kw: Any) -> ServerConfig:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def load_config(path: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """ServerConfig from a TOML file ([server] and [layout] tables) plus flag overrides."""
    cfg = ServerConfig()
    if path is not None:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        srv = dict(doc.get("server", {}))
        kw: dict[str, Any] = {}
        for key in ("listen", "engine_id", "advertised_address", "tls_cert_file", "tls_key_file",
                    "tls_client_ca_file", "peer_tls_ca_file"):
            if key in srv:
                kw[key] = str(srv[key])
        for key in ("tp_size", "cuda_device", "max_message_bytes"):
            if key in srv:
                kw[key] = int(srv[key])
        for key in ("lease_ttl_s", "max_lease_ttl_s", "shutdown_grace_s", "peer_timeout_s"):
            if key in srv:
                kw[key] = float(srv[key])
        if "role" in srv:
            kw["role"] = Role(srv["role"])
        if "memory" in srv:
            kw["memory"] = MemoryMode(srv["memory"])
        if "ranks" in srv:
            kw["ranks"] = tuple(int(r) for r in srv["ranks"])
        if "allowed_peers" in srv:
            kw["allowed_peers"] = tuple(str(p) for p in srv["allowed_peers"])
        if "layout" in doc:
            kw["layout_table"] = doc["layout"]
        cfg = replace(cfg, **kw)
    cfg = cfg.with_overrides(**overrides)
    if overrides.get("ranks") is None and (path is None or "ranks" not in doc.get("server", {})):
        cfg = replace(cfg, ranks=tuple(range(cfg.tp_size)))
    cfg.validate()
    return cfg
