"""Who may call what: engines, peer servers, and anyone (see docs/SECURITY.md).

- An engine (the local P or D engine) publishes leases, watches releases, runs
  transfers, asks for their settled state and sees the pools it can attach. Under
  mutual TLS its certificate must name one of allowed_engines (default: this server's
  own engine id: an engine and its kvsvc servers share an identity).
- A peer server (the D server of another engine) handshakes, claims and notifies. With
  allowed_peers set only those engine ids may, and under mutual TLS the certificate must
  name the engine id the request claims.
- Anyone who can connect (under mTLS: anyone with a certificate from the CA) may read
  the public part of GetInfo (no pools), call PlanTransfer (pure, bounded) and Health.

Leases are protected on top of this by secrets, in every mode: a lease token handed out
in TransferParams and the claim id of the transfer that owns the lease.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvsvc.errors import PermissionDenied
from kvsvc.limits import clip
from kvsvc.reasons import Reason
from kvsvc.service.node import Node


def caller_names(context: grpc.aio.ServicerContext) -> list[str]:
    """Names in the caller's TLS certificate (common name and DNS names); empty without mTLS."""
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def mutual_tls(node: Node) -> bool:
    return bool(node.config.tls_client_ca_file)


def engine_names(node: Node) -> tuple[str, ...]:
    return node.config.allowed_engines or (node.config.engine_id,)


def is_engine(node: Node, names: Sequence[str]) -> bool:
    """Whether the caller may act as this server's engine (always, without mutual TLS)."""
    return not mutual_tls(node) or any(n in engine_names(node) for n in names)


def require_engine(node: Node, names: Sequence[str], what: str) -> None:
    if not is_engine(node, names):
        raise PermissionDenied(Reason.NOT_AN_ENGINE, f"only this server's engine may {what} (certificate names "
                               f"{clip(', '.join(names), 120) or 'none'}; allowed_engines: "
                               f"{', '.join(engine_names(node))})", {"what": what})


def require_peer(node: Node, engine_id: str, names: Sequence[str], what: str) -> None:
    """PEER_NOT_ALLOWED unless engine_id is allowed (and, under mTLS, named by its certificate).

    The handshake hands out NIXL metadata that lets the caller read this server's KV
    memory, so it is the gate; claims and notifications are checked the same way.
    """
    allowed = node.config.allowed_peers
    if not allowed:
        return
    if engine_id not in allowed:
        raise PermissionDenied(Reason.PEER_NOT_ALLOWED, f"engine {clip(engine_id, 64)!r} may not {what} here",
                               {"engine_id": engine_id})
    if mutual_tls(node) and engine_id not in names:
        raise PermissionDenied(Reason.PEER_NOT_ALLOWED, f"engine {clip(engine_id, 64)!r} does not match its certificate "
                               f"({clip(', '.join(names), 120) or 'none'})", {"engine_id": engine_id})
