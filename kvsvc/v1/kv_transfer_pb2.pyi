from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT8_E4M3: _ClassVar[Dtype]
    DTYPE_FLOAT8_E5M2: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]

class KvMemoryLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_MEMORY_LAYOUT_UNSPECIFIED: _ClassVar[KvMemoryLayout]
    KV_MEMORY_LAYOUT_HND: _ClassVar[KvMemoryLayout]
    KV_MEMORY_LAYOUT_NHD: _ClassVar[KvMemoryLayout]

class RegionLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_LAYOUT_UNSPECIFIED: _ClassVar[RegionLayout]
    REGION_LAYOUT_SPLIT_KV: _ClassVar[RegionLayout]
    REGION_LAYOUT_BLOCKS_FIRST: _ClassVar[RegionLayout]
    REGION_LAYOUT_PACKED_KV: _ClassVar[RegionLayout]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_KEY: _ClassVar[RegionKind]
    REGION_KIND_VALUE: _ClassVar[RegionKind]
    REGION_KIND_LATENT: _ClassVar[RegionKind]
    REGION_KIND_SSM_STATE: _ClassVar[RegionKind]
    REGION_KIND_KV: _ClassVar[RegionKind]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_MALFORMED_REQUEST: _ClassVar[ErrorReason]
    ERROR_REASON_MISSING_FIELD: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_FIELD: _ClassVar[ErrorReason]
    ERROR_REASON_UNSPECIFIED_ENUM: _ClassVar[ErrorReason]
    ERROR_REASON_FIELD_TOO_LARGE: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_BAD_TRANSFER_PARAMS: _ClassVar[ErrorReason]
    ERROR_REASON_PARAMS_INCONSISTENT: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_TP_SIZE: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_DCP_SIZE: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ENGINE_ID: _ClassVar[ErrorReason]
    ERROR_REASON_BLOCK_COUNT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_BLOCK_OUT_OF_RANGE: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_BLOCK_ID: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_GROUP: _ClassVar[ErrorReason]
    ERROR_REASON_NUM_TOKENS_REQUIRED: _ClassVar[ErrorReason]
    ERROR_REASON_RANK_OUT_OF_RANGE: _ClassVar[ErrorReason]
    ERROR_REASON_RANK_NOT_HOSTED: _ClassVar[ErrorReason]
    ERROR_REASON_RANK_NOT_CLAIMED: _ClassVar[ErrorReason]
    ERROR_REASON_CLAIM_CONFLICT: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_TTL_TOO_LONG: _ClassVar[ErrorReason]
    ERROR_REASON_TP_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_CONFIG: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_LAYOUT: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_LAYOUT_KEY: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_SPEC_TYPE: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_DTYPE: _ClassVar[ErrorReason]
    ERROR_REASON_EMPTY_GROUP: _ClassVar[ErrorReason]
    ERROR_REASON_NESTED_UNIFORM_GROUP: _ClassVar[ErrorReason]
    ERROR_REASON_LAYOUT_HASH_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_UNSUPPORTED_KV_LAYOUT: _ClassVar[ErrorReason]
    ERROR_REASON_MIXED_FAMILY_GROUP: _ClassVar[ErrorReason]
    ERROR_REASON_TP_NOT_DIVISIBLE: _ClassVar[ErrorReason]
    ERROR_REASON_DCP_NOT_DIVISIBLE: _ClassVar[ErrorReason]
    ERROR_REASON_DCP_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_LAYOUT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_REGION_LAYOUT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_BLOCK_SIZE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_LAYER_COUNT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_DTYPE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_HEAD_SIZE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_KV_HEADS_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_REGION_COUNT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_REGION_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_BLOCK_LEN_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_SSM_SHAPE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_ENGINE: _ClassVar[ErrorReason]
    ERROR_REASON_PEER_RANKS_MISSING: _ClassVar[ErrorReason]
    ERROR_REASON_WRONG_ROLE: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_EXPIRED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_ABORTED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_CLAIMED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_CLAIMED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_OWNER: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_TOKEN_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_LEASES: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_LEASED_BLOCKS: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_CLAIMS: _ClassVar[ErrorReason]
    ERROR_REASON_WATCH_BEHIND: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_ON_STREAM: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_FENCED: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_CANCELLED: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_HISTORY_FULL: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_TRANSFERS: _ClassVar[ErrorReason]
    ERROR_REASON_ANSWERS_UNREAD: _ClassVar[ErrorReason]
    ERROR_REASON_SOCKET_FULL: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_AN_ENGINE: _ClassVar[ErrorReason]
    ERROR_REASON_PEER_NOT_ALLOWED: _ClassVar[ErrorReason]
    ERROR_REASON_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_PEER_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_SIBLING_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_SHUTTING_DOWN: _ClassVar[ErrorReason]
    ERROR_REASON_CLIENT_CLOSED: _ClassVar[ErrorReason]
    ERROR_REASON_DATA_PLANE_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_NIXL_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_NIXL_ERROR: _ClassVar[ErrorReason]
    ERROR_REASON_DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_CANCELLED: _ClassVar[ErrorReason]
    ERROR_REASON_UNIMPLEMENTED: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]
    ERROR_REASON_ADDRESS_IN_USE: _ClassVar[ErrorReason]
    ERROR_REASON_CUDA_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_OTLP_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_POOL_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_POOL_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_POOL_NO_MEMORY: _ClassVar[ErrorReason]
    ERROR_REASON_POOL_TOO_SMALL: _ClassVar[ErrorReason]
    ERROR_REASON_POOL_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_ETCD_ENDPOINTS_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_ETCD_TTL_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_DISCOVERY_RECORD_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_ETCD_ANSWER_TOO_BIG: _ClassVar[ErrorReason]
    ERROR_REASON_ETCD_ERROR: _ClassVar[ErrorReason]
    ERROR_REASON_ETCD_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_ETCD_WATCH_BROKEN: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_WAITING_CLAIMS: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSPORT_DEGRADED: _ClassVar[ErrorReason]
    ERROR_REASON_DIGEST_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_COMMIT_CONFLICT: _ClassVar[ErrorReason]
    ERROR_REASON_COMMIT_OUT_OF_ORDER: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_FINAL: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_FINAL: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_PROGRESSIVE: _ClassVar[ErrorReason]

class NotifyKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOTIFY_KIND_UNSPECIFIED: _ClassVar[NotifyKind]
    NOTIFY_KIND_CONSUMED: _ClassVar[NotifyKind]
    NOTIFY_KIND_ABORTED: _ClassVar[NotifyKind]
    NOTIFY_KIND_HEARTBEAT: _ClassVar[NotifyKind]

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_OFFERED: _ClassVar[LeaseState]
    LEASE_STATE_CLAIMED: _ClassVar[LeaseState]
    LEASE_STATE_CONSUMED: _ClassVar[LeaseState]
    LEASE_STATE_EXPIRED: _ClassVar[LeaseState]
    LEASE_STATE_ABORTED: _ClassVar[LeaseState]
    LEASE_STATE_UNKNOWN: _ClassVar[LeaseState]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_CONSUMED: _ClassVar[ReleaseReason]
    RELEASE_REASON_EXPIRED: _ClassVar[ReleaseReason]
    RELEASE_REASON_ABORTED: _ClassVar[ReleaseReason]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_UNKNOWN: _ClassVar[TransferState]
    TRANSFER_STATE_RUNNING: _ClassVar[TransferState]
    TRANSFER_STATE_SUCCEEDED: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_QUARANTINED: _ClassVar[TransferState]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT8_E4M3: Dtype
