"""kvsvc's settings inside an engine: one strict type, read the same way wherever an engine
keeps them -- vLLM's kv_connector_extra_config (a JSON object) or SGLang's environment
(KVSVC_SGLANG_<NAME>, read when the backend starts, not when it is imported).

Strict: a key the integration does not take is refused, naming it and the keys it takes
(a misspelt key is never silently ignored), and so is a value of the wrong type or out of
range. The embedded servers' own settings ([server] keys, kvsvc/config.py) may be given
inline (SERVER_KEYS) or in a kvsvc TOML file (`config`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsvc.config import server_settings
from kvsvc.errors import KvsvcError

# [server] settings an engine may give inline, passed to each embedded server.
SERVER_KEYS = ("lease_ttl_s", "max_lease_ttl_s", "peer_timeout_s", "allowed_peers", "allowed_engines",
               "tls_cert_file", "tls_key_file", "tls_client_ca_file", "peer_tls_ca_file", "copy_threads",
               "content_digest", "require_rdma_between_nodes")
MAX_MODEL_ID = 200
MAX_SECONDS = 3600.0
MAX_LAYER_COMMITS = 64  # partial commits of one chunk (each is a WaitCommit answer and a READ post on D)


@dataclass(frozen=True)
class EngineSettings:
    listen_host: str = ""
    """Where each embedded server listens, on port listen_port + its rank ("": the
    integration's choice -- vLLM 127.0.0.1, SGLang the host address SGLang uses)."""
    advertise_host: str = ""
    """Where peers reach it ("": listen_host)."""
    listen_port: int = 0
    """0: any free port."""
    model_id: str = ""
    """What P and D must agree on ("": the integration derives it from the model)."""
    lease_heartbeat_s: float = 5.0
    """D (vLLM): how often the P leases of requests waiting in D's queue are heartbeated (0: never)."""
    lease_ttl_ms: int = 0
    """P: how long a lease waits for D's claim (0: the server's lease_ttl_s)."""
    transfer_timeout_s: float = 120.0
    """D: a transfer not done by then fails (its request is recomputed or failed, by the engine's policy)."""
    stream_timeout_s: float = 600.0
    """D: the same for a streamed transfer (P's lease still growing), at least transfer_timeout_s.
    It begins before P prefills, so it holds P's queue and prefill, which a pulled transfer's
    (begun after P answered) does not: as long as kvsvc's router waits for P (--timeout-s)."""
    progressive: bool = False
    """P (SGLang): open each request's lease at its first chunk and commit each later chunk as
    it is computed, so D reads while P still prefills (docs/ARCHITECTURE.md, "Progressive
    pull"). D follows whatever P sends. vLLM: refused at start (its router decides, per request)."""
    layer_commits: int = 4
    """P (vLLM): the chunk that completes a streamed prompt is committed in up to this many
    parts as its forward computes the layers, so D reads them meanwhile (0 or 1: whole,
    after the forward, as every other chunk)."""
    config: str = ""
    """A kvsvc TOML file whose [server] keys apply to every embedded server."""
    server: Mapping[str, Any] = field(default_factory=dict)
    """[server] settings given inline (SERVER_KEYS), checked and typed as the TOML file's are."""

    def timeout_for(self, progressive: bool) -> float:
        """D: the deadline of a transfer of a lease that is (or is not) progressive."""
        return max(self.stream_timeout_s, self.transfer_timeout_s) if progressive else self.transfer_timeout_s

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset({f.name for f in dataclasses.fields(cls) if f.name != "server"} | set(SERVER_KEYS))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> EngineSettings:
        """From a mapping of setting names to values (JSON types); ValueError names what is wrong."""
        unknown = sorted(str(k) for k in values if k not in cls.keys())
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; kvsvc takes {sorted(cls.keys())}")
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in values and f.name != "server":
                out[f.name] = _typed(values[f.name], f.default, f"{where}.{f.name}")
        settings = cls(**out)
        settings._check(where)
        if "model_id" in values and not settings.model_id:  # given, so meant: an empty one is a mistake
            raise ValueError(f"{where}.model_id must be 1 to {MAX_MODEL_ID} characters")
        try:
            server = server_settings(where, {k: values[k] for k in SERVER_KEYS if k in values})
        except KvsvcError as e:
            raise ValueError(e.message) from None
        return dataclasses.replace(settings, server=server)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], prefix: str) -> EngineSettings:
        """From environment variables <prefix><NAME> (NAME: a setting's name in capitals). A
        string setting takes the text as it is; any other value is read as JSON (a number,
        a list of strings), and a text that is not JSON stays a string (and is refused
        where a number is meant)."""
        strings = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, str)}
        values: dict[str, Any] = {}
        for name, text in environ.items():
            if name.startswith(prefix):
                key = name[len(prefix):].lower()
                values[key] = text if key in strings else _from_text(text)
        return cls.from_mapping(values, f"the environment ({prefix}*)")

    def _check(self, where: str) -> None:
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"{where}.listen_port must be a port number (0: any free port), not {self.listen_port}")
        if self.model_id and len(self.model_id) > MAX_MODEL_ID:
            raise ValueError(f"{where}.model_id must be 1 to {MAX_MODEL_ID} characters")
        if not 0 <= self.lease_heartbeat_s <= MAX_SECONDS:
            raise ValueError(f"{where}.lease_heartbeat_s must be a number of seconds from 0 (off) to "
                             f"{MAX_SECONDS:.0f}, not {self.lease_heartbeat_s}")
        for name in ("transfer_timeout_s", "stream_timeout_s"):
            if not 0 < getattr(self, name) <= MAX_SECONDS:
                raise ValueError(f"{where}.{name} must be more than 0 and at most {MAX_SECONDS:.0f} "
                                 f"seconds, not {getattr(self, name)}")
        if not 0 <= self.layer_commits <= MAX_LAYER_COMMITS:
            raise ValueError(f"{where}.layer_commits must be from 0 to {MAX_LAYER_COMMITS}, not {self.layer_commits}")
        if self.lease_ttl_ms < 0:
            raise ValueError(f"{where}.lease_ttl_ms must be 0 (the server's lease_ttl_s) or more, not {self.lease_ttl_ms}")


def _typed(value: Any, default: Any, name: str) -> Any:
    """value as the type of the setting's default: str, bool, int (never a bool or a fraction) or float."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, not {type(value).__name__} {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, not {type(value).__name__} {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name} must be a whole number, not {value!r}")
        return int(value)
    return float(value)


def _from_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
