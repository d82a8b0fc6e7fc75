"""P: the chunk that completes a streamed prompt, committed layer by layer as its forward
computes it (docs/ARCHITECTURE.md, "Progressive pull": a chunk committed layer by layer).

vLLM calls the connector's save_kv_layer after each attention layer's forward. For a step
whose commits include final ones, the layers saved are counted per KV cache group (in the
group's own layer order, the order kvsvc's layout places its regions in); every `1/parts`
of the model's layers a partial commit is made of each such request: its chunk's blocks
the first time, then only the layer counts. D reads those layers while P computes the
rest, so what is left after P's forward is the last part's READs, not the whole chunk's.
The final commit (after the forward, as for every chunk) then takes the epoch after the
partial ones and appends nothing more.

Pure bookkeeping on vLLM's model-runner thread: no I/O, nothing that waits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvsvc.integrations.vllm.metadata import Commit


@dataclasses.dataclass(frozen=True)
class PartialCommit:
    """One partial commit to make of a request now: Commit's epoch and blocks, with layers."""

    request_id: str  # vLLM's
    commit: Commit
    layers_done: tuple[int, ...]


class LayerCommits:
    def __init__(self, groups: Sequence[Sequence[str]], parts: int) -> None:
        """groups: per KV cache group, its layer names in order; parts: partial commits per
        chunk, at most (0 or 1: none, the chunk is committed whole after the forward)."""
        self._place = {name: (g, i) for g, names in enumerate(groups) for i, name in enumerate(names)}
        self._sizes = [len(names) for names in groups]
        total = sum(self._sizes)
        self._every = -(-total // parts) if parts > 1 and total > 1 else 0
        self._total = total
        self._finals: dict[str, Commit] | None = None  # this step's commits completing a prompt (None: between steps)
        self._made: dict[str, int] = {}  # partial commits made this step, per request

    def _begin(self, commits: Mapping[str, Commit]) -> None:
        """A step's first layer: its commits completing a prompt are made layer by layer."""
        self._finals = {rid: c for rid, c in commits.items() if c.final and c.epoch > 1} if self._every else {}
        self._made = {}
        self._saved = [0] * len(self._sizes)
        self._pending: list[set[int]] = [set() for _ in self._sizes]
        self._count = 0
        self._sent: tuple[int, ...] = ()

    def saved(self, layer_name: str, commits: Mapping[str, Commit]) -> list[PartialCommit]:
        """One layer's forward was launched in the step whose commits are `commits`: the
        partial commits to make once it ran."""
        if self._finals is None:
            self._begin(commits)
        if not self._finals:
            return []
        place = self._place.get(layer_name)
        if place is None:
            return []
        g, i = place
        if i < self._saved[g] or i in self._pending[g]:
            return []  # (a layer saved twice in one step: counted once)
        self._pending[g].add(i)
        while self._saved[g] in self._pending[g]:  # each group's count is a prefix of its layers
            self._pending[g].discard(self._saved[g])
            self._saved[g] += 1
        self._count += 1
        counts = tuple(self._saved)
        if self._count % self._every or self._count >= self._total or counts == self._sent or not any(counts):
            return []
        self._sent = counts
        out = []
        for rid, c in self._finals.items():
            made = self._made.get(rid, 0)
            blocks = c.block_ids if not made else [[] for _ in c.block_ids]
            out.append(PartialCommit(rid, dataclasses.replace(c, epoch=c.epoch + made, block_ids=blocks, final=False),
                                     counts))
            self._made[rid] = made + 1
        return out

    def ended(self, commits: Mapping[str, Commit]) -> dict[str, Commit]:
        """The step's forward was launched whole: its commits, each completing a prompt made
        whole after its partial ones (the epoch after theirs, no blocks they appended)."""
        made, self._made, self._finals = self._made, {}, None
        return {rid: dataclasses.replace(c, epoch=c.epoch + made[rid], block_ids=[[] for _ in c.block_ids])
                if made.get(rid) else c for rid, c in commits.items()}
