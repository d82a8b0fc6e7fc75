"""grpc errors -> kvsvc errors: the reason, metadata and details of the server's google.rpc.Status."""

from __future__ import annotations

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvsvc.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    KvsvcError,
    NotFound,
    PermissionDenied,
    Unavailable,
    Unimplemented,
    Unreachable,
)
from kvsvc.reasons import Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

# A call that ended with no kvsvc answer -- its status has no ErrorInfo, so the reason is the
# code's name -- becomes a type its callers can branch on: only Unreachable may be retried.
_NO_ANSWER: dict[str, type[Unreachable | Cancelled | Unimplemented]] = {
    Reason.UNAVAILABLE: Unreachable, Reason.CANCELLED: Cancelled, Reason.UNIMPLEMENTED: Unimplemented}

_BY_CODE: dict[grpc.StatusCode, type[KvsvcError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.DATA_LOSS: DataLoss,
}


def error_from_rpc(err: grpc.RpcError) -> KvsvcError:
    """The KvsvcError for a failed call, with ErrorInfo reason/metadata and extra details."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = err.details() if hasattr(err, "details") else str(err)
    try:
        status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None  # type: ignore[arg-type]
    except ValueError:  # a status whose message and details disagree: keep the plain code and message
        status = None
    return _error(code, message or "", status)


def error_from_status(status: status_pb2.Status) -> KvsvcError:
    """The KvsvcError of a google.rpc.Status carried in a message (a LeaseChannel answer)."""
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    return _error(code, status.message, status)


def _error(code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> KvsvcError:
    reason: str = code.name
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    details: list[Message] = []
    if status is not None:
        message = status.message
        for any_msg in status.details:
            if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_msg.Unpack(info)
                reason, metadata = info.reason, dict(info.metadata)
            elif any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                any_msg.Unpack(bad)
                violations = [FieldViolation(v.field, v.description) for v in bad.field_violations]
            elif any_msg.Is(pb.TransferFailure.DESCRIPTOR):
                failure: Message = pb.TransferFailure()
                any_msg.Unpack(failure)
                details.append(failure)
    message = (message or "").removeprefix(f"{reason}: ")  # the server prefixes its reason for grpcurl readers
    if reason == code.name and reason in _NO_ANSWER:  # the call itself ended, with no kvsvc reason
        e: KvsvcError = _NO_ANSWER[reason](message or "", metadata)
        e.grpc_code = code  # type: ignore[attr-defined]
        return e
    cls = _BY_CODE.get(code, KvsvcError)
    fallback = ErrorCode[code.name] if code.name in ErrorCode.__members__ else ErrorCode.INTERNAL
    e = cls(reason, message or "", metadata, violations, code=None if cls is not KvsvcError else fallback,
            details=details)
    e.grpc_code = code  # type: ignore[attr-defined]
    return e
