"""The kvsvc exception tree; pure (no grpc), mapped to google.rpc.Status by the service.

    KvsvcError                      reason, message, code, metadata, field violations
    ├── InvalidArgument             the request itself is malformed (INVALID_ARGUMENT)
    ├── FailedPrecondition          valid request, wrong state or incompatible peer
    ├── NotFound                    no such engine, lease or rank (NOT_FOUND)
    ├── PermissionDenied            the peer is not allowed to read this server's KV
    ├── Unavailable                 a peer or the data plane cannot be reached
    ├── DeadlineExceeded            the transfer did not finish in time
    └── Internal                    a bug or a failed transfer (TRANSFER_FAILED)

Reasons are UPPER_SNAKE strings (LAYOUT_MISMATCH, TP_NOT_DIVISIBLE, LEASE_EXPIRED, ...);
metadata values are strings so they travel in google.rpc.ErrorInfo unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DOMAIN = "kvsvc"


class ErrorCode(enum.Enum):
    """Canonical status codes kvsvc uses (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"


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


class DeadlineExceeded(KvsvcError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Internal(KvsvcError):
    code = ErrorCode.INTERNAL


def lease_not_yet_made(e: BaseException) -> bool:
    """P has never heard of the lease (and keeps no tombstone of it): not made yet -- params
    with lease_pending are handed out before the engine's servers lease the blocks -- or
    released so long ago that P forgot it."""
    return isinstance(e, KvsvcError) and e.reason == "LEASE_EXPIRED" and e.metadata.get("state") == "unknown"
