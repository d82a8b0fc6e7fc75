"""The reasons kvsvc's errors carry, and the gRPC code each goes with. Pure (no grpc).

Every error kvsvc answers is a gRPC status whose google.rpc.ErrorInfo (domain "kvsvc")
carries one of these reasons, its offending values in the metadata. The proto lists the
same names with what each means (enum ErrorReason in protos/kvsvc/v1/kv_transfer.proto,
value ERROR_REASON_<reason>) so that clients in any language can name them;
tests/unit/test_reasons.py keeps the two lists equal and checks that every error kvsvc
raises goes with its reason's code.

Code compares a reason with a member (``err.reason == Reason.SOCKET_FULL``), never with a
string. Where it branches on how a call ended without a kvsvc answer -- the server not
reached, the call cancelled, the call not served -- it asks the error's type instead
(``errors.Unreachable``, ``errors.Cancelled``, ``errors.Unimplemented``).
"""

from __future__ import annotations

import enum


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
    DATA_LOSS = "DATA_LOSS"


_IA, _FP, _PD = ErrorCode.INVALID_ARGUMENT, ErrorCode.FAILED_PRECONDITION, ErrorCode.PERMISSION_DENIED
_UA, _DE, _IN, _AE = ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.INTERNAL, ErrorCode.ALREADY_EXISTS
_RE, _CA, _UI = ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.CANCELLED, ErrorCode.UNIMPLEMENTED
_DL = ErrorCode.DATA_LOSS


