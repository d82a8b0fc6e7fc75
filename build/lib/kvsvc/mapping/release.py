"""Release accounting on P: which D ranks must notify before a P rank frees a request (§7)."""

from __future__ import annotations

from collections.abc import Iterable

from kvsvc.mapping.topology import tp_ratio


def expected_notifiers(remote_rank: int, local_tp_size: int, remote_tp_size: int, local_dcp_size: int = 1,
                       remote_dcp_size: int = 1) -> frozenset[int]:
    """The local (D) ranks whose handshake targets include remote (P) rank remote_rank.

    Readers and notify-only ranks alike: L // R of them when L > R, else exactly one.
    Generalises vLLM's "request:tp_size" count, and covers P ranks that GQA dedup skips.
    A P engine with DCP (§9) is owed by the D ranks that read some of its blocks there.
    """
    ratio = tp_ratio(local_tp_size, remote_tp_size)
    if remote_dcp_size > 1:  # the inverse of dcp_source_ranks, O(L) per P rank
        lc, rd = local_dcp_size, remote_dcp_size
        if lc <= rd:
            return frozenset(t for t in range(local_tp_size) if t % lc == remote_rank % lc)
        return frozenset(t for t in range(local_tp_size) if t % lc % rd == remote_rank)
    if ratio > 0:
        return frozenset(range(remote_rank * ratio, (remote_rank + 1) * ratio))
    return frozenset([remote_rank // -ratio])


class ReleaseTracker:
    """Per request on P: the D ranks still owed, per hosted P rank.

    Built when D (TP size d_tp, DCP size d_dcp) claims; notify() marks D ranks done and
    returns the P ranks that became free. done is True once every hosted P rank is free.
    """

    __slots__ = ("_pending",)

    def __init__(self, hosted_p_ranks: Iterable[int], d_tp_size: int, p_tp_size: int, d_dcp_size: int = 1,
                 p_dcp_size: int = 1) -> None:
        self._pending: dict[int, set[int]] = {
            p: set(expected_notifiers(p, d_tp_size, p_tp_size, d_dcp_size, p_dcp_size)) for p in hosted_p_ranks
        }

    def notify(self, d_ranks: Iterable[int]) -> list[int]:
        """Record that d_ranks are done; return the P ranks released by this call."""
        done = set(d_ranks)
        freed = []
        for p, pending in self._pending.items():
            if pending and pending & done:
                pending -= done
                if not pending:
                    freed.append(p)
        return freed

    @property
    def done(self) -> bool:
        return all(not p for p in self._pending.values())

    @property
    def pending_d_ranks(self) -> list[int]:
        return sorted(set().union(*self._pending.values())) if self._pending else []

