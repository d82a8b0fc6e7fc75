"""What the scheduler tells the workers each step, and what each worker tells the scheduler once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

LEASE_HEARTBEAT_S = 5.0
"""How often D heartbeats the P leases of requests in its queue: a sixth of kvsvc's default
lease TTL (30 s), as NixlConnector does with its own; keep lease_heartbeat_s below a third of
the P engines' lease_ttl_s."""


@dataclass
class ServerInfo(KVConnectorHandshakeMetadata):
    """A worker's embedded kvsvc server: where it listens, its epoch, the TP rank it hosts and
    how many of its blocks (the attention backend's kernel blocks) make one of vLLM's."""

    address: str
    epoch: int
    tp_rank: int
    blocks_per_logical: int = 1


@dataclass
class Receive:
    """One request D pulls: its local blocks (per group), P's params, and whether vLLM waits for it."""

    local_block_ids: list[list[int]]
    params: dict[str, Any]
    awaiting: bool
    # A streamed request: the leading tokens D holds already (a prefix hit, whole blocks);
    # its local blocks are those after them, paired with P's from the request's start.
    prefix_tokens: int = 0


@dataclass
class Publish:
    """P: one finished request whose blocks each worker leases on its own server, under the
    token the scheduler minted (and put in the params it handed out)."""

    block_ids: list[list[int]]  # kernel block ids (kvsvc's), per group
    num_tokens: int
    lease_token: str
    lease_ttl_ms: int = 0
    # Made in the step whose forward completes the request's prompt, before vLLM finishes it
    # (so D never waits for a later step); request_finished then hands out its token, or
    # the lease is withdrawn.
    early: bool = False


@dataclass
class Commit:
    """P: one chunk of a streamed request, committed by each worker once this step's forward
    computed it; epoch 1 opens the lease, empty, as the request arrives."""

    lease_id: str
    lease_token: str
    epoch: int
    block_ids: list[list[int]]  # kernel block ids this chunk appends, per group
    num_tokens: int  # the request's tokens computed once this step's forward ran
    final: bool
    lease_ttl_ms: int = 0


@dataclass
class KvsvcConnectorMetadata(KVConnectorMetadata):
    receive: dict[str, Receive] = field(default_factory=dict)
    # Requests D gave up on before reading: their P leases are aborted (with the lease token).
    abandon: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Requests aborted while their transfer runs: the transfer is cancelled (it then frees P).
    cancel: set[str] = field(default_factory=set)
    # Requests that arrived in D's queue with kvsvc params: rank 0's worker heartbeats their
    # P leases, on its own timer, until they appear in stop_keep_alive (given blocks: their
    # transfer holds the lease; or finished), so a long wait does not expire them.
    keep_alive: dict[str, dict[str, Any]] = field(default_factory=dict)
    stop_keep_alive: set[str] = field(default_factory=set)
    # P: requests whose blocks vLLM keeps until kvsvc releases their lease (request_finished
    # answered delay_free). Only these may be reported finished sending: vLLM's scheduler
    # fails hard on a request it did not delay.
    delayed: set[str] = field(default_factory=set)
    # P: the leases to make this step (every worker, on its own server).
    publish: dict[str, Publish] = field(default_factory=dict)
    # P: delayed requests whose params name their early lease (a subset of delayed): if
    # that lease could not be made, vLLM gets the blocks back at once.
    delayed_early: set[str] = field(default_factory=set)
    # P: early leases nobody will claim (request_id -> token): taken back, no release event.
    withdraw: dict[str, str] = field(default_factory=dict)
    # P: streamed requests vLLM took in since the last step: their leases opened, empty
    # (epoch 1), ahead of this step's commits.
    open: dict[str, Commit] = field(default_factory=dict)
    # P: chunks of streamed requests this step's forward computes (request id -> commit),
    # committed after it.
    commit: dict[str, Commit] = field(default_factory=dict)
    # P: streamed requests whose blocks vLLM freed before D was done (preempted, aborted,
    # or never leased): request id -> (lease id, token). Taken back before this step's
    # forward may overwrite the blocks; a D reading them fails typed, and uses nothing.
    revoke: dict[str, tuple[str, str]] = field(default_factory=dict)
