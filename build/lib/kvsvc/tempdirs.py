"""Where kvsvc's private files go: the temp directory, when the host has a usable one.

kvsvc keeps three kinds of things there, each in a directory of its own made by mkdtemp
(a new name, mode 0700, so no other local user can plant a link where kvsvc writes):
the lease and transfer sockets' directories and UCX's protocol log. None of them is
needed to serve: on a host without a usable temp dir kvsvc says so once and serves
without them (gRPC only, no transports in GetInfo).
"""

from __future__ import annotations

import tempfile


def temp_root() -> str | None:
    """The temp directory Python would use, or None where there is no usable one (every
    candidate -- TMPDIR, /tmp, /var/tmp, /usr/tmp, the working directory -- unwritable)."""
    try:
        return tempfile.gettempdir()
    except OSError:
        return None
