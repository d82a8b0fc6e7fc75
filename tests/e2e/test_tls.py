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


def make_pki(d: Path, names: list[str], ips: tuple[str, ...] = ()) -> dict[str, tuple[Path, Path]]:
    """A CA and, per name, a certificate (CN = name, SAN = name, 127.0.0.1 and ips) with its key."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=kvsvc-test-ca")
    out = {}
    for name in names:
        sans = ",".join(f"IP:{ip}" for ip in ("127.0.0.1", *ips))
        (d / f"{name}.cnf").write_text(f"subjectAltName={sans},DNS:{name}\n"
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


async def test_mtls_doors_are_closed(tmp_path):
    """docs/SECURITY.md: under mTLS a valid certificate is not enough; each door has its owner."""
    certs = make_pki(tmp_path, ["tls-p", "tls-d", "tls-d2", "intruder"])
    layout = layout_table(k=4)
    p = start_server(engine_id="tls-p", role="prefill", tp_size=1, layout=layout,
                     config_file=server_config(tmp_path, "tls-p", certs, allowed=["tls-d", "tls-d2"]))
    d = start_server(engine_id="tls-d", role="decode", tp_size=1, layout=layout,
                     config_file=server_config(tmp_path, "tls-d", certs, allowed=["tls-p"]))
    # A server that says it is engine tls-p but holds another engine's certificate.
    fake = start_server(engine_id="tls-p", role="prefill", tp_size=1, layout=layout,
                        config_file=server_config(tmp_path, "intruder", certs))
    try:
        as_ = {n: options(tmp_path, certs, n, retries=0, timeout_s=10) for n in certs}
        async with AsyncClient(p.address, as_["intruder"]) as intruder:
            assert not (await intruder.get_info()).pools, "pool handles are for the engine only"
            for call in (intruder.publish_blocks("x", [[1]]), intruder.open_release_stream()):
                with pytest.raises(KvsvcError) as e:
                    await call
                assert (e.value.code.value, e.value.reason) == ("PERMISSION_DENIED", "NOT_AN_ENGINE")
        async with AsyncClient(p.address, as_["tls-p"]) as pc, AsyncClient(d.address, as_["tls-d"]) as dc, \
                AsyncClient(p.address, as_["tls-d"]) as as_d, AsyncClient(p.address, as_["tls-d2"]) as as_d2:
            assert (await pc.get_info()).pools
            pub = await pc.publish_blocks("owned", [[1]])
            epoch, token = pub.params.remote_epoch, pub.params.lease_token
            await as_d.claim_lease(pb.ClaimLeaseRequest(request_id="owned", lease_epoch=epoch, engine_id="tls-d",
                                                        tp_size=1, lease_token=token, claim_id="d" * 32))
            # Another allowed D engine, with the params in hand, cannot abort tls-d's lease.
            with pytest.raises(KvsvcError) as e:
                await as_d2.notify(pb.NotifyRequest(request_id="owned", kind=pb.NOTIFY_KIND_ABORTED,
                                                    engine_id="tls-d2", tp_size=1, lease_epoch=epoch,
                                                    lease_token=token))
            assert e.value.reason == "LEASE_NOT_OWNER"
            # ...its owner can (and so ends it now, not at P's shutdown drain).
            await as_d.notify(pb.NotifyRequest(request_id="owned", kind=pb.NOTIFY_KIND_ABORTED, engine_id="tls-d",
                                               tp_size=1, lease_epoch=epoch, claim_id="d" * 32))
            assert not (await pc.list_leases(request_ids=["owned"])).leases
            # D reads only from allowed P engines...
            evil = pb.TransferParams(remote_address=p.address, remote_engine_id="evil", remote_request_id="r",
                                     remote_epoch=epoch, remote_block_ids_per_group=[pb.BlockIds(block_ids=[1])])
            with pytest.raises(KvsvcError) as e:
                await dc.transfer("d-evil", evil, [[2]])
            assert e.value.reason == "PEER_NOT_ALLOWED"
            # ...and only from a server whose certificate proves it is that engine.
            impostor = pb.TransferParams(remote_address=fake.address, remote_engine_id="tls-p",
                                         remote_request_id="r", remote_epoch=1, lease_token=token,
                                         remote_block_ids_per_group=[pb.BlockIds(block_ids=[1])])
            with pytest.raises(Unavailable) as e:
                await dc.transfer("d-fake", impostor, [[2]])
            assert e.value.reason == "PEER_UNAVAILABLE"
            with pytest.raises(KvsvcError) as e:
                await as_d.transfer("d-x", impostor, [[2]])  # tls-d's certificate is not P's engine
            assert e.value.reason == "NOT_AN_ENGINE"
        # A TransferStream refused at once says why every time, whether the refusal reaches
        # the client through its read or through its first write (round three, 11: 21 of 40
        # were a bare UNAVAILABLE).
        async with AsyncClient(d.address, as_["tls-p"]) as not_d_engine:
            reasons = []
            for i in range(40):
                channel = not_d_engine.transfer_stream()
                try:
                    await channel.transfer(f"s{i}", impostor, [[2]])
                except KvsvcError as e:
                    reasons.append(e.reason if e.reason == "NOT_AN_ENGINE" else f"{e.reason}: {e.message}")
                finally:
                    await channel.close()
            assert reasons == ["NOT_AN_ENGINE"] * 40, reasons
    finally:
        for sp in (fake, d, p):
            sp.stop()
