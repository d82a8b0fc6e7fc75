"""vLLM across hosts: a P engine on host a, a D engine on host b, kvsvc's router on host c.

Hosts are simulated (tests/hosts/harness.py: own address, /dev/shm, temp dir, hostname, boot
id), so the KV moves over UCX on the network and every call crosses hosts; the embedded
kvsvc servers listen on and advertise their host's address (`listen_host`). Answers equal
the aggregated run's; P releases each request CONSUMED and holds no lease after. Then P's
cable is pulled while D reads a request: a typed failure, the request recomputed exactly,
and the same engines serving through kvsvc again once the cable is back.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
import time

import pytest

from tests.hosts.harness import Host, available, hosts
from tests.vllm.engines import kernel_block_size, kvsvc
from tests.vllm.prompts import PROMPTS
from tests.vllm.releases import Releases, p_servers
from tests.vllm.served import Served, completion, tokens_and_logprobs

pytestmark = [pytest.mark.full, pytest.mark.timeout(900),
              pytest.mark.skipif(available() is not None, reason=str(available()))]

PORT = 8000  # every host has its own network: the same port on each
LEASE_TTL_S = 40  # P: how long the lease of a request D could not reach P about stays
CONSUMED = "RELEASE_REASON_CONSUMED"


def serve_on(host: Host, name: str, model_dir: str, connector: dict, logs) -> Served:
    argv = [*host.launcher, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--host", host.address, "--port", str(PORT), "--skip-tokenizer-init", "--return-tokens-as-token-ids",
            "--enforce-eager", "--max-model-len", "512", "--block-size", str(kernel_block_size()),
            "--kv-transfer-config", json.dumps(connector)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache: the test empties the caches
    return Served(name, argv, logs, PORT, env, host=host.address)


def test_p_d_and_router_on_three_hosts_equal_the_aggregated_run(engines, reference, tmp_path):
    with hosts(3) as (a, b, c):
        for h in (a, b):  # each host has its own temp dir: the model is copied there
            shutil.copytree(engines.model, f"/proc/{h.pid}/root{h.tmp}/model")
        p = serve_on(a, "hosts-p", f"{a.tmp}/model",
                     kvsvc("kv_producer", listen_host=a.address, lease_ttl_s=LEASE_TTL_S), tmp_path)
        d = serve_on(b, "hosts-d", f"{b.tmp}/model", kvsvc("kv_consumer", listen_host=b.address), tmp_path)
        procs = [p, d]
        try:
            p.wait_ready()
            d.wait_ready()
            r = Served("hosts-router", [*c.launcher, sys.executable, "-m", "kvsvc.integrations.vllm.router",
                                        "--prefill", p.url, "--decode", d.url, "--host", c.address,
                                        "--port", str(PORT)], tmp_path, PORT, host=c.address)
            procs.append(r)
            r.wait_ready(120)
            kv = p.post("/v1/completions", completion(PROMPTS[5], 1, kv_transfer_params={"do_remote_decode": True}))[
                "kv_transfer_params"]
            servers = p_servers(kv)
            assert servers and all(s.startswith(a.address + ":") for s in servers), servers
            releases = Releases(servers)
            try:
                direct = d.post("/v1/completions", completion(PROMPTS[5], 8, kv_transfer_params=kv))
                assert tokens_and_logprobs(direct) == reference["alone-5"][0]
                routed = r.post("/v1/completions", completion(PROMPTS[9], 8))
                assert tokens_and_logprobs(routed) == reference["alone-9"][0]
                got = releases.wait([kv["remote_request_id"]], timeout_s=60)
                assert got.get(kv["remote_request_id"]) == [CONSUMED], (got, d.tail())
                deadline = time.monotonic() + 30
                while len(releases.events) < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert sorted(reason for _, _, reason, _at in releases.events) == [CONSUMED] * 2, releases.events
                assert releases.live_leases() == 0
            finally:
                releases.close()
            link_pulled_while_d_reads(a, p, d, r, reference)
        finally:
            for s in reversed(procs):
                s.stop()


QUARANTINED = re.compile(r"transfer \S+: \d+ READs still in flight .* quarantined")
FAILED = re.compile(r"kvsvc: transfer of \S+ failed: ([A-Z_]+)")


def link_pulled_while_d_reads(a: Host, p: Served, d: Served, r: Served, reference) -> None:
    """P's host loses its cable after P leased a request and before D reads it, so D's
    READ and claim go out on a dead link (as when the link goes mid-READ: nothing comes
    back). D's transfer must fail typed and hold its blocks until UCX ends the READ (after
    the cable is back: quarantined until then), then vLLM recomputes: the answer is the
    aggregated run's. Once the link is back the same engines serve through kvsvc again, and
    P gets the failed request's blocks back (by its lease's TTL: D's abort found no path)."""
    assert d.blocks_all_free()  # nothing of PROMPTS[5] cached on D: it must read
    kv = p.post("/v1/completions", completion(PROMPTS[5], 1, kv_transfer_params={"do_remote_decode": True}))[
        "kv_transfer_params"]
    answer: list = []
    a.link(False)
    try:
        asked = threading.Thread(target=lambda: answer.append(
            d.post("/v1/completions", completion(PROMPTS[5], 8, kv_transfer_params=kv), timeout_s=600)), daemon=True)
        asked.start()
        # Until D's transfer is quarantined (its READ cannot end while the cable is out) or the
        # request ended (UCX ended the READ itself): the events this waits on, bounded.
        deadline = time.monotonic() + 300
        while asked.is_alive() and not QUARANTINED.search(d.log.read_text(errors="replace")):
            assert time.monotonic() < deadline, ("D's transfer neither failed nor ended", d.tail())
            time.sleep(0.5)
    finally:
        a.link(True)
    asked.join(300)
    assert answer, ("D never answered", d.tail())
    assert tokens_and_logprobs(answer[0]) == reference["alone-5"][0]  # recomputed by D, exact
    failed = FAILED.findall(d.log.read_text(errors="replace"))
    assert len(failed) == 1 and failed[0] in ("PEER_UNAVAILABLE", "DEADLINE_EXCEEDED", "NIXL_ERROR", "UNAVAILABLE"), \
        (failed, d.tail())
    routed = r.post("/v1/completions", completion(PROMPTS[9], 8))  # the link is back: through kvsvc again
    assert tokens_and_logprobs(routed) == reference["alone-9"][0]
    assert len(FAILED.findall(d.log.read_text(errors="replace"))) == 1
    assert p.blocks_all_free(timeout_s=LEASE_TTL_S + 60), ("P still holds the failed request's blocks", p.tail())
    assert d.blocks_all_free()