DTYPE_FLOAT8_E5M2: Dtype
DTYPE_UINT8: Dtype
KV_MEMORY_LAYOUT_UNSPECIFIED: KvMemoryLayout
KV_MEMORY_LAYOUT_HND: KvMemoryLayout
KV_MEMORY_LAYOUT_NHD: KvMemoryLayout
REGION_LAYOUT_UNSPECIFIED: RegionLayout
REGION_LAYOUT_SPLIT_KV: RegionLayout
REGION_LAYOUT_BLOCKS_FIRST: RegionLayout
REGION_LAYOUT_PACKED_KV: RegionLayout
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_KEY: RegionKind
REGION_KIND_VALUE: RegionKind
REGION_KIND_LATENT: RegionKind
REGION_KIND_SSM_STATE: RegionKind
REGION_KIND_KV: RegionKind
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_MALFORMED_REQUEST: ErrorReason
ERROR_REASON_MISSING_FIELD: ErrorReason
ERROR_REASON_INVALID_FIELD: ErrorReason
ERROR_REASON_UNSPECIFIED_ENUM: ErrorReason
ERROR_REASON_FIELD_TOO_LARGE: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_BAD_TRANSFER_PARAMS: ErrorReason
ERROR_REASON_PARAMS_INCONSISTENT: ErrorReason
ERROR_REASON_INVALID_TP_SIZE: ErrorReason
ERROR_REASON_INVALID_DCP_SIZE: ErrorReason
ERROR_REASON_INVALID_ENGINE_ID: ErrorReason
ERROR_REASON_BLOCK_COUNT_MISMATCH: ErrorReason
ERROR_REASON_BLOCK_OUT_OF_RANGE: ErrorReason
ERROR_REASON_DUPLICATE_BLOCK_ID: ErrorReason
ERROR_REASON_UNKNOWN_GROUP: ErrorReason
ERROR_REASON_NUM_TOKENS_REQUIRED: ErrorReason
ERROR_REASON_RANK_OUT_OF_RANGE: ErrorReason
ERROR_REASON_RANK_NOT_HOSTED: ErrorReason
ERROR_REASON_RANK_NOT_CLAIMED: ErrorReason
ERROR_REASON_CLAIM_CONFLICT: ErrorReason
ERROR_REASON_LEASE_TTL_TOO_LONG: ErrorReason
ERROR_REASON_TP_MISMATCH: ErrorReason
ERROR_REASON_INVALID_CONFIG: ErrorReason
ERROR_REASON_INVALID_LAYOUT: ErrorReason
ERROR_REASON_UNKNOWN_LAYOUT_KEY: ErrorReason
ERROR_REASON_UNKNOWN_SPEC_TYPE: ErrorReason
ERROR_REASON_UNKNOWN_DTYPE: ErrorReason
ERROR_REASON_EMPTY_GROUP: ErrorReason
ERROR_REASON_NESTED_UNIFORM_GROUP: ErrorReason
ERROR_REASON_LAYOUT_HASH_MISMATCH: ErrorReason
ERROR_REASON_UNSUPPORTED_KV_LAYOUT: ErrorReason
ERROR_REASON_MIXED_FAMILY_GROUP: ErrorReason
ERROR_REASON_TP_NOT_DIVISIBLE: ErrorReason
ERROR_REASON_DCP_NOT_DIVISIBLE: ErrorReason
ERROR_REASON_DCP_MISMATCH: ErrorReason
ERROR_REASON_MODEL_MISMATCH: ErrorReason
ERROR_REASON_LAYOUT_MISMATCH: ErrorReason
ERROR_REASON_REGION_LAYOUT_MISMATCH: ErrorReason
ERROR_REASON_BLOCK_SIZE_MISMATCH: ErrorReason
ERROR_REASON_GROUP_MISMATCH: ErrorReason
ERROR_REASON_LAYER_COUNT_MISMATCH: ErrorReason
ERROR_REASON_DTYPE_MISMATCH: ErrorReason
ERROR_REASON_HEAD_SIZE_MISMATCH: ErrorReason
ERROR_REASON_KV_HEADS_MISMATCH: ErrorReason
ERROR_REASON_REGION_COUNT_MISMATCH: ErrorReason
ERROR_REASON_REGION_MISMATCH: ErrorReason
ERROR_REASON_BLOCK_LEN_MISMATCH: ErrorReason
ERROR_REASON_SSM_SHAPE_MISMATCH: ErrorReason
ERROR_REASON_UNKNOWN_ENGINE: ErrorReason
ERROR_REASON_PEER_RANKS_MISSING: ErrorReason
ERROR_REASON_WRONG_ROLE: ErrorReason
ERROR_REASON_LEASE_EXISTS: ErrorReason
ERROR_REASON_LEASE_EXPIRED: ErrorReason
ERROR_REASON_LEASE_ABORTED: ErrorReason
ERROR_REASON_LEASE_CLAIMED: ErrorReason
ERROR_REASON_LEASE_NOT_CLAIMED: ErrorReason
ERROR_REASON_LEASE_NOT_OWNER: ErrorReason
ERROR_REASON_LEASE_TOKEN_MISMATCH: ErrorReason
ERROR_REASON_TOO_MANY_LEASES: ErrorReason
ERROR_REASON_TOO_MANY_LEASED_BLOCKS: ErrorReason
ERROR_REASON_TOO_MANY_CLAIMS: ErrorReason
ERROR_REASON_WATCH_BEHIND: ErrorReason
ERROR_REASON_TRANSFER_FAILED: ErrorReason
ERROR_REASON_TRANSFER_EXISTS: ErrorReason
ERROR_REASON_TRANSFER_ON_STREAM: ErrorReason
ERROR_REASON_TRANSFER_FENCED: ErrorReason
ERROR_REASON_TRANSFER_CANCELLED: ErrorReason
ERROR_REASON_TRANSFER_HISTORY_FULL: ErrorReason
ERROR_REASON_TOO_MANY_TRANSFERS: ErrorReason
ERROR_REASON_ANSWERS_UNREAD: ErrorReason
ERROR_REASON_SOCKET_FULL: ErrorReason
ERROR_REASON_NOT_AN_ENGINE: ErrorReason
ERROR_REASON_PEER_NOT_ALLOWED: ErrorReason
ERROR_REASON_UNAVAILABLE: ErrorReason
ERROR_REASON_PEER_UNAVAILABLE: ErrorReason
ERROR_REASON_SIBLING_UNAVAILABLE: ErrorReason
ERROR_REASON_SHUTTING_DOWN: ErrorReason
ERROR_REASON_CLIENT_CLOSED: ErrorReason
ERROR_REASON_DATA_PLANE_UNAVAILABLE: ErrorReason
ERROR_REASON_NIXL_UNAVAILABLE: ErrorReason
ERROR_REASON_NIXL_ERROR: ErrorReason
ERROR_REASON_DEADLINE_EXCEEDED: ErrorReason
ERROR_REASON_CANCELLED: ErrorReason
ERROR_REASON_UNIMPLEMENTED: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
ERROR_REASON_ADDRESS_IN_USE: ErrorReason
ERROR_REASON_CUDA_UNAVAILABLE: ErrorReason
ERROR_REASON_OTLP_UNAVAILABLE: ErrorReason
ERROR_REASON_POOL_EXISTS: ErrorReason
ERROR_REASON_POOL_NOT_FOUND: ErrorReason
ERROR_REASON_POOL_NO_MEMORY: ErrorReason
ERROR_REASON_POOL_TOO_SMALL: ErrorReason
ERROR_REASON_POOL_MISMATCH: ErrorReason
ERROR_REASON_ETCD_ENDPOINTS_INVALID: ErrorReason
ERROR_REASON_ETCD_TTL_INVALID: ErrorReason
ERROR_REASON_DISCOVERY_RECORD_INVALID: ErrorReason
ERROR_REASON_ETCD_ANSWER_TOO_BIG: ErrorReason
ERROR_REASON_ETCD_ERROR: ErrorReason
ERROR_REASON_ETCD_UNAVAILABLE: ErrorReason
ERROR_REASON_ETCD_WATCH_BROKEN: ErrorReason
ERROR_REASON_TOO_MANY_WAITING_CLAIMS: ErrorReason
ERROR_REASON_TRANSPORT_DEGRADED: ErrorReason
ERROR_REASON_DIGEST_MISMATCH: ErrorReason
ERROR_REASON_COMMIT_CONFLICT: ErrorReason
ERROR_REASON_COMMIT_OUT_OF_ORDER: ErrorReason
ERROR_REASON_LEASE_FINAL: ErrorReason
ERROR_REASON_LEASE_NOT_FINAL: ErrorReason
ERROR_REASON_LEASE_NOT_PROGRESSIVE: ErrorReason
NOTIFY_KIND_UNSPECIFIED: NotifyKind
NOTIFY_KIND_CONSUMED: NotifyKind
NOTIFY_KIND_ABORTED: NotifyKind
NOTIFY_KIND_HEARTBEAT: NotifyKind
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_OFFERED: LeaseState
LEASE_STATE_CLAIMED: LeaseState
LEASE_STATE_CONSUMED: LeaseState
LEASE_STATE_EXPIRED: LeaseState
LEASE_STATE_ABORTED: LeaseState
LEASE_STATE_UNKNOWN: LeaseState
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_CONSUMED: ReleaseReason
RELEASE_REASON_EXPIRED: ReleaseReason
RELEASE_REASON_ABORTED: ReleaseReason
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_UNKNOWN: TransferState
TRANSFER_STATE_RUNNING: TransferState
TRANSFER_STATE_SUCCEEDED: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_QUARANTINED: TransferState

