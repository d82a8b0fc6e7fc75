"""Transport honesty, the pure part: UCX's protocol log (as UCX 1.x prints it, captured from
real NIXL READs on this kind of machine) read into READ paths, and which paths are a
downgrade. The servers' side is tests/e2e/test_transport_honesty.py."""

from __future__ import annotations

from kvsvc.transport.ucx_probe import ReadPath, degraded_because, parse_read_paths

# Two agents of one host, a READ of 1 MiB of host memory: UCX's default (cross-memory attach)
# and with UCX_TLS=tcp,self (what a container without shared memory falls back to).
SHARED = """\
[1796562792.864036] [vm:2261 :0]   +--------+-------------+-----------------------------------+
[1796562792.864036] [vm:2261 :0]   | agentB intra-node cfg#1                                  |
[1796562792.864036] [vm:2261 :0]   | remote memory write by ucp_put* from host memory to host |
[1796562792.864036] [vm:2261 :0]   +--------+-------------+-----------------------------------+
[1796562792.864036] [vm:2261 :0]   | Range  | Description |              Config               |
[1796562792.864036] [vm:2261 :0]   +--------+-------------+-----------------------------------+
[1796562792.864036] [vm:2261 :0]   | 0..inf | zero-copy   | cma/memory                        |
[1796562792.864036] [vm:2261 :0]   +--------+-------------+-----------------------------------+
[1796562792.875477] [vm:2261 :0]   +------------+--------------------+---------------+
[1796562792.875477] [vm:2261 :0]   | agentB intra-node cfg#1                         |
[1796562792.875477] [vm:2261 :0]   | active message by ucp_am_send* from host memory |
[1796562792.875477] [vm:2261 :0]   +------------+--------------------+---------------+
[1796562792.875477] [vm:2261 :0]   |          0 | short              | tcp/lo        |
[1796562792.875477] [vm:2261 :0]   |   1..16515 | zero-copy          | tcp/lo        |
[1796562792.875477] [vm:2261 :0]   +------------+--------------------+---------------+
[1796562792.918932] [vm:2261 :0]   +--------+-------------+-------------------------------------------+
[1796562792.918932] [vm:2261 :0]   | agentB intra-node cfg#1                                          |
[1796562792.918932] [vm:2261 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796562792.918932] [vm:2261 :0]   +--------+-------------+-------------------------------------------+
[1796562792.918932] [vm:2261 :0]   | Range  | Description |                  Config                   |
[1796562792.918932] [vm:2261 :0]   +--------+-------------+-------------------------------------------+
[1796562792.918932] [vm:2261 :0]   | 0..inf | zero-copy   | cma/memory                                |
[1796562792.918932] [vm:2261 :0]   +--------+-------------+-------------------------------------------+
"""
TCP = """\
[1796563072.363468] [vm:4234 :0]   +--------+--------------------+------------------------------------+
[1796563072.363468] [vm:4234 :0]   | agentB intra-node cfg#1                                          |
[1796563072.363468] [vm:4234 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796563072.363468] [vm:4234 :0]   +--------+--------------------+------------------------------------+
[1796563072.363468] [vm:4234 :0]   | Range  |    Description     |               Config               |
[1796563072.363468] [vm:4234 :0]   +--------+--------------------+------------------------------------+
[1796563072.363468] [vm:4234 :0]   | 0..inf | software emulation | tcp/lo                             |
[1796563072.363468] [vm:4234 :0]   +--------+--------------------+------------------------------------+
"""
# Between nodes, over two RDMA lanes and, for small reads, another transport (the multi-lane
# and multi-row forms UCX prints).
RDMA = """\
[1.1] [h:1 :0]   | d-agent inter-node cfg#3                                          |
[1.1] [h:1 :0]   | remote memory read by ucp_get* into cuda memory from cuda |
[1.1] [h:1 :0]   +-----------+-------------+----------------------------------------------------+
[1.1] [h:1 :0]   |   0..8192 | copy-out    | tcp/eth0                                           |
[1.1] [h:1 :0]   | 8193..inf | zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
[1.1] [h:1 :0]   +-----------+-------------+----------------------------------------------------+
"""


def test_only_read_tables_count_with_their_locality_memory_and_transports():
    assert parse_read_paths(SHARED) == [ReadPath("intra-node", "host", "host", ("cma/memory",))]
    assert parse_read_paths(TCP) == [ReadPath("intra-node", "host", "host", ("tcp/lo",))]
    assert parse_read_paths(RDMA) == [ReadPath("inter-node", "cuda", "cuda",
                                               ("tcp/eth0", "rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"))]
    assert parse_read_paths(SHARED + TCP) == parse_read_paths(SHARED) + parse_read_paths(TCP)
    assert parse_read_paths("") == [] and parse_read_paths("garbage | x | y |\n") == []


def test_tcp_within_a_node_is_a_downgrade_and_so_is_no_rdma_between_nodes_where_required():
    [shared], [tcp], [rdma] = parse_read_paths(SHARED), parse_read_paths(TCP), parse_read_paths(RDMA)
    assert degraded_because(shared, require_rdma=True) == ""
    assert "over TCP (tcp/lo)" in degraded_because(tcp, require_rdma=False)
    assert degraded_because(rdma, require_rdma=True) == ""  # RDMA for the large reads
    tcp_between = ReadPath("inter-node", "host", "host", ("tcp/eth0",))
    assert degraded_because(tcp_between, require_rdma=False) == ""  # no RDMA asked for: TCP is the path
    assert "not RDMA" in degraded_because(tcp_between, require_rdma=True)


def test_a_peer_whose_tables_never_show_is_looked_up_a_bounded_number_of_times():
    """The log is read from disk per look: a peer UCX printed nothing for (its logging set by
    the operator, a memory pair it names otherwise) must not cost a read per transfer."""
    from types import SimpleNamespace

    from kvsvc.service.peer_transports import MAX_LOOKS, PeerTransports
    from kvsvc.service.peers import Peer

    reads = []
    node = SimpleNamespace(node_id="n1", pools={}, config=SimpleNamespace(require_rdma_between_nodes=False))
    peer = Peer("p:1", "p", 1, None, {}, None, node_id="n1")  # type: ignore[arg-type]
    transports = PeerTransports(node, lambda: reads.append(1) or [])  # type: ignore[arg-type]
    for _ in range(3 * MAX_LOOKS):
        transports.observe([peer])
    assert len(reads) == MAX_LOOKS and peer.transport is None
