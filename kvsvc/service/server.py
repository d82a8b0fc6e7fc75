"""Server lifecycle: create_server(config) -> (server, port), and serve() with signals."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvsvc import __version__
from kvsvc.config import Role, ServerConfig
from kvsvc.discovery.etcd import EtcdClient
from kvsvc.discovery.registry import Registration, ServerRecord
from kvsvc.errors import FailedPrecondition
from kvsvc.logs import as_json_line, json_lines
from kvsvc.loops import tell
from kvsvc.reasons import Reason
from kvsvc.service.decode import Decoder
from kvsvc.service.lease_socket import LeaseSocket
from kvsvc.service.local_socket import LocalSocket
from kvsvc.service.node import DataPlaneFactory, Node, nixl_data_plane
from kvsvc.service.servicer import KvTransferServicer, add_servicer
from kvsvc.service.siblings import Siblings
from kvsvc.service.stacks import install_stack_dump
from kvsvc.service.transfer_socket import TransferSocket
from kvsvc.transport.rdma_check import check_rdma
from kvsvc.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvTransferService"].full_name

# Keepalive the server permits; the client library's defaults stay inside it.
SERVER_OPTIONS_BASE = [
    # Never share a port with another process: two servers on one port would split traffic.
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


@dataclass
class RunningServer:
    """A started server: the grpc.aio server, its port, its node and health servicer."""

    server: grpc.aio.Server
    port: int
    node: Node
    health: health.aio.HealthServicer
    decoder: Decoder
    siblings: Siblings
    servicer: KvTransferServicer
    metrics_address: str = ""
    registration: Registration | None = None
    lease_socket: LeaseSocket | None = None
    transfer_socket: TransferSocket | None = None
    _stopped: bool = False

    async def stop(self, grace_s: float | None = None, drain_s: float | None = None, hold_claims: bool = True) -> None:
        """Idempotent shutdown, in order: NOT_SERVING, drain leases, drain RPCs, stop, release the node.

        hold_claims=False: leases still claimed when the drain runs out are not held to their
        deadlines (LeaseTable.drain) -- for a process whose memory goes with it, e.g. a test's
        servers; an engine that goes on after its server stopped must keep it True."""
        if self._stopped:
            return
        self._stopped = True
        if self.registration is not None:  # 0. gone from discovery first: routers pick others
            await self.registration.stop()
        await self.health.enter_graceful_shutdown()  # 1. routers stop sending new work
        # 2. no new publishes; claimed leases (D may be reading them) get drain_s to finish
        await self.node.leases.drain(self.node.config.drain_timeout_s if drain_s is None else drain_s,
                                     hold_claims=hold_claims)
        await self.servicer.close_lease_channels()  # D's notifications for those came in on them
        if self.lease_socket is not None:
            await self.lease_socket.close()
        self.servicer.close_transfer_streams()  # they answer what runs, then end
        if self.transfer_socket is not None:
            self.transfer_socket.close_sessions()  # the same for the engine's streams there
        grace = self.node.config.shutdown_grace_s if grace_s is None else grace_s
        # 3. in-flight RPCs (and the transfer socket's streams) finish within the grace period
        await asyncio.gather(self.server.stop(grace), *(
            [self.transfer_socket.drain(grace)] if self.transfer_socket is not None else []))
        await self.decoder.close()  # 4. transfers settle, peer channels close
        await self.siblings.close()
        await self.node.close()  # 5. leases, agents and pools go last, after no RPC can use them
        self.node.metrics.close()


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS with tls_client_ca_file) when a certificate is configured."""
    if not config.tls_cert_file:
        return None
    key, cert = Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes()
    ca = Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def create_server(
    config: ServerConfig, external_pools: Mapping[int, Any] | None = None,
    data_plane: DataPlaneFactory = nixl_data_plane,
) -> tuple[RunningServer, int]:
    """Build, bind and start a server; port 0 in config.listen picks a free port.

    Returns the running server (grpc.aio server, node, health; stop() shuts it down)
    and the bound port. external_pools embeds the server in an engine that owns its KV
    memory: rank -> one contiguous numpy array or torch tensor laid out like kvsvc's own
    pool, or rank -> a list of one buffer per region (the engine's per-layer tensors, or
    views of them), each holding the region's blocks on dimension 0. data_plane makes the
    data plane (NIXL's; see kvsvc/transport/ports.py for what another must do).
    """
    node = Node(config, external_pools, data_plane)
    decoder = Decoder(node)
    siblings = Siblings(node)
    server = grpc.aio.server(options=[
        *SERVER_OPTIONS_BASE,
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ])
    servicer = KvTransferServicer(node, decoder, siblings)
    add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    creds = server_credentials(config)
    host, port = _bind(server, config, creds)
    node.bind(f"{host}:{port}")
    try:
        await node.start()
    except BaseException:
        await server.stop(0)
        raise
    node.rdma = check_rdma(config.require_rdma_between_nodes, os.environ)
    if node.rdma.unavailable_reason:
        log.warning("%s: %s", Reason.TRANSPORT_DEGRADED, node.rdma.unavailable_reason)
    await server.start()
    await _serving(health_servicer, node)
    if creds is None:
        # `kvsvc serve` logs to stderr at WARNING and above: this reaches the operator's terminal.
        log.warning("PLAINTEXT: %s:%d has no TLS, no authentication: any process that can reach it may publish, "
                    "transfer and read pool metadata (leases stay guarded by their tokens). Use this only on a "
                    "trusted network, or set tls_cert_file and tls_client_ca_file.", host, port)
    log.info("kvsvc %s serving %s on %s:%d", config.engine_id, config.role.value, host, port)
    running = RunningServer(server, port, node, health_servicer, decoder, siblings, servicer)
    _add_gauges(running)
    if creds is None:
        await _start_local_sockets(running)
    await _start_outside_links(running)
    return running, port


