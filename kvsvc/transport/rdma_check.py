"""Whether READs between nodes can use RDMA here, checked once at start.

With require_rdma_between_nodes an operator says KV must cross nodes over RDMA. The READs
themselves show what UCX chose (peer_transports.py), but only after the first transfer from
each peer; this says at start that it cannot be RDMA at all: the node exposes no RDMA
device to this process (/sys/class/infiniband lists none: no NIC, or the pod was not given
one), or UCX_TLS leaves UCX no RDMA transport. GetInfo (TransportInfo.rdma_devices,
rdma_unavailable_reason), a warning with reason TRANSPORT_DEGRADED and the gauge
kvsvc_rdma_unavailable say so. Transfers still run (over TCP): slower, not wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSFS_RDMA = Path("/sys/class/infiniband")
# UCX transport names (UCX_TLS entries) that move bytes over RDMA, and the aliases that
# include them.
RDMA_TLS = ("rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs",
            "ud_mlx5", "ib", "all")


@dataclass(frozen=True, slots=True)
class RdmaCheck:
    devices: tuple[str, ...]  # RDMA devices this process sees (e.g. mlx5_0)
    unavailable_reason: str  # why READs between nodes cannot use RDMA ("" when they can, or it is not required)


def check_rdma(required: bool, environ: Mapping[str, str], sysfs: Path = SYSFS_RDMA) -> RdmaCheck:
    try:
        devices = tuple(sorted(p.name for p in sysfs.iterdir()))
    except OSError:
        devices = ()
    if not required:
        return RdmaCheck(devices, "")
    if not devices:
        return RdmaCheck(devices, f"require_rdma_between_nodes is set but this node exposes no RDMA device to kvsvc "
                                  f"({sysfs} lists none): READs between nodes will use TCP. Give the pod the NICs "
                                  "(your RDMA device plugin's resource) or install the NIC's driver")
    tls = environ.get("UCX_TLS", "").strip()
    if tls and not _allows_rdma(tls):
        return RdmaCheck(devices, f"require_rdma_between_nodes is set but UCX_TLS={tls} leaves UCX no RDMA "
                                  "transport: READs between nodes will use TCP")
    return RdmaCheck(devices, "")


def _allows_rdma(tls: str) -> bool:
    """Whether a UCX_TLS value leaves an RDMA transport ("^a,b" excludes a and b)."""
    if tls.startswith("^"):
        excluded = {t.strip() for t in tls[1:].split(",")}
        return not ("ib" in excluded or {"rc", "dc", "ud"} <= excluded)
    names = {t.strip() for t in tls.split(",")}
    return any(n in RDMA_TLS or n.split(":")[0] in RDMA_TLS for n in names)
