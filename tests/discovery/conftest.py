"""A real etcd (Debian's etcd-server) on free loopback ports, started and stopped by the fixture."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.procs import stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The client URL of a fresh single-member etcd."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("KVSVC_REQUIRE_ETCD"):
            pytest.fail("etcd is not installed (apt-get install etcd-server) and KVSVC_REQUIRE_ETCD is set")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    client, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{client}"
    data = tmp_path_factory.mktemp("etcd")
    log = open(data / "etcd.log", "wb")  # open for the server's whole life, closed below
    proc = subprocess.Popen(
        [binary, "--name", "kvsvc-test", "--data-dir", str(data / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"kvsvc-test=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{(data / 'etcd.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield url
    finally:
        stop(proc)
        log.close()