def _bind(server: grpc.aio.Server, config: ServerConfig, creds: grpc.ServerCredentials | None) -> tuple[str, int]:
    """Listen on config.listen: (host, bound port)."""
    try:
        port = server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
    except RuntimeError as e:  # grpc reports a failed bind this way
        raise FailedPrecondition(Reason.ADDRESS_IN_USE, f"cannot listen on {config.listen}: {e}; is another server "
                                 "running there?", {"listen": config.listen}) from e
    return config.listen.rsplit(":", 1)[0], port


async def _serving(health_servicer: health.aio.HealthServicer, node: Node) -> None:
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if node.data is not None:
        loop = asyncio.get_running_loop()
        # The NIXL thread ending on its own means no transfer can work: say so to health checks.
        node.data.on_dead(functools.partial(tell, loop, _mark_down, health_servicer, node))


async def _start_local_sockets(running: RunningServer) -> None:
    """The same-host sockets of a server without TLS (under TLS every call stays on gRPC,
    with the caller's certificate)."""
    node, config = running.node, running.node.config
    if node.data is None:
        return
    if config.lease_socket and config.role is not Role.DECODE:
        # Same-host D servers carry their lease calls here; offered in the handshake answer.
        lease_socket = LeaseSocket(running.servicer.lease_answers, config.max_message_bytes, node.epoch)
        if await _started(running, lease_socket, "D servers on this host"):
            running.lease_socket, node.lease_socket_path = lease_socket, lease_socket.path
    if config.transfer_socket and config.role is not Role.PREFILL:
        # This server's engine, on the same host, carries its transfers here; offered in GetInfo.
        transfer_socket = TransferSocket(running.decoder, config.max_message_bytes, node.epoch)
        if await _started(running, transfer_socket, "the engine's transfers"):
            running.transfer_socket, node.transfer_socket_path = transfer_socket, transfer_socket.path


async def _start_outside_links(running: RunningServer) -> None:
    """The metrics endpoint and the etcd registration, where configured; a failure stops
    the server (it would serve unseen)."""
    node, config = running.node, running.node.config
    if config.metrics_listen:
        try:
            running.metrics_address = node.metrics.serve(config.metrics_listen)
        except OSError as e:
            await running.stop(0, drain_s=0)
            raise FailedPrecondition(Reason.ADDRESS_IN_USE, f"cannot serve metrics on {config.metrics_listen}: {e}",
                                     {"metrics_listen": config.metrics_listen}) from e
    if config.etcd_endpoints:
        try:
            running.registration = await _register(config, node)
        except BaseException:
            await running.stop(0, drain_s=0)
            raise


def _say_ready(running: RunningServer, config: ServerConfig) -> None:
    """The lines on stdout that say where the server serves (the last one: it is ready), as
    JSON objects when the logs are JSON (each with the same "message" as the text line)."""
    bound = f"{config.listen.rsplit(':', 1)[0]}:{running.port}"
    advertised = f", advertised to peers as {running.node.address}" if running.node.address != bound else ""
    lines: list[tuple[str, dict[str, Any]]] = []
    if running.metrics_address:  # before the line that says the server is ready
        lines.append((f"kvsvc metrics on http://{running.metrics_address}/metrics",
                      {"event": "metrics", "metrics_url": f"http://{running.metrics_address}/metrics"}))
    lines.append((f"kvsvc listening on {bound}{advertised} (engine {config.engine_id}, TP ranks "
                  f"{list(config.ranks)}/{config.tp_size})",
                  {"event": "listening", "address": bound, "advertised_address": running.node.address,
                   "engine_id": config.engine_id, "ranks": list(config.ranks), "tp_size": config.tp_size}))
    for text, fields in lines:
        print(as_json_line(__name__, text, **fields) if json_lines() else text, flush=True)


