"""TransferTopology: one local rank's view of a transfer between two TP sizes (MAPPING.md §2)."""

from __future__ import annotations

from dataclasses import dataclass

from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.mapping.dcp import dcp_source_ranks
from kvsvc.reasons import Reason


def tp_ratio(local_tp_size: int, remote_tp_size: int) -> int:
    """L // R when L >= R, else -(R // L); TP_NOT_DIVISIBLE when neither divides."""
    lt, rt = local_tp_size, remote_tp_size
    if lt <= 0 or rt <= 0:
        raise InvalidArgument(Reason.INVALID_TP_SIZE, f"TP sizes must be positive, got local {lt}, remote {rt}",
                              {"local_tp_size": lt, "remote_tp_size": rt})
    if lt >= rt and lt % rt == 0:
        return lt // rt
    if rt > lt and rt % lt == 0:
        return -(rt // lt)
    raise FailedPrecondition(
        Reason.TP_NOT_DIVISIBLE,
        f"local TP {lt} and remote TP {rt} must divide one another (pick sizes like 1, 2, 4, 8)",
        {"local_tp_size": lt, "remote_tp_size": rt},
    )


def handshake_target_ranks(tp_rank: int, local_tp_size: int, remote_tp_size: int, local_dcp_size: int = 1,
                           remote_dcp_size: int = 1) -> list[int]:
    """The remote ranks local rank tp_rank reads from or notifies.

    A remote engine with DCP (MLA) holds each block on one rank: the targets are the ranks
    holding this rank's blocks (§9). Otherwise they follow the TP ratio (§2).
    """
    ratio = tp_ratio(local_tp_size, remote_tp_size)
    if remote_dcp_size > 1:
        return dcp_source_ranks(tp_rank, local_dcp_size, remote_tp_size, remote_dcp_size)
    if ratio > 0:
        return [tp_rank // ratio]
    return [tp_rank * -ratio + i for i in range(-ratio)]


@dataclass(frozen=True, slots=True)
class TransferTopology:
    """The local side of a transfer: rank, TP size, model heads (K) and MLA.

    block_size is the local block size in tokens; dcp_size the local DCP size (MLA).
    """

    tp_rank: int
    tp_size: int
    total_num_kv_heads: int
    is_mla: bool = False
    block_size: int = 16
    engine_id: str = ""
    dcp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(Reason.RANK_OUT_OF_RANGE, f"tp_rank {self.tp_rank} is outside TP size {self.tp_size}",
                                  {"tp_rank": self.tp_rank, "tp_size": self.tp_size})

    @property
    def num_kv_heads_per_rank(self) -> int:
        """Local heads per rank: 1 for MLA, else max(1, K // L)."""
        return 1 if self.is_mla else max(1, self.total_num_kv_heads // self.tp_size)

    def tp_ratio(self, remote_tp_size: int) -> int:
        return tp_ratio(self.tp_size, remote_tp_size)

    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        return handshake_target_ranks(self.tp_rank, self.tp_size, remote_tp_size, self.dcp_size, remote_dcp_size)

    def describe(self, remote_tp_size: int, remote_block_len: int | None = None) -> str:
        """One log line: ratio, heads, TP sizes, rank and remote block length."""
        return (
            f"tp_ratio={self.tp_ratio(remote_tp_size)} num_kv_heads={self.num_kv_heads_per_rank} "
            f"local_tp={self.tp_size} remote_tp={remote_tp_size} rank={self.tp_rank} "
            f"remote_block_len={remote_block_len if remote_block_len is not None else '?'}"
        )
