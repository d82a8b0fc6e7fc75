"""Every size a caller controls has a limit here, checked before any work is done.

The limits are generous for real deployments (a TP-1024 engine, a 1M-token request in
16-token blocks over 64 groups) and small enough that no single request can stall a
server or hold memory out of proportion to what it asks for. docs/SECURITY.md lists
them; a request over one gets INVALID_ARGUMENT naming the field, its size and the limit
(never the value itself: error details must stay small).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsvc.errors import FieldViolation, InvalidArgument
from kvsvc.reasons import Reason

MAX_TP_SIZE = 1024
"""Largest TP size of either engine."""
MAX_ID_BYTES = 256
"""Longest request id, engine id, claim id or lease token, UTF-8 bytes."""
MAX_ADDRESS_BYTES = 512
"""Longest host:port."""
MAX_GROUPS = 64
"""Most KV-cache groups in a layout or a block list."""
MAX_LAYERS = 4096
"""Most layers over all groups of a layout."""
MAX_BLOCK_IDS = 1 << 20
"""Most block ids in one request, over all groups."""
MAX_NUM_BLOCKS = 1 << 24
"""Largest pool, in blocks per rank."""
MAX_DIM = 1 << 16
"""Largest head count, head size, block size or state dimension."""
MAX_STATE_PAGE_BYTES = 1 << 30
"""Largest page a Mamba layer's states are padded to (MambaSpec.page_size_bytes)."""
MAX_NUM_TOKENS = MAX_BLOCK_IDS * MAX_DIM
"""Longest request, tokens (every block id of a request at the largest block size)."""
MAX_WAIT_MS = 60_000
"""Longest WaitTransfer wait."""
MAX_LIST_LEASES = 10_000
"""Most leases one ListLeases answer lists."""
DEFAULT_LIST_LEASES = 1000
MAX_LEASE_CALLS = 1024
"""Most calls in one LeaseChannel message."""
MAX_STREAM_CALLS = 1024
"""Most transfers started, and most given up, in one TransferStream message."""
MAX_STREAM_TRANSFERS = 4096
"""Most transfers running on one TransferStream at once."""
MAX_DIGEST_BYTES = 64
"""Longest ClaimLeaseRequest.blocks_digest (16 bytes today; room for a longer hash)."""
MIN_CLAIM_ID_BYTES = 16
"""Shortest claim id: it is an ownership secret, so it must not be guessable."""

METADATA_VALUE_CHARS = 200
"""Error metadata values are cut to this many characters."""
STATUS_MESSAGE_CHARS = 2000
"""Error messages are cut to this many characters."""


def too_big(field: str, size: int, limit: int, unit: str) -> InvalidArgument:
    description = f"{size} {unit} exceeds the limit of {limit}"
    return InvalidArgument(Reason.FIELD_TOO_LARGE, f"{field}: {description}",
                           {"field": field, "size": size, "limit": limit},
                           field_violations=[FieldViolation(field, description)])


def check_id(value: str, field: str, limit: int = MAX_ID_BYTES) -> None:
    n = len(value.encode())
    if n > limit:
        raise too_big(field, n, limit, "bytes")


def check_count(items: Sequence[object], field: str, limit: int) -> None:
    if len(items) > limit:
        raise too_big(field, len(items), limit, "items")


def check_tp_size(tp_size: int, field: str) -> None:
    if tp_size > MAX_TP_SIZE:
        raise too_big(field, tp_size, MAX_TP_SIZE, "ranks")


def check_block_lists(groups: Sequence[Sequence[int]], field: str) -> None:
    check_count(groups, field, MAX_GROUPS)
    total = sum(len(g) for g in groups)
    if total > MAX_BLOCK_IDS:
        raise too_big(field, total, MAX_BLOCK_IDS, "block ids")


def check_num_tokens(num_tokens: int, field: str) -> None:
    if num_tokens > MAX_NUM_TOKENS:
        raise too_big(field, num_tokens, MAX_NUM_TOKENS, "tokens")


def clip(text: str, limit: int) -> str:
    """text, cut to limit characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more]"
