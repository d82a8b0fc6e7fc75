"""The kvsvc exception tree; pure (no grpc), mapped to google.rpc.Status by the service.

    KvsvcError                      reason, message, code, metadata, field violations
    ├── InvalidArgument             the request itself is malformed (INVALID_ARGUMENT)
    ├── FailedPrecondition          valid request, wrong state or incompatible peer
    ├── NotFound                    no such engine, lease or rank (NOT_FOUND)
    ├── PermissionDenied            the peer is not allowed to read this server's KV
    ├── Unavailable                 a peer or the data plane cannot be reached
    │   └── Unreachable             no kvsvc answer: not reached, or the connection broke
    ├── Cancelled                   the call was cancelled before any kvsvc answer
    ├── Unimplemented               the server does not serve the call (an older kvsvc)
    ├── DeadlineExceeded            the transfer did not finish in time
    └── Internal                    a bug or a failed transfer (TRANSFER_FAILED)

Reasons are the members of kvsvc.reasons.Reason (LAYOUT_MISMATCH, TP_NOT_DIVISIBLE,
LEASE_EXPIRED, ...), strings on the wire; metadata values are strings so they travel in
google.rpc.ErrorInfo unchanged. The three states code branches on -- not reached, cancelled,
not served -- are types, so no caller compares a reason to find them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvsvc.reasons import ErrorCode as ErrorCode  # re-exported: callers import the codes with the errors
from kvsvc.reasons import Reason

DOMAIN = "kvsvc"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad field of a request (becomes google.rpc.BadRequest.FieldViolation)."""

    field: str
    description: str


class KvsvcError(Exception):
    """Base of every kvsvc error: a reason code, a human message and the offending values."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        reason: str,
        message: str,
        metadata: Mapping[str, object] | None = None,
        field_violations: Sequence[FieldViolation] = (),
        code: ErrorCode | None = None,
        details: Sequence[object] = (),
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.field_violations = tuple(field_violations)
        self.details = tuple(details)
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class InvalidArgument(KvsvcError):
    code = ErrorCode.INVALID_ARGUMENT


class FailedPrecondition(KvsvcError):
    code = ErrorCode.FAILED_PRECONDITION


class NotFound(KvsvcError):
    code = ErrorCode.NOT_FOUND


class PermissionDenied(KvsvcError):
    code = ErrorCode.PERMISSION_DENIED


class Unavailable(KvsvcError):
    code = ErrorCode.UNAVAILABLE


class Unreachable(Unavailable):
    """No kvsvc answer: the server was not reached, or the connection to it broke (or was
    closed) before it answered. Reason UNAVAILABLE. A server's own UNAVAILABLE answers
    (PEER_UNAVAILABLE, SHUTTING_DOWN, ...) are answers, not this: only this one may be
    retried elsewhere or on a fresh connection."""

    def __init__(self, message: str, metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(Reason.UNAVAILABLE, message, metadata)


class Cancelled(KvsvcError):
    """The call was cancelled (by either end) before any kvsvc answer. Reason CANCELLED."""

    code = ErrorCode.CANCELLED

    def __init__(self, message: str, metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(Reason.CANCELLED, message, metadata)


class Unimplemented(KvsvcError):
    """The server does not serve the call (a kvsvc from before it). Reason UNIMPLEMENTED."""

    code = ErrorCode.UNIMPLEMENTED

    def __init__(self, message: str, metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(Reason.UNIMPLEMENTED, message, metadata)


class DeadlineExceeded(KvsvcError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Internal(KvsvcError):
    code = ErrorCode.INTERNAL


class DataLoss(KvsvcError):
    """Bytes arrived that differ from what was sent (DIGEST_MISMATCH)."""

    code = ErrorCode.DATA_LOSS


def lease_not_yet_made(e: BaseException) -> bool:
    """P has never heard of the lease (and keeps no tombstone of it): not made yet -- params
    with lease_pending are handed out before the engine's servers lease the blocks -- or
    released so long ago that P forgot it."""
    return isinstance(e, KvsvcError) and e.reason == Reason.LEASE_EXPIRED and e.metadata.get("state") == "unknown"
