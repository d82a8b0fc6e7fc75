"""The kvsvc server inside one SGLang TP worker: integrations/embedded.py's EmbeddedServer,
configured from SGLang's arguments and kvsvc's settings (integrations/settings.py, read
from KVSVC_SGLANG_* when the backend starts).

Every method is called from SGLang's threads and never blocks them for longer than one hop
to the server's loop, except start() and stop().
"""

from __future__ import annotations

import dataclasses
import logging

from kvsvc.config import Role, load_config
from kvsvc.integrations.description import CacheDescription
from kvsvc.integrations.embedded import EmbeddedServer, host_port
from kvsvc.integrations.settings import EngineSettings
from kvsvc.service.in_process import ReleaseCallback

log = logging.getLogger("sglang.kvsvc")

__all__ = ["SGLangServer", "host_port"]


class SGLangServer(EmbeddedServer):
    def __init__(self, *, engine_id: str, role: Role, tp_rank: int, tp_size: int,
                 description: CacheDescription, host: str, settings: EngineSettings | None = None,
                 on_release: ReleaseCallback | None = None) -> None:
        """host: the address SGLang uses for this worker (listened on and advertised unless
        the settings name others)."""
        settings = settings or EngineSettings()
        listen_host = settings.listen_host or host
        port = settings.listen_port + tp_rank if settings.listen_port else 0
        config = load_config(settings.config or None, listen=host_port(listen_host, port), engine_id=engine_id,
                             role=role, tp_size=tp_size, ranks=[tp_rank], engine_layout=description.layout,
                             **settings.server)
        metrics_host, _, metrics_port = config.metrics_listen.rpartition(":")
        if metrics_port.isdigit() and int(metrics_port):  # one engine, several workers: a fixed port is rank 0's
            config = dataclasses.replace(config, metrics_listen=f"{metrics_host}:{int(metrics_port) + tp_rank}")
        super().__init__(config, description, advertise_host=settings.advertise_host or listen_host,
                         on_release=on_release, log=log,
                         name=f"kvsvc-sglang-{role.value}-{tp_rank}")
        self.engine_id, self.role, self.tp_size = engine_id, role, tp_size

    def start(self) -> None:
        super().start()
        metrics = self.metrics_address
        log.info("kvsvc: SGLang %s rank %d serves its KV at %s%s", self.role.value, self.tp_rank, self.address,
                 f" (metrics at http://{metrics}/metrics)" if metrics else "")
