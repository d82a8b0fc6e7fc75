"""`kvsvc leases ADDRESS`: ListLeases, printed for a person (or as JSON)."""

from __future__ import annotations

import time

from google.protobuf import json_format

from kvsvc.client import Client, ClientOptions
from kvsvc.v1 import kv_transfer_pb2 as pb


def format_leases(resp: pb.ListLeasesResponse, now_unix_ms: int | None = None) -> str:
    now = int(time.time() * 1000) if now_unix_ms is None else now_unix_ms
    lines = [f"{resp.live_leases} live leases ({resp.claimed_leases} claimed), {resp.running_transfers} transfers "
             f"running, {len(resp.peers)} peers"]
    if resp.leases:
        lines.append(f"{'request id':<40} {'state':<8} {'blocks':>6} {'age s':>7} {'left s':>7}  claimed by")
    for lease in resp.leases:
        state = pb.LeaseState.Name(lease.state).removeprefix("LEASE_STATE_").lower()
        who = ""
        if lease.claimed_by_engine_id:
            who = f"{lease.claimed_by_engine_id} (TP {lease.claimed_by_tp_size}, {lease.num_claims} claims"
            who += f", waiting for D ranks {list(lease.pending_d_ranks)})" if lease.pending_d_ranks else ")"
        lines.append(f"{lease.request_id[:40]:<40} {state:<8} {lease.num_blocks:>6} "
                     f"{max(0, now - lease.published_unix_ms) / 1000:>7.1f} {lease.remaining_ms / 1000:>7.1f}  {who}")
    if len(resp.leases) < resp.live_leases:
        lines.append(f"... {resp.live_leases - len(resp.leases)} more (--limit)")
    for p in resp.peers:
        channel = (f"LeaseChannel open ({p.lease_carrier or 'grpc'})" if p.lease_channel_open
                   else "no LeaseChannel")
        lines.append(f"peer {p.address}  engine {p.engine_id}  TP {p.tp_size}  epoch {p.epoch}  "
                     f"{p.transfers_using} transfers using it, {channel}")
    return "\n".join(lines)


def print_leases(address: str, options: ClientOptions, *, limit: int = 0, prefix: str = "",
                 as_json: bool = False) -> int:
    with Client(address, options) as c:
        resp = c.list_leases(limit=limit, request_id_prefix=prefix)
    print(json_format.MessageToJson(resp, preserving_proto_field_name=True) if as_json else format_leases(resp))
    return 0
