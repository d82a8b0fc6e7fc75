"""kvsvc's same-host sockets: protobuf messages framed on a Unix socket (both ends use this).

A gRPC stream message costs each end ~0.2 ms of CPU in gRPC's own machinery on a small
host; the same message framed on a Unix socket costs a tenth of that. Two streams have
such a carrier between processes of one host: a D server's lease calls to a P server
(the lease socket, offered in the handshake answer) and an engine's transfers to its D
server (the transfer socket, offered in GetInfo). Both sit in a directory of mode 0700
that only the server's user may enter, and neither is offered under TLS.

Framing: a 4-byte little-endian length, then the serialized message. The server's end is
service/local_socket.py; the client's end is client/socket_call.py.
"""

from __future__ import annotations

from google.protobuf.message import Message

HEADER_BYTES = 4
# A server's socket is <temp dir>/kvsvc-<epoch>-<random>/<name>; clients connect only to
# paths of that shape, so a peer cannot point them at some other service's socket.
SOCKET_DIR_PREFIX = "kvsvc-"
LEASE_SOCKET_NAME = "lease.sock"
TRANSFER_SOCKET_NAME = "transfer.sock"
SOCKET_NAMES = (LEASE_SOCKET_NAME, TRANSFER_SOCKET_NAME)
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# Bytes written to a socket and not yet taken by the server past which the connection
# counts as broken (at ~100 bytes a message: tens of thousands of unanswered messages).
MAX_UNSENT_BYTES = 4 << 20


def frame(msg: Message) -> bytes:
    data = msg.SerializeToString()
    return len(data).to_bytes(HEADER_BYTES, "little") + data


def split_frames(buf: bytearray, max_bytes: int) -> tuple[list[bytes], int]:
    """The whole frames at the start of buf, taken out of it (their bodies), and the size a
    frame announced past max_bytes (0: none; the connection is then to be ended)."""
    bodies: list[bytes] = []
    while len(buf) >= HEADER_BYTES:
        size = int.from_bytes(buf[:HEADER_BYTES], "little")
        if size > max_bytes:
            return bodies, size
        if len(buf) < HEADER_BYTES + size:
            break
        bodies.append(bytes(buf[HEADER_BYTES:HEADER_BYTES + size]))
        del buf[:HEADER_BYTES + size]
    return bodies, 0


def socket_path_of(path: str, name: str) -> str:
    """path when it is a kvsvc socket called name that a server may offer (absolute,
    kvsvc's shape), else ""."""
    parts = path.rsplit("/", 2)
    ok = (path.startswith("/") and len(path.encode()) <= _MAX_SOCKET_PATH and len(parts) == 3
          and parts[2] == name and parts[1].startswith(SOCKET_DIR_PREFIX) and ".." not in parts)
    return path if ok else ""
