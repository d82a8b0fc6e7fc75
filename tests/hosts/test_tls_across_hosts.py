"""Mutual TLS across hosts: P and D on two hosts, each with a certificate naming its engine
(and its host's address), move KV byte for byte; a server on a third host that says it is
engine tls-p but holds another certificate is refused; the metrics of P's server are read
from another host (this test, on the bridge)."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.errors import Unavailable
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import layout_table, session, transfer_and_check
from tests.e2e.test_tls import make_pki, options
from tests.hosts.harness import Host, hosts

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def config_on(host: Host, name: str, allowed: list[str]) -> str:
    """The server's config on its host, pointing at the PKI copied to the host's temp dir."""
    allowed_toml = ", ".join(f'"{a}"' for a in allowed)
    pki = f"{host.tmp}/pki"
    return host.write(f"{host.tmp}/{name}.toml", f'[server]\ntls_cert_file = "{pki}/{name}.pem"\n'
                      f'tls_key_file = "{pki}/{name}.key"\ntls_client_ca_file = "{pki}/ca.pem"\n'
                      f'peer_tls_ca_file = "{pki}/ca.pem"\nallowed_peers = [{allowed_toml}]\n'
                      'metrics_listen = "0.0.0.0:9400"\n')


async def test_mtls_between_hosts_and_an_impostor_on_a_third(tmp_path: Path):
    layout = layout_table(k=4)
    with hosts(3) as (a, b, c):
        certs = make_pki(tmp_path, ["tls-p", "tls-d", "intruder"], ips=(a.address, b.address, c.address))
        for h in (a, b, c):
            shutil.copytree(tmp_path, f"/proc/{h.pid}/root{h.tmp}/pki",
                            ignore=shutil.ignore_patterns("*.csr", "*.cnf", "ca.key", "*.srl"))
        procs = []
        try:
            p = start_server(engine_id="tls-p", role="prefill", tp_size=1, layout=layout, listen=f"{a.address}:0",
                             launcher=a.launcher, config_file=config_on(a, "tls-p", ["tls-d"]))
            procs.append(p)
            d = start_server(engine_id="tls-d", role="decode", tp_size=1, layout=layout, listen=f"{b.address}:0",
                             launcher=b.launcher, config_file=config_on(b, "tls-d", ["tls-p"]))
            procs.append(d)
            fake = start_server(engine_id="tls-p", role="prefill", tp_size=1, layout=layout,
                                listen=f"{c.address}:0", launcher=c.launcher,
                                config_file=config_on(c, "intruder", ["tls-d"]))
            procs.append(fake)
            async with session(p, d, options(tmp_path, certs, "tls-p"), options(tmp_path, certs, "tls-d"),
                               shm_dirs=(a.shm_dir, b.shm_dir)) as s:
                await transfer_and_check(s, "mtls", [[1, 2]], [[3, 4]])  # D dialled P on host a as tls-d
                impostor = pb.TransferParams(remote_address=fake.address, remote_engine_id="tls-p",
                                             remote_request_id="r", remote_epoch=1, lease_token="0" * 32,
                                             remote_block_ids_per_group=[pb.BlockIds(block_ids=[1])])
                with pytest.raises(Unavailable) as e:  # its certificate does not prove it is tls-p
                    await s.dc.transfer("d-fake", impostor, [[2]])
                assert e.value.reason == "PEER_UNAVAILABLE"
            with urllib.request.urlopen(f"http://{a.address}:9400/metrics", timeout=10) as r:
                text = r.read().decode()
            # The consumed lease of the transfer above, counted on P's host, read from here.
            consumed = [line for line in text.splitlines() if line.startswith("kvsvc_lease_releases_total{")
                        and 'engine="tls-p"' in line and 'reason="consumed"' in line]
            assert consumed and float(consumed[0].rsplit(" ", 1)[1]) == 1.0, text[-2000:]
        finally:
            for sp in reversed(procs):
                sp.stop()