class FullAttentionSpec(_message.Message):
    __slots__ = ("num_kv_heads_per_rank", "head_size", "head_size_v", "dtype")
    NUM_KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_V_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_kv_heads_per_rank: int
    head_size: int
    head_size_v: int
    dtype: Dtype
    def __init__(self, num_kv_heads_per_rank: _Optional[int] = ..., head_size: _Optional[int] = ..., head_size_v: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class SlidingWindowSpec(_message.Message):
    __slots__ = ("num_kv_heads_per_rank", "head_size", "dtype", "sliding_window_tokens")
    NUM_KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_kv_heads_per_rank: int
    head_size: int
    dtype: Dtype
    sliding_window_tokens: int
    def __init__(self, num_kv_heads_per_rank: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., sliding_window_tokens: _Optional[int] = ...) -> None: ...

class MlaAttentionSpec(_message.Message):
    __slots__ = ("head_size", "dtype")
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    head_size: int
    dtype: Dtype
    def __init__(self, head_size: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class MambaStateSpec(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: Dtype
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class MambaSpec(_message.Message):
    __slots__ = ("states", "page_size_bytes")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedCompositeFieldContainer[MambaStateSpec]
    page_size_bytes: int
    def __init__(self, states: _Optional[_Iterable[_Union[MambaStateSpec, _Mapping]]] = ..., page_size_bytes: _Optional[int] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("layer_name", "spec")
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    layer_name: str
    spec: KvCacheSpec
    def __init__(self, layer_name: _Optional[str] = ..., spec: _Optional[_Union[KvCacheSpec, _Mapping]] = ...) -> None: ...

class UniformTypeSpecs(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ...) -> None: ...

class KvCacheSpec(_message.Message):
    __slots__ = ("full_attention", "sliding_window", "mla_attention", "mamba", "uniform_type")
    FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MLA_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_TYPE_FIELD_NUMBER: _ClassVar[int]
    full_attention: FullAttentionSpec
    sliding_window: SlidingWindowSpec
    mla_attention: MlaAttentionSpec
    mamba: MambaSpec
    uniform_type: UniformTypeSpecs
    def __init__(self, full_attention: _Optional[_Union[FullAttentionSpec, _Mapping]] = ..., sliding_window: _Optional[_Union[SlidingWindowSpec, _Mapping]] = ..., mla_attention: _Optional[_Union[MlaAttentionSpec, _Mapping]] = ..., mamba: _Optional[_Union[MambaSpec, _Mapping]] = ..., uniform_type: _Optional[_Union[UniformTypeSpecs, _Mapping]] = ...) -> None: ...

class KvCacheGroup(_message.Message):
    __slots__ = ("name", "spec", "layer_names", "num_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: KvCacheSpec
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    num_blocks: int
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[KvCacheSpec, _Mapping]] = ..., layer_names: _Optional[_Iterable[str]] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model_id", "total_num_kv_heads", "block_size_tokens", "num_blocks", "kv_memory_layout", "region_layout", "groups", "dcp_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGION_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    total_num_kv_heads: int
    block_size_tokens: int
    num_blocks: int
    kv_memory_layout: KvMemoryLayout
    region_layout: RegionLayout
    groups: _containers.RepeatedCompositeFieldContainer[KvCacheGroup]
    dcp_size: int
    def __init__(self, model_id: _Optional[str] = ..., total_num_kv_heads: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_memory_layout: _Optional[_Union[KvMemoryLayout, str]] = ..., region_layout: _Optional[_Union[RegionLayout, str]] = ..., groups: _Optional[_Iterable[_Union[KvCacheGroup, _Mapping]]] = ..., dcp_size: _Optional[int] = ...) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("region_index", "kind", "group_index", "layer_name", "pool_offset_bytes", "base_address", "block_len_bytes", "block_stride_bytes", "num_blocks", "block_shape", "dtype")
    REGION_INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    region_index: int
    kind: RegionKind
    group_index: int
    layer_name: str
    pool_offset_bytes: int
    base_address: int
    block_len_bytes: int
    block_stride_bytes: int
    num_blocks: int
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: Dtype
    def __init__(self, region_index: _Optional[int] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., group_index: _Optional[int] = ..., layer_name: _Optional[str] = ..., pool_offset_bytes: _Optional[int] = ..., base_address: _Optional[int] = ..., block_len_bytes: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("tp_rank", "memory_kind", "shm_name", "size_bytes", "device_id", "regions", "cuda_ipc", "populate_ms")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    POPULATE_MS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    memory_kind: MemoryKind
    shm_name: str
    size_bytes: int
    device_id: int
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    cuda_ipc: CudaIpc
    populate_ms: int
    def __init__(self, tp_rank: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ..., cuda_ipc: _Optional[_Union[CudaIpc, _Mapping]] = ..., populate_ms: _Optional[int] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class TransportInfo(_message.Message):
    __slots__ = ("nixl_available", "backends", "ucx_transports", "nixl_version", "unavailable_reason", "copy_threads", "node_id", "peers", "rdma_devices", "rdma_unavailable_reason")
    NIXL_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    UCX_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    NIXL_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    COPY_THREADS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    RDMA_UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    nixl_available: bool
    backends: _containers.RepeatedScalarFieldContainer[str]
    ucx_transports: _containers.RepeatedScalarFieldContainer[str]
    nixl_version: str
    unavailable_reason: str
    copy_threads: int
    node_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerTransport]
    rdma_devices: _containers.RepeatedScalarFieldContainer[str]
    rdma_unavailable_reason: str
    def __init__(self, nixl_available: _Optional[bool] = ..., backends: _Optional[_Iterable[str]] = ..., ucx_transports: _Optional[_Iterable[str]] = ..., nixl_version: _Optional[str] = ..., unavailable_reason: _Optional[str] = ..., copy_threads: _Optional[int] = ..., node_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerTransport, _Mapping]]] = ..., rdma_devices: _Optional[_Iterable[str]] = ..., rdma_unavailable_reason: _Optional[str] = ...) -> None: ...

class PeerTransport(_message.Message):
    __slots__ = ("address", "engine_id", "locality", "read_transports", "warning_reason", "warning")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    READ_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    WARNING_REASON_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    address: str
    engine_id: str
    locality: str
    read_transports: _containers.RepeatedScalarFieldContainer[str]
    warning_reason: str
    warning: str
    def __init__(self, address: _Optional[str] = ..., engine_id: _Optional[str] = ..., locality: _Optional[str] = ..., read_transports: _Optional[_Iterable[str]] = ..., warning_reason: _Optional[str] = ..., warning: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("engine_id", "role", "tp_size", "hosted_ranks", "layout", "layout_hash", "epoch", "pools", "transport", "server_version", "capabilities", "advertised_address", "live_leases", "engine_servers", "transfer_socket")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOSTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ADVERTISED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SERVERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SOCKET_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: Role
    tp_size: int
    hosted_ranks: _containers.RepeatedScalarFieldContainer[int]
    layout: KvLayout
    layout_hash: str
    epoch: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    transport: TransportInfo
    server_version: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    advertised_address: str
    live_leases: int
    engine_servers: _containers.RepeatedCompositeFieldContainer[EngineServer]
    transfer_socket: str
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., tp_size: _Optional[int] = ..., hosted_ranks: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., layout_hash: _Optional[str] = ..., epoch: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., transport: _Optional[_Union[TransportInfo, _Mapping]] = ..., server_version: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., advertised_address: _Optional[str] = ..., live_leases: _Optional[int] = ..., engine_servers: _Optional[_Iterable[_Union[EngineServer, _Mapping]]] = ..., transfer_socket: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "tp_size", "layout", "layout_hash", "ranks", "expected_engine_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_size: int
    layout: KvLayout
    layout_hash: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    expected_engine_id: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., layout_hash: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., expected_engine_id: _Optional[str] = ...) -> None: ...

class RankHandshake(_message.Message):
    __slots__ = ("tp_rank", "agent_name", "agent_metadata", "regions", "memory_kind", "device_id")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    memory_kind: MemoryKind
    device_id: int
    def __init__(self, tp_rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., device_id: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "epoch", "tp_size", "layout", "ranks", "lease_socket", "node_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    tp_size: int
    layout: KvLayout
    ranks: _containers.RepeatedCompositeFieldContainer[RankHandshake]
    lease_socket: str
    node_id: str
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tp_size: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankHandshake, _Mapping]]] = ..., lease_socket: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineServer(_message.Message):
    __slots__ = ("address", "ranks", "epoch", "lease_serial")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SERIAL_FIELD_NUMBER: _ClassVar[int]
    address: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    lease_serial: int
    def __init__(self, address: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., lease_serial: _Optional[int] = ...) -> None: ...

