"""`kvsvc health ADDRESS`: the gRPC health check, for probes that must speak (m)TLS.

Kubernetes' own gRPC probe cannot present a client certificate; this command can, so a
probe of a mutual-TLS server is `exec: kvsvc health --ca ... --cert ... --key ...`.
Exit 0 when the server answers SERVING, 1 otherwise (NOT_SERVING while draining, or
unreachable), with one line saying which.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsvc.client import AsyncClient, ClientOptions


async def _check(address: str, options: ClientOptions, service: str) -> int:
    async with AsyncClient(address, options) as client:
        stub = health_pb2_grpc.HealthStub(client.channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=options.timeout_s)
        except grpc.aio.AioRpcError as e:
            hint = ""
            if e.code() is grpc.StatusCode.UNAVAILABLE and not options.tls_root_certs:
                hint = " (if the server speaks TLS, give --ca, and --cert/--key for mutual TLS)"
            print(f"kvsvc health: {address}: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def run_health(address: str, options: ClientOptions, service: str = "") -> int:
    return asyncio.run(_check(address, options, service))
