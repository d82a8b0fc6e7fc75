"""Mutual TLS: engines and peers present certificates from one CA; a client without one is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.errors import Unavailable
from tests.e2e.harness import layout_table, session, transfer_and_check


def make_pki(d: Path) -> dict[str, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=kvsvc-test-ca")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "node.pem",
        "-days", "1", "-extfile", "ext.cnf")
    return {"ca": d / "ca.pem", "cert": d / "node.pem", "key": d / "node.key"}


async def test_mutual_tls_transfer(tmp_path):
    pki = make_pki(tmp_path)
    cfg = tmp_path / "tls.toml"
    cfg.write_text(f'[server]\ntls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
                   f'tls_client_ca_file = "{pki["ca"]}"\npeer_tls_ca_file = "{pki["ca"]}"\n')
    layout = layout_table(k=4)
    p = start_server(engine_id="tls-p", role="prefill", tp_size=2, layout=layout, config_file=str(cfg))
    d = start_server(engine_id="tls-d", role="decode", tp_size=1, layout=layout, config_file=str(cfg))
    opts = ClientOptions(tls_root_certs=pki["ca"].read_bytes(), tls_client_cert=pki["cert"].read_bytes(),
                         tls_client_key=pki["key"].read_bytes())
    try:
        async with session(p, d, opts) as s:
            await transfer_and_check(s, "tls-1", [[1, 2]], [[3, 4]])  # D dialed P over mTLS
        no_cert = ClientOptions(tls_root_certs=pki["ca"].read_bytes(), retries=0, timeout_s=5)
        async with AsyncClient(p.address, no_cert) as anon:
            with pytest.raises(Unavailable):
                await anon.get_info()
        async with AsyncClient(p.address, ClientOptions(retries=0, timeout_s=5)) as plain:
            with pytest.raises(Unavailable):
                await plain.get_info()
    finally:
        p.stop()
        d.stop()