class TransferParams(_message.Message):
    __slots__ = ("remote_address", "remote_engine_id", "remote_request_id", "remote_block_ids_per_group", "remote_epoch", "remote_tp_size", "lease_token", "remote_servers", "remote_dcp_size", "remote_num_tokens", "lease_pending", "progressive")
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    REMOTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SERVERS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_PENDING_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_FIELD_NUMBER: _ClassVar[int]
    remote_address: str
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    remote_epoch: int
    remote_tp_size: int
    lease_token: str
    remote_servers: _containers.RepeatedCompositeFieldContainer[EngineServer]
    remote_dcp_size: int
    remote_num_tokens: int
    lease_pending: bool
    progressive: bool
    def __init__(self, remote_address: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., remote_epoch: _Optional[int] = ..., remote_tp_size: _Optional[int] = ..., lease_token: _Optional[str] = ..., remote_servers: _Optional[_Iterable[_Union[EngineServer, _Mapping]]] = ..., remote_dcp_size: _Optional[int] = ..., remote_num_tokens: _Optional[int] = ..., lease_pending: _Optional[bool] = ..., progressive: _Optional[bool] = ...) -> None: ...

class PublishBlocksRequest(_message.Message):
    __slots__ = ("request_id", "block_ids_per_group", "lease_ttl_ms", "lease_token", "num_tokens", "progressive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    lease_ttl_ms: int
    lease_token: str
    num_tokens: int
    progressive: bool
    def __init__(self, request_id: _Optional[str] = ..., block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., lease_ttl_ms: _Optional[int] = ..., lease_token: _Optional[str] = ..., num_tokens: _Optional[int] = ..., progressive: _Optional[bool] = ...) -> None: ...

class PublishBlocksResponse(_message.Message):
    __slots__ = ("params", "lease_expires_unix_ms")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    params: TransferParams
    lease_expires_unix_ms: int
    def __init__(self, params: _Optional[_Union[TransferParams, _Mapping]] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class CommitBlocksRequest(_message.Message):
    __slots__ = ("request_id", "lease_token", "commit_epoch", "block_ids_per_group", "num_tokens", "final", "layers_done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_token: str
    commit_epoch: int
    block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    final: bool
    layers_done: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., lease_token: _Optional[str] = ..., commit_epoch: _Optional[int] = ..., block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., final: _Optional[bool] = ..., layers_done: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitBlocksResponse(_message.Message):
    __slots__ = ("commit_epoch", "lease_expires_unix_ms")
    COMMIT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    commit_epoch: int
    lease_expires_unix_ms: int
    def __init__(self, commit_epoch: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class WaitCommitRequest(_message.Message):
    __slots__ = ("request_id", "lease_epoch", "engine_id", "claim_id", "after_epoch", "wait_ms", "want_content", "reads_done", "reads_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WANT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    READS_DONE_FIELD_NUMBER: _ClassVar[int]
    READS_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_epoch: int
    engine_id: str
    claim_id: str
    after_epoch: int
    wait_ms: int
    want_content: bool
    reads_done: bool
    reads_layers: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., engine_id: _Optional[str] = ..., claim_id: _Optional[str] = ..., after_epoch: _Optional[int] = ..., wait_ms: _Optional[int] = ..., want_content: _Optional[bool] = ..., reads_done: _Optional[bool] = ..., reads_layers: _Optional[bool] = ...) -> None: ...

class WaitCommitResponse(_message.Message):
    __slots__ = ("commit_epoch", "final", "block_ids_per_group", "num_tokens", "lease_remaining_ms", "content", "partial")
    COMMIT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    commit_epoch: int
    final: bool
    block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    lease_remaining_ms: int
    content: _containers.RepeatedCompositeFieldContainer[BlockContent]
    partial: PartialChunk
    def __init__(self, commit_epoch: _Optional[int] = ..., final: _Optional[bool] = ..., block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., lease_remaining_ms: _Optional[int] = ..., content: _Optional[_Iterable[_Union[BlockContent, _Mapping]]] = ..., partial: _Optional[_Union[PartialChunk, _Mapping]] = ...) -> None: ...

class PartialChunk(_message.Message):
    __slots__ = ("blocks", "layers_done", "whole_num_tokens")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedScalarFieldContainer[int]
    layers_done: _containers.RepeatedScalarFieldContainer[int]
    whole_num_tokens: int
    def __init__(self, blocks: _Optional[_Iterable[int]] = ..., layers_done: _Optional[_Iterable[int]] = ..., whole_num_tokens: _Optional[int] = ...) -> None: ...

class ClaimLeaseRequest(_message.Message):
    __slots__ = ("request_id", "lease_epoch", "engine_id", "tp_size", "extend_ms", "lease_token", "claim_id", "ranks", "dcp_size", "consumed", "blocks_digest", "lease_serial", "wait_ms", "want_content")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTEND_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_SERIAL_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WANT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_epoch: int
    engine_id: str
    tp_size: int
    extend_ms: int
    lease_token: str
    claim_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    dcp_size: int
    consumed: bool
    blocks_digest: bytes
    lease_serial: int
    wait_ms: int
    want_content: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_epoch: _Optional[int] = ..., engine_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., extend_ms: _Optional[int] = ..., lease_token: _Optional[str] = ..., claim_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., dcp_size: _Optional[int] = ..., consumed: _Optional[bool] = ..., blocks_digest: _Optional[bytes] = ..., lease_serial: _Optional[int] = ..., wait_ms: _Optional[int] = ..., want_content: _Optional[bool] = ...) -> None: ...

class ClaimLeaseResponse(_message.Message):
    __slots__ = ("lease_expires_unix_ms", "lease_remaining_ms", "state", "content")
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix_ms: int
    lease_remaining_ms: int
    state: LeaseState
    content: _containers.RepeatedCompositeFieldContainer[BlockContent]
    def __init__(self, lease_expires_unix_ms: _Optional[int] = ..., lease_remaining_ms: _Optional[int] = ..., state: _Optional[_Union[LeaseState, str]] = ..., content: _Optional[_Iterable[_Union[BlockContent, _Mapping]]] = ...) -> None: ...

class BlockContent(_message.Message):
    __slots__ = ("rank", "groups")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupContent]
    def __init__(self, rank: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupContent, _Mapping]]] = ...) -> None: ...