async def _started(running: RunningServer, sock: LocalSocket, users: str) -> bool:
    """Start a same-host socket; False (a warning, the server serves without it: it is an
    optimisation only) when the temp dir cannot hold it."""
    try:
        await sock.start()
    except OSError as e:
        log.warning("no %s (%s): %s will use gRPC", sock.name, e, users)
        return False
    except BaseException:
        await running.stop(0, drain_s=0)
        raise
    return True


async def _register(config: ServerConfig, node: Node) -> Registration:
    """Put this server in etcd (kept alive while it runs); fails the start if etcd does not answer."""
    record = ServerRecord(engine_id=config.engine_id, role=config.role.value, tp_size=config.tp_size,
                          ranks=list(config.ranks), address=node.address, epoch=node.epoch,
                          layout_hash=node.layout_hash, dcp_size=node.layout.dcp_size, server_version=__version__)
    reg = Registration(EtcdClient(config.etcd_endpoints), record, config.etcd_ttl_s, config.etcd_prefix)
    await reg.start()
    return reg


def _add_gauges(running: RunningServer) -> None:
    m, node, decoder = running.node.metrics, running.node, running.decoder
    m.gauge("kvsvc_live_leases", "Leases this P server holds (offered or claimed)", lambda: node.leases.live_count)
    m.gauge("kvsvc_claimed_leases", "Leases claimed by a D server (READs may be in flight)",
            lambda: node.leases.claimed_count)
    m.gauge("kvsvc_waiting_claims", "Claims this P server holds waiting for leases its engine has not made yet",
            lambda: node.leases.arrivals.waiting)
    m.gauge("kvsvc_peers", "P servers this D server has handshaken with", lambda: decoder.peers.cached)
    m.gauge("kvsvc_transport_degraded_peers", "P servers whose READs use a transport below what the pair should "
            "use (TRANSPORT_DEGRADED)", lambda: sum(1 for p in decoder.peers.listing()
                                                    if p.transport is not None and p.transport.warning_reason))
    m.gauge("kvsvc_rdma_unavailable", "1 when require_rdma_between_nodes is set and this node cannot read over RDMA "
            "(no RDMA device, or UCX_TLS without one; found at start, TRANSPORT_DEGRADED)",
            lambda: 1 if node.rdma.unavailable_reason else 0)
    m.gauge("kvsvc_running_transfers", "Transfers running on this D server", lambda: decoder.jobs.running)
    m.gauge("kvsvc_transfer_records", "Finished transfers this D server remembers with their outcome (WaitTransfer, "
            "retries)", lambda: decoder.jobs.remembered)
    m.gauge("kvsvc_transfer_record_bytes", "What those records cost this D server, estimated (the bound of "
            "64 MiB is on this figure; benchmarks/record_memory.py checks it against RSS)",
            lambda: decoder.jobs.remembered_bytes)
    m.gauge("kvsvc_quarantined_transfers", "Failed transfers on this D server whose READs may still land: their "
            "local blocks are not free until these end", lambda: decoder.jobs.quarantined)
    m.gauge("kvsvc_quarantined_bytes", "Bytes of the engine's blocks that quarantined transfers' READs may still "
            "write (the transfers' whole requests: none of their blocks is free)",
            lambda: decoder.jobs.quarantined_bytes)
    m.gauge("kvsvc_nixl_remote_agents", "Remote NIXL agents loaded here (peers' ranks, on every copy lane)",
            lambda: node.data.remote_agents if node.data is not None else 0)


def _mark_down(health_servicer: health.aio.HealthServicer, node: Node) -> None:
    log.error("data plane down (the NIXL thread stopped): health is NOT_SERVING")
    node.health_tasks.update(
        asyncio.ensure_future(health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
        for name in ("", SERVICE_NAME))


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    if config.otlp_endpoint:  # the process's tracer provider: an embedding engine sets its own
        from kvsvc.service.tracing import install_otlp

        install_otlp(config.otlp_endpoint, f"kvsvc-{config.engine_id}")
    # Signals first: a supervisor may send SIGTERM the moment it reads the "listening" line
    # below, and a SIGTERM before the handler exists would kill the process without unlinking
    # its pools. One during the start is kept and acted on once the server is up.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    install_stack_dump(loop)  # kill -USR1: where every thread and task is waiting
    running, _ = await create_server(config)
    # What the start made (gRPC, NIXL, protobuf, numpy, the pools' bookkeeping) lives as long
    # as the server: out of the collector's sight, a full collection scans only what came
    # after. Measured here: those took 20-36 ms of the event loop each, stalling every
    # transfer in flight; an engine that embeds a server keeps its own GC policy.
    gc.collect()
    gc.freeze()
    _say_ready(running, config)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        await running.stop()


def run(config: ServerConfig) -> None:
    """Blocking entry point: serve() on a uvloop event loop when uvloop is installed."""
    factory: Callable[[], asyncio.AbstractEventLoop]
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a server dependency
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(config))
