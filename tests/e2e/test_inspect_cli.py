"""`kvsvc leases` and `kvsvc info --json` against real servers, in plaintext and under mutual TLS."""

from __future__ import annotations

import json
import subprocess
import sys

from kvsvc.cli.procs import start_server
from kvsvc.client import AsyncClient
from tests.e2e.harness import layout_table
from tests.e2e.test_tls import make_pki, server_config

LAYOUT = layout_table(k=4)


def kvsvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsvc.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


async def test_leases_and_info_of_a_pd_pair():
    p = start_server(engine_id="cli-p", role="prefill", tp_size=1, layout=LAYOUT)
    d = start_server(engine_id="cli-d", role="decode", tp_size=1, layout=LAYOUT)
    try:
        async with AsyncClient(p.address) as pc, AsyncClient(d.address) as dc:
            moved = await pc.publish_blocks("moved", [[1]])
            await pc.publish_blocks("waiting", [[2, 3]])
            await dc.transfer("d-moved", moved.params, [[4]])
        out = kvsvc("leases", p.address, "--json")
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        assert listed["live_leases"] == 1 and [x["request_id"] for x in listed["leases"]] == ["waiting"]
        assert listed["leases"][0]["state"] == "LEASE_STATE_OFFERED" and listed["leases"][0]["num_blocks"] == 2
        text = kvsvc("leases", d.address)
        assert text.returncode == 0, text.stderr
        assert f"peer {p.address}  engine cli-p" in text.stdout and "LeaseChannel open (socket)" in text.stdout
        info = kvsvc("info", p.address, "--json")
        assert info.returncode == 0 and json.loads(info.stdout)["engine_id"] == "cli-p"
    finally:
        p.stop()
        d.stop()


def test_leases_under_mutual_tls(tmp_path):
    certs = make_pki(tmp_path, ["tls-p", "someone"])
    p = start_server(engine_id="tls-p", role="prefill", tp_size=1, layout=LAYOUT,
                     config_file=server_config(tmp_path, "tls-p", certs))
    ca = str(tmp_path / "ca.pem")
    try:
        as_engine = kvsvc("leases", p.address, "--json", "--ca", ca, "--cert", str(certs["tls-p"][0]),
                          "--key", str(certs["tls-p"][1]))
        assert as_engine.returncode == 0, as_engine.stderr
        assert json.loads(as_engine.stdout) == {} or json.loads(as_engine.stdout).get("live_leases", 0) == 0
        # Another certificate of the same CA is not the engine: refused, said plainly.
        other = kvsvc("leases", p.address, "--ca", ca, "--cert", str(certs["someone"][0]),
                      "--key", str(certs["someone"][1]))
        assert other.returncode == 2 and "NOT_AN_ENGINE" in other.stderr, other.stderr
        # No TLS against a TLS server: unreachable, not a traceback.
        plain = kvsvc("leases", p.address, "--timeout", "2")
        assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr
        missing_ca = kvsvc("info", p.address, "--cert", str(certs["tls-p"][0]))
        assert missing_ca.returncode != 0 and "--ca" in missing_ca.stderr
    finally:
        p.stop()


def test_serve_prints_bound_and_advertised_addresses(tmp_path):
    cfg = tmp_path / "adv.toml"
    cfg.write_text('[server]\nadvertised_address = "10.9.8.7:4321"\nmemory = "none"\n')
    sp = start_server(engine_id="adv", role="decode", tp_size=1, layout=LAYOUT, config_file=str(cfg))
    try:
        line = next(x for x in sp.output if "kvsvc listening on" in x)
        assert f"kvsvc listening on {sp.address}, advertised to peers as 10.9.8.7:4321" in line
        info = kvsvc("info", sp.address, "--json")
        assert json.loads(info.stdout)["advertised_address"] == "10.9.8.7:4321"
    finally:
        sp.stop()


def test_serve_in_json_log_mode_says_where_it_listens_in_json(tmp_path):
    """--log-format json (given after the subcommand, with -v): stdout's lines are JSON
    objects too, the ready line with the address as a field."""
    cfg = tmp_path / "m.toml"
    cfg.write_text('[server]\nmemory = "none"\nmetrics_listen = "127.0.0.1:0"\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvsvc.cli.main", "serve", "-v", "--log-format", "json",
                             "--listen", "127.0.0.1:0", "--config", str(cfg), "--engine-id", "jl"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        metrics, ready = json.loads(proc.stdout.readline()), json.loads(proc.stdout.readline())
        assert metrics["event"] == "metrics" and metrics["metrics_url"].startswith("http://127.0.0.1:")
        assert ready["event"] == "listening" and ready["message"].startswith(f"kvsvc listening on {ready['address']}")
        assert ready["engine_id"] == "jl" and ready["ranks"] == [0]
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and all(json.loads(line) for line in err.splitlines() if line.strip()), err[-2000:]


def test_health_answers_serving_over_mutual_tls_and_fails_otherwise(tmp_path):
    """`kvsvc health` is what the Kubernetes probes run: SERVING -> 0, anything else -> 1."""
    certs = make_pki(tmp_path, ["tls-h"])
    ca = str(tmp_path / "ca.pem")
    p = start_server(engine_id="tls-h", role="prefill", tp_size=1, layout=layout_table(k=4), memory="none",
                     config_file=server_config(tmp_path, "tls-h", certs))
    tls = ["--ca", ca, "--cert", str(certs["tls-h"][0]), "--key", str(certs["tls-h"][1]), "--server-name", "tls-h"]
    try:
        ok = kvsvc("health", p.address, *tls)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok
        no_cert = kvsvc("health", p.address, "--ca", ca, "--server-name", "tls-h", "--timeout", "3")
        assert no_cert.returncode == 1 and "kvsvc health:" in no_cert.stderr, no_cert  # mTLS wants a certificate
        plaintext = kvsvc("health", p.address, "--timeout", "3")  # no --ca: the TLS server's socket closes
        assert plaintext.returncode == 1 and "give --ca" in plaintext.stderr, plaintext
    finally:
        assert p.stop() == 0
    gone = kvsvc("health", p.address, *tls, "--timeout", "2")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr and "Traceback" not in gone.stderr, gone