class Reason(enum.StrEnum):
    """An ErrorInfo reason (the member is the string itself) and its gRPC code(s).

    A reason has one code, except the two that name one rule met in two places: the
    first code is where engines pair, the second where a request or config breaks it.
    """

    codes: tuple[ErrorCode, ...]

    def __new__(cls, value: str, *codes: ErrorCode) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.codes = codes
        return member

    @property
    def code(self) -> ErrorCode:
        return self.codes[0]

    # A request's fields
    MALFORMED_REQUEST = "MALFORMED_REQUEST", _IA
    MISSING_FIELD = "MISSING_FIELD", _IA
    INVALID_FIELD = "INVALID_FIELD", _IA
    UNSPECIFIED_ENUM = "UNSPECIFIED_ENUM", _IA
    FIELD_TOO_LARGE = "FIELD_TOO_LARGE", _IA
    INVALID_ARGUMENT = "INVALID_ARGUMENT", _IA
    BAD_TRANSFER_PARAMS = "BAD_TRANSFER_PARAMS", _IA
    PARAMS_INCONSISTENT = "PARAMS_INCONSISTENT", _IA
    INVALID_TP_SIZE = "INVALID_TP_SIZE", _IA
    INVALID_DCP_SIZE = "INVALID_DCP_SIZE", _IA
    INVALID_ENGINE_ID = "INVALID_ENGINE_ID", _IA
    BLOCK_COUNT_MISMATCH = "BLOCK_COUNT_MISMATCH", _IA
    BLOCK_OUT_OF_RANGE = "BLOCK_OUT_OF_RANGE", _IA
    DUPLICATE_BLOCK_ID = "DUPLICATE_BLOCK_ID", _IA
    UNKNOWN_GROUP = "UNKNOWN_GROUP", _IA
    NUM_TOKENS_REQUIRED = "NUM_TOKENS_REQUIRED", _IA
    RANK_OUT_OF_RANGE = "RANK_OUT_OF_RANGE", _IA
    RANK_NOT_HOSTED = "RANK_NOT_HOSTED", _IA
    RANK_NOT_CLAIMED = "RANK_NOT_CLAIMED", _IA
    CLAIM_CONFLICT = "CLAIM_CONFLICT", _IA
    LEASE_TTL_TOO_LONG = "LEASE_TTL_TOO_LONG", _IA
    TP_MISMATCH = "TP_MISMATCH", _IA

    # Layouts and configuration
    INVALID_CONFIG = "INVALID_CONFIG", _IA
    INVALID_LAYOUT = "INVALID_LAYOUT", _IA
    UNKNOWN_LAYOUT_KEY = "UNKNOWN_LAYOUT_KEY", _IA
    UNKNOWN_SPEC_TYPE = "UNKNOWN_SPEC_TYPE", _IA
    UNKNOWN_DTYPE = "UNKNOWN_DTYPE", _IA
    EMPTY_GROUP = "EMPTY_GROUP", _IA
    NESTED_UNIFORM_GROUP = "NESTED_UNIFORM_GROUP", _IA
    LAYOUT_HASH_MISMATCH = "LAYOUT_HASH_MISMATCH", _IA
    UNSUPPORTED_KV_LAYOUT = "UNSUPPORTED_KV_LAYOUT", _FP
    MIXED_FAMILY_GROUP = "MIXED_FAMILY_GROUP", _FP

    # Two engines that cannot pair
    TP_NOT_DIVISIBLE = "TP_NOT_DIVISIBLE", _FP, _IA
    DCP_NOT_DIVISIBLE = "DCP_NOT_DIVISIBLE", _FP
    DCP_MISMATCH = "DCP_MISMATCH", _FP, _IA
    MODEL_MISMATCH = "MODEL_MISMATCH", _FP
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH", _FP  # retired (RETIRED)
    REGION_LAYOUT_MISMATCH = "REGION_LAYOUT_MISMATCH", _FP
    BLOCK_SIZE_MISMATCH = "BLOCK_SIZE_MISMATCH", _FP
    GROUP_MISMATCH = "GROUP_MISMATCH", _FP
    LAYER_COUNT_MISMATCH = "LAYER_COUNT_MISMATCH", _FP
    DTYPE_MISMATCH = "DTYPE_MISMATCH", _FP
    HEAD_SIZE_MISMATCH = "HEAD_SIZE_MISMATCH", _FP
    KV_HEADS_MISMATCH = "KV_HEADS_MISMATCH", _FP
    REGION_COUNT_MISMATCH = "REGION_COUNT_MISMATCH", _FP
    REGION_MISMATCH = "REGION_MISMATCH", _FP
    BLOCK_LEN_MISMATCH = "BLOCK_LEN_MISMATCH", _FP
    SSM_SHAPE_MISMATCH = "SSM_SHAPE_MISMATCH", _FP
    UNKNOWN_ENGINE = "UNKNOWN_ENGINE", _FP
    PEER_RANKS_MISSING = "PEER_RANKS_MISSING", _FP
    WRONG_ROLE = "WRONG_ROLE", _FP

    # Leases
    LEASE_EXISTS = "LEASE_EXISTS", _AE
    LEASE_EXPIRED = "LEASE_EXPIRED", _FP
    LEASE_ABORTED = "LEASE_ABORTED", _FP
    LEASE_CLAIMED = "LEASE_CLAIMED", _FP
    LEASE_NOT_CLAIMED = "LEASE_NOT_CLAIMED", _FP
    LEASE_NOT_OWNER = "LEASE_NOT_OWNER", _PD
    LEASE_TOKEN_MISMATCH = "LEASE_TOKEN_MISMATCH", _PD
    TOO_MANY_LEASES = "TOO_MANY_LEASES", _RE
    TOO_MANY_LEASED_BLOCKS = "TOO_MANY_LEASED_BLOCKS", _RE
    TOO_MANY_CLAIMS = "TOO_MANY_CLAIMS", _RE
    WATCH_BEHIND = "WATCH_BEHIND", _RE
    TOO_MANY_WAITING_CLAIMS = "TOO_MANY_WAITING_CLAIMS", _RE

    # Transfers
    TRANSFER_FAILED = "TRANSFER_FAILED", _IN
    TRANSFER_EXISTS = "TRANSFER_EXISTS", _AE
    TRANSFER_ON_STREAM = "TRANSFER_ON_STREAM", _AE
    TRANSFER_FENCED = "TRANSFER_FENCED", _FP
    TRANSFER_CANCELLED = "TRANSFER_CANCELLED", _CA
    TRANSFER_HISTORY_FULL = "TRANSFER_HISTORY_FULL", _RE
    TOO_MANY_TRANSFERS = "TOO_MANY_TRANSFERS", _RE
    ANSWERS_UNREAD = "ANSWERS_UNREAD", _RE
    SOCKET_FULL = "SOCKET_FULL", _RE

    # Trust
    NOT_AN_ENGINE = "NOT_AN_ENGINE", _PD
    PEER_NOT_ALLOWED = "PEER_NOT_ALLOWED", _PD

    # Servers, peers and the data plane
    UNAVAILABLE = "UNAVAILABLE", _UA
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE", _UA
    SIBLING_UNAVAILABLE = "SIBLING_UNAVAILABLE", _UA
    SHUTTING_DOWN = "SHUTTING_DOWN", _UA
    CLIENT_CLOSED = "CLIENT_CLOSED", _UA
    DATA_PLANE_UNAVAILABLE = "DATA_PLANE_UNAVAILABLE", _UA
    NIXL_UNAVAILABLE = "NIXL_UNAVAILABLE", _UA
    NIXL_ERROR = "NIXL_ERROR", _IN
    # A warning (TransportInfo.peers, a log line, a metric), never a call's error.
    TRANSPORT_DEGRADED = "TRANSPORT_DEGRADED", _FP
    DIGEST_MISMATCH = "DIGEST_MISMATCH", _DL
    COMMIT_CONFLICT = "COMMIT_CONFLICT", _FP
    COMMIT_OUT_OF_ORDER = "COMMIT_OUT_OF_ORDER", _FP
    LEASE_FINAL = "LEASE_FINAL", _FP
    LEASE_NOT_FINAL = "LEASE_NOT_FINAL", _FP
    LEASE_NOT_PROGRESSIVE = "LEASE_NOT_PROGRESSIVE", _FP
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED", _DE
    CANCELLED = "CANCELLED", _CA
    UNIMPLEMENTED = "UNIMPLEMENTED", _UI
    INTERNAL = "INTERNAL", _IN

    # Start-up and memory
    ADDRESS_IN_USE = "ADDRESS_IN_USE", _FP
    CUDA_UNAVAILABLE = "CUDA_UNAVAILABLE", _FP
    OTLP_UNAVAILABLE = "OTLP_UNAVAILABLE", _FP
    POOL_EXISTS = "POOL_EXISTS", _FP
    POOL_NOT_FOUND = "POOL_NOT_FOUND", _FP
    POOL_NO_MEMORY = "POOL_NO_MEMORY", _RE
    POOL_TOO_SMALL = "POOL_TOO_SMALL", _IA
    POOL_MISMATCH = "POOL_MISMATCH", _IA

    # Discovery (etcd)
    ETCD_ENDPOINTS_INVALID = "ETCD_ENDPOINTS_INVALID", _IA
    ETCD_TTL_INVALID = "ETCD_TTL_INVALID", _IA
    DISCOVERY_RECORD_INVALID = "DISCOVERY_RECORD_INVALID", _IA
    ETCD_ANSWER_TOO_BIG = "ETCD_ANSWER_TOO_BIG", _FP
    ETCD_ERROR = "ETCD_ERROR", _UA
    ETCD_UNAVAILABLE = "ETCD_UNAVAILABLE", _UA
    ETCD_WATCH_BROKEN = "ETCD_WATCH_BROKEN", _UA


# Reasons kvsvc no longer answers with, kept so that the wire enum and old clients keep
# their names. LAYOUT_MISMATCH: HND and NHD pools pair at any TP since the planner reads
# token rows where heads are not contiguous (MAPPING.md §4).
RETIRED = frozenset({Reason.LAYOUT_MISMATCH})