class GroupContent(_message.Message):
    __slots__ = ("digests", "first_block")
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    def __init__(self, digests: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ...) -> None: ...

class InlineRemote(_message.Message):
    __slots__ = ("layout", "tp_size")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    tp_size: int
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class PlanTransferRequest(_message.Message):
    __slots__ = ("inline_remote", "remote_address", "local_block_ids_per_group", "remote_block_ids_per_group", "local_ranks", "summary_only", "remote_num_tokens")
    INLINE_REMOTE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_ONLY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    inline_remote: InlineRemote
    remote_address: str
    local_block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    remote_block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    summary_only: bool
    remote_num_tokens: int
    def __init__(self, inline_remote: _Optional[_Union[InlineRemote, _Mapping]] = ..., remote_address: _Optional[str] = ..., local_block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., remote_block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., local_ranks: _Optional[_Iterable[int]] = ..., summary_only: _Optional[bool] = ..., remote_num_tokens: _Optional[int] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("local_region", "local_offset_bytes", "remote_region", "remote_offset_bytes", "length_bytes")
    LOCAL_REGION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REGION_FIELD_NUMBER: _ClassVar[int]
    REMOTE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    local_region: int
    local_offset_bytes: int
    remote_region: int
    remote_offset_bytes: int
    length_bytes: int
    def __init__(self, local_region: _Optional[int] = ..., local_offset_bytes: _Optional[int] = ..., remote_region: _Optional[int] = ..., remote_offset_bytes: _Optional[int] = ..., length_bytes: _Optional[int] = ...) -> None: ...

class SourceReads(_message.Message):
    __slots__ = ("remote_rank", "ranges", "bytes", "num_descriptors")
    REMOTE_RANK_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    remote_rank: int
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    bytes: int
    num_descriptors: int
    def __init__(self, remote_rank: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ...) -> None: ...

class RankPlan(_message.Message):
    __slots__ = ("local_rank", "tp_ratio", "handshake_target_ranks", "source_ranks_per_group", "source_ranks", "notify_only_ranks", "rank_to_attention_slot", "rank_offset_factor", "reads", "bytes", "num_descriptors")
    class RankToAttentionSlotEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RATIO_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_TARGET_RANKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANKS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANKS_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_ONLY_RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_TO_ATTENTION_SLOT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FACTOR_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    tp_ratio: int
    handshake_target_ranks: _containers.RepeatedScalarFieldContainer[int]
    source_ranks_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    source_ranks: _containers.RepeatedScalarFieldContainer[int]
    notify_only_ranks: _containers.RepeatedScalarFieldContainer[int]
    rank_to_attention_slot: _containers.ScalarMap[int, int]
    rank_offset_factor: int
    reads: _containers.RepeatedCompositeFieldContainer[SourceReads]
    bytes: int
    num_descriptors: int
    def __init__(self, local_rank: _Optional[int] = ..., tp_ratio: _Optional[int] = ..., handshake_target_ranks: _Optional[_Iterable[int]] = ..., source_ranks_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., source_ranks: _Optional[_Iterable[int]] = ..., notify_only_ranks: _Optional[_Iterable[int]] = ..., rank_to_attention_slot: _Optional[_Mapping[int, int]] = ..., rank_offset_factor: _Optional[int] = ..., reads: _Optional[_Iterable[_Union[SourceReads, _Mapping]]] = ..., bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ...) -> None: ...

class PlanTransferResponse(_message.Message):
    __slots__ = ("rank_plans", "total_bytes", "total_descriptors", "prefix_blocks_skipped_per_group")
    RANK_PLANS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_SKIPPED_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    rank_plans: _containers.RepeatedCompositeFieldContainer[RankPlan]
    total_bytes: int
    total_descriptors: int
    prefix_blocks_skipped_per_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank_plans: _Optional[_Iterable[_Union[RankPlan, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., total_descriptors: _Optional[int] = ..., prefix_blocks_skipped_per_group: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("request_id", "params", "local_block_ids_per_group", "local_prefix_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    params: TransferParams
    local_block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    local_prefix_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ..., local_block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., local_prefix_tokens: _Optional[int] = ...) -> None: ...

class RankTransferResult(_message.Message):
    __slots__ = ("local_rank", "bytes", "num_descriptors", "duration_us")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    bytes: int
    num_descriptors: int
    duration_us: int
    def __init__(self, local_rank: _Optional[int] = ..., bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., duration_us: _Optional[int] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("ranks", "total_bytes", "duration_us", "chunks_read_growing", "chunks_read_final", "after_final_us")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_READ_GROWING_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_READ_FINAL_FIELD_NUMBER: _ClassVar[int]
    AFTER_FINAL_US_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankTransferResult]
    total_bytes: int
    duration_us: int
    chunks_read_growing: int
    chunks_read_final: int
    after_final_us: int
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankTransferResult, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., duration_us: _Optional[int] = ..., chunks_read_growing: _Optional[int] = ..., chunks_read_final: _Optional[int] = ..., after_final_us: _Optional[int] = ...) -> None: ...

class TransferFailure(_message.Message):
    __slots__ = ("valid_local_block_ids_per_group", "remote_notified", "quarantined")
    VALID_LOCAL_BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NOTIFIED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    valid_local_block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    remote_notified: bool
    quarantined: bool
    def __init__(self, valid_local_block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., remote_notified: _Optional[bool] = ..., quarantined: _Optional[bool] = ...) -> None: ...

class NotifyRequest(_message.Message):
    __slots__ = ("request_id", "kind", "engine_id", "tp_size", "done_ranks", "lease_epoch", "lease_token", "claim_id", "withdraw")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DONE_RANKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: NotifyKind
    engine_id: str
    tp_size: int
    done_ranks: _containers.RepeatedScalarFieldContainer[int]
    lease_epoch: int
    lease_token: str
    claim_id: str
    withdraw: bool
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[_Union[NotifyKind, str]] = ..., engine_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., done_ranks: _Optional[_Iterable[int]] = ..., lease_epoch: _Optional[int] = ..., lease_token: _Optional[str] = ..., claim_id: _Optional[str] = ..., withdraw: _Optional[bool] = ...) -> None: ...

class NotifyResponse(_message.Message):
    __slots__ = ("state", "pending_ranks", "lease_remaining_ms")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PENDING_RANKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    state: LeaseState
    pending_ranks: _containers.RepeatedScalarFieldContainer[int]
    lease_remaining_ms: int
    def __init__(self, state: _Optional[_Union[LeaseState, str]] = ..., pending_ranks: _Optional[_Iterable[int]] = ..., lease_remaining_ms: _Optional[int] = ...) -> None: ...

class WatchReleasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchReleasesResponse(_message.Message):
    __slots__ = ("request_id", "reason", "block_ids_per_group", "released_unix_ms", "free_block_ids_per_group")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    RELEASED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCK_IDS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: ReleaseReason
    block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    released_unix_ms: int
    free_block_ids_per_group: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ..., block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., released_unix_ms: _Optional[int] = ..., free_block_ids_per_group: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class WaitTransferRequest(_message.Message):
    __slots__ = ("request_id", "wait_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_ms: int
    def __init__(self, request_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class WaitTransferResponse(_message.Message):
    __slots__ = ("state", "result", "failure", "error_reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    result: TransferResponse
    failure: TransferFailure
    error_reason: str
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ..., result: _Optional[_Union[TransferResponse, _Mapping]] = ..., failure: _Optional[_Union[TransferFailure, _Mapping]] = ..., error_reason: _Optional[str] = ...) -> None: ...

class LeaseChannelRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[LeaseCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[LeaseCall, _Mapping]]] = ...) -> None: ...

class LeaseCall(_message.Message):
    __slots__ = ("call_id", "claim", "notify", "traceparent")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    claim: ClaimLeaseRequest
    notify: NotifyRequest
    traceparent: str
    def __init__(self, call_id: _Optional[int] = ..., claim: _Optional[_Union[ClaimLeaseRequest, _Mapping]] = ..., notify: _Optional[_Union[NotifyRequest, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class LeaseChannelResponse(_message.Message):
    __slots__ = ("answers", "stream_error")
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ERROR_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[LeaseAnswer]
    stream_error: bytes
    def __init__(self, answers: _Optional[_Iterable[_Union[LeaseAnswer, _Mapping]]] = ..., stream_error: _Optional[bytes] = ...) -> None: ...

class LeaseAnswer(_message.Message):
    __slots__ = ("call_id", "claim", "notify", "error_status")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_FIELD_NUMBER: _ClassVar[int]
    ERROR_STATUS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    claim: ClaimLeaseResponse
    notify: NotifyResponse
    error_status: bytes
    def __init__(self, call_id: _Optional[int] = ..., claim: _Optional[_Union[ClaimLeaseResponse, _Mapping]] = ..., notify: _Optional[_Union[NotifyResponse, _Mapping]] = ..., error_status: _Optional[bytes] = ...) -> None: ...

class TransferStreamRequest(_message.Message):
    __slots__ = ("transfers", "cancel_request_ids")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferCall]
    cancel_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfers: _Optional[_Iterable[_Union[TransferCall, _Mapping]]] = ..., cancel_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TransferCall(_message.Message):
    __slots__ = ("request", "timeout_ms", "traceparent")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request: TransferRequest
    timeout_ms: int
    traceparent: str
    def __init__(self, request: _Optional[_Union[TransferRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class TransferStreamResponse(_message.Message):
    __slots__ = ("answers", "stream_error")
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ERROR_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[TransferAnswer]
    stream_error: bytes
    def __init__(self, answers: _Optional[_Iterable[_Union[TransferAnswer, _Mapping]]] = ..., stream_error: _Optional[bytes] = ...) -> None: ...

class TransferAnswer(_message.Message):
    __slots__ = ("request_id", "response", "error_status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: TransferResponse
    error_status: bytes
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[TransferResponse, _Mapping]] = ..., error_status: _Optional[bytes] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("limit", "request_id_prefix", "request_ids")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    request_id_prefix: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, limit: _Optional[int] = ..., request_id_prefix: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("request_id", "state", "published_unix_ms", "expires_unix_ms", "remaining_ms", "num_blocks", "claimed_by_engine_id", "claimed_by_tp_size", "num_claims", "pending_d_ranks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    PENDING_D_RANKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: LeaseState
    published_unix_ms: int
    expires_unix_ms: int
    remaining_ms: int
    num_blocks: int
    claimed_by_engine_id: str
    claimed_by_tp_size: int
    num_claims: int
    pending_d_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[LeaseState, str]] = ..., published_unix_ms: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., remaining_ms: _Optional[int] = ..., num_blocks: _Optional[int] = ..., claimed_by_engine_id: _Optional[str] = ..., claimed_by_tp_size: _Optional[int] = ..., num_claims: _Optional[int] = ..., pending_d_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("address", "engine_id", "epoch", "tp_size", "transfers_using", "lease_channel_open", "lease_carrier")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_USING_FIELD_NUMBER: _ClassVar[int]
    LEASE_CHANNEL_OPEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_CARRIER_FIELD_NUMBER: _ClassVar[int]
    address: str
    engine_id: str
    epoch: int
    tp_size: int
    transfers_using: int
    lease_channel_open: bool
    lease_carrier: str
    def __init__(self, address: _Optional[str] = ..., engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tp_size: _Optional[int] = ..., transfers_using: _Optional[int] = ..., lease_channel_open: _Optional[bool] = ..., lease_carrier: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases", "live_leases", "claimed_leases", "peers", "running_transfers")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_LEASES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    live_leases: int
    claimed_leases: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    running_transfers: int
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ..., live_leases: _Optional[int] = ..., claimed_leases: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., running_transfers: _Optional[int] = ...) -> None: ...
