"""KvsvcError -> google.rpc.Status (ErrorInfo + BadRequest) at the gRPC boundary."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvsvc.errors import DOMAIN, ErrorCode, InvalidArgument, KvsvcError
from kvsvc.limits import METADATA_VALUE_CHARS, STATUS_MESSAGE_CHARS, clip
from kvsvc.reasons import Reason

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Malformed:
    """What the tolerant deserializer hands the servicer for bytes that do not parse."""

    message_type: str
    size: int
    problem: str

    def error(self) -> InvalidArgument:
        return InvalidArgument(Reason.MALFORMED_REQUEST, f"the request is not a valid {self.message_type} "
                               f"({self.size} bytes): {clip(self.problem, 200)}",
                               {"message_type": self.message_type, "size": self.size})


def to_status(err: KvsvcError) -> status_pb2.Status:
    """The rich status of an error: one ErrorInfo, a BadRequest for bad fields, extra details.

    Messages and metadata values are clipped: whatever a caller sent, the status stays
    far below gRPC's metadata limit (an oversized one would reach the caller untyped).
    """
    details = []
    info = any_pb2.Any()
    metadata = {clip(k, 64): clip(v, METADATA_VALUE_CHARS) for k, v in list(err.metadata.items())[:16]}
    info.Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=metadata))
    details.append(info)
    if err.field_violations:
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=clip(v.field, 200), description=clip(v.description, 400))
            for v in err.field_violations[:8]])
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    for extra in err.details:
        if isinstance(extra, Message):
            packed = any_pb2.Any()
            packed.Pack(extra)
            details.append(packed)
    return status_pb2.Status(code=getattr(code_pb2, err.code.value), message=clip(str(err), STATUS_MESSAGE_CHARS),
                             details=details)


def grpc_code(code: ErrorCode) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code.value)  # type: ignore[no-any-return]


def rpc_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap a servicer method: KvsvcError becomes its rich status; a bug becomes INTERNAL.

    The server never crashes on a request: anything unexpected is logged and answered.
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            if isinstance(request, Malformed):
                raise request.error()
            return await method(self, request, context)
        except KvsvcError as e:
            log.info("%s failed: %s", method.__name__, clip(str(e), 300))
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # a bug: answer INTERNAL, keep serving
            log.exception("%s crashed", method.__name__)
            err = KvsvcError(Reason.INTERNAL, f"internal error in {method.__name__}: {type(e).__name__}: {e}")
            await context.abort_with_status(rpc_status.to_status(to_status(err)))
        raise AssertionError("unreachable")

    return wrapper
