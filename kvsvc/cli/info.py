"""`kvsvc info ADDRESS`: GetInfo, printed for a person."""

from __future__ import annotations

from google.protobuf import json_format

from kvsvc.client import Client, ClientOptions
from kvsvc.v1 import kv_transfer_pb2 as pb


def format_info(info: pb.GetInfoResponse) -> str:
    lay = info.layout
    lines = [
        f"engine      {info.engine_id}  ({pb.Role.Name(info.role).removeprefix('ROLE_').lower()})",
        f"address     {info.advertised_address}",
        f"version     kvsvc {info.server_version}   epoch {info.epoch}",
        f"TP          size {info.tp_size}, hosted ranks {list(info.hosted_ranks)}"
        + (f", DCP {info.layout.dcp_size}" if info.layout.dcp_size > 1 else ""),
        f"model       {lay.model_id}  K={lay.total_num_kv_heads}  block {lay.block_size_tokens} tokens  "
        f"{lay.num_blocks} blocks  {pb.KvMemoryLayout.Name(lay.kv_memory_layout).removeprefix('KV_MEMORY_LAYOUT_')}"
        f"  {pb.RegionLayout.Name(lay.region_layout).removeprefix('REGION_LAYOUT_').lower()}",
        f"layout hash {info.layout_hash}",
    ]
    for i, g in enumerate(lay.groups):
        kind = g.spec.WhichOneof("kind")
        spec = getattr(g.spec, kind)
        n = len(g.layer_names) if kind != "uniform_type" else len(spec.layers)
        detail = str(spec).replace("\n", " ").strip() if kind != "uniform_type" else f"{n} inner specs"
        lines.append(f"group {i}     {g.name}: {kind}, {n} layers ({detail})")
    t = info.transport
    if t.nixl_available:
        lines.append(f"transport   NIXL {t.nixl_version} backends {list(t.backends)} "
                     f"UCX transports {list(t.ucx_transports) or 'not yet seen'}"
                     + (f", long DRAM READs split over {t.copy_threads} copy threads" if t.copy_threads else ""))
    else:
        lines.append(f"transport   none ({t.unavailable_reason or 'control plane only'})")
    if t.rdma_devices or t.rdma_unavailable_reason:
        lines.append(f"rdma        devices {list(t.rdma_devices) or 'none'}"
                     + (f"  TRANSPORT_DEGRADED: {t.rdma_unavailable_reason}" if t.rdma_unavailable_reason else ""))
    for peer in t.peers:
        warn = f"  {peer.warning_reason}: {peer.warning}" if peer.warning_reason else ""
        lines.append(f"reads from  {peer.address} ({peer.engine_id}, {peer.locality}) over "
                     f"{', '.join(peer.read_transports)}{warn}")
    for p in info.pools:
        mem = pb.MemoryKind.Name(p.memory_kind).removeprefix("MEMORY_KIND_")
        where = p.shm_name or f"cuda:{p.device_id}"
        lines.append(f"pool rank {p.tp_rank}  {mem} {where}  {p.size_bytes / 2**20:.1f} MiB, {len(p.regions)} regions")
    for e in info.engine_servers:
        known = f"ranks {list(e.ranks)}, epoch {e.epoch}" if e.epoch else "not reached yet"
        lines.append(f"sibling     {e.address}  ({known})")
    lines.append(f"capabilities {', '.join(info.capabilities)}")
    return "\n".join(lines)


def print_info(address: str, options: ClientOptions | None = None, as_json: bool = False) -> int:
    with Client(address, options or ClientOptions(timeout_s=5.0, retries=1)) as c:
        info = c.get_info()
    print(json_format.MessageToJson(info, preserving_proto_field_name=True) if as_json else format_info(info))
    return 0
