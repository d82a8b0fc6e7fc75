"""Mutual TLS: engines and peers present certificates from one CA; clients without one are refused;
with allowed_peers only the named engines, holding matching certificates, may read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient, ClientOptions
from kvsvc.codec import layout_to_proto
from kvsvc.errors import KvsvcError, Unavailable
from kvsvc.layout import layout_from_dict
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.e2e.harness import layout_table, session, transfer_and_check


def make_pki(d: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """A CA and, per name, a certificate (CN = name, SAN = name and 127.0.0.1) with its key."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=kvsvc-test-ca")
    out = {}
    for name in names:
        (d / f"{name}.cnf").write_text(f"subjectAltName=IP:127.0.0.1,DNS:{name}\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.cnf")
        out[name] = (d / f"{name}.pem", d / f"{name}.key")
    return out


def server_config(d: Path, name: str, certs: dict, allowed: list[str] | None = None) -> str:
    cert, key = certs[name]
    ca = d / "ca.pem"
    text = (f'[server]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\ntls_client_ca_file = "{ca}"\n'
            f'peer_tls_ca_file = "{ca}"\n')
    if allowed is not None:
        text += f"allowed_peers = {allowed!r}\n".replace("'", '"')
    path = d / f"{name}.toml"
    path.write_text(text)
    return str(path)


def options(d: Path, certs: dict, name: str | None, **kw) -> ClientOptions:
    ca = (d / "ca.pem").read_bytes()
    if name is None:
        return ClientOptions(tls_root_certs=ca, **kw)
    cert, key = certs[name]
    return ClientOptions(tls_root_certs=ca, tls_client_cert=cert.read_bytes(), tls_client_key=key.read_bytes(), **kw)


async def test_mutual_tls_and_allowed_peers(tmp_path):
    certs = make_pki(tmp_path, ["tls-p", "tls-d", "intruder"])
    layout = layout_table(k=4)
    p = start_server(engine_id="tls-p", role="prefill", tp_size=2, layout=layout,
                     config_file=server_config(tmp_path, "tls-p", certs, allowed=["tls-d"]))
    d = start_server(engine_id="tls-d", role="decode", tp_size=1, layout=layout,
                     config_file=server_config(tmp_path, "tls-d", certs))
    try:
        # The engines (here: this test) talk to their servers with their own certificates.
        async with session(p, d, options(tmp_path, certs, "tls-p"), options(tmp_path, certs, "tls-d")) as s:
            await transfer_and_check(s, "tls-1", [[1, 2]], [[3, 4]])  # D dialed P over mTLS, as tls-d
        hello = pb.HandshakeRequest(engine_id="intruder", tp_size=1,
                                    layout=layout_to_proto(layout_from_dict(layout, 1)))
        async with AsyncClient(p.address, options(tmp_path, certs, "intruder", retries=0)) as intruder:
            with pytest.raises(KvsvcError) as e:
                await intruder.handshake(hello)  # not an allowed engine
            assert (e.value.code.value, e.value.reason) == ("PERMISSION_DENIED", "PEER_NOT_ALLOWED")
            hello.engine_id = "tls-d"
            with pytest.raises(KvsvcError) as e:
                await intruder.handshake(hello)  # an allowed name, but not its certificate
            assert e.value.reason == "PEER_NOT_ALLOWED" and "does not match its certificate" in e.value.message
        async with AsyncClient(p.address, options(tmp_path, certs, None, retries=0, timeout_s=5)) as anon:
            with pytest.raises(Unavailable):
                await anon.get_info()
        async with AsyncClient(p.address, ClientOptions(retries=0, timeout_s=5)) as plain:
            with pytest.raises(Unavailable):
                await plain.get_info()
    finally:
        p.stop()
        d.stop()
