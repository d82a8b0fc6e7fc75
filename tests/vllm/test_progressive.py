"""Streamed requests (progressive pull) between real vLLM engines, through kvsvc's router.

The router (--progressive) sends each request to P and D at once: P prefills it in chunks
(64 tokens a step here) and commits each chunk's blocks to a lease named by the router; D
reads each chunk while P computes the next. Answers equal the aggregated run (greedy token
ids and logprobs); D holding a prefix reads only the tail; a client that goes away (right
after sending, at D's first token, mid-decode) leaves neither engine holding a block nor P a
lease; a P killed mid-stream fails D's load typed and D recomputes the request exactly; a
stream P preempts (its cache full) is revoked and D recomputes it exactly; a stream lost
under the "fail" policy is retried pulled by the router. Preemption and abort on P at each
step are also driven through the connector's own scheduler and workers in
test_stream_workers.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.client import Client
from kvsvc.integrations.vllm import stream_params
from kvsvc.v1 import kv_transfer_pb2 as pb
from tests.vllm.compare import same
from tests.vllm.engines import KVSVC, PATIENT, Engine, kernel_block_size, kvsvc, kvsvc_servers
from tests.vllm.prompts import LONGER, PREEMPTED, PROMPTS
from tests.vllm.releases import Releases
from tests.vllm.served import (
    Served,
    completion,
    router,
    streamed_events,
    streamed_token_ids,
    tokens_and_logprobs,
    vllm_serve,
)

pytestmark = pytest.mark.timeout(900)

CHUNK_TOKENS = 64  # P's prefill step: PROMPTS[10] (200 tokens) takes four


@contextlib.contextmanager
def pair(model: Path, logs: Path, p_tp: int = 1, d_tp: int = 1, d_args: tuple[str, ...] = (),
         p_env: dict[str, str] | None = None, d_conf: dict | None = None,
         digests: bool = False) -> Iterator[tuple[Served, Served, Served]]:
    """P (prefilling in chunks, without a prefix cache: a prompt sent twice is prefilled and
    streamed twice), D (recomputing a failed load, unless d_conf says otherwise), and kvsvc's
    router with --progressive; digests: both servers take and check content digests."""
    extra = {"content_digest": True} if digests else {}
    p = vllm_serve(f"stream-p-tp{p_tp}", model, logs, kvsvc("kv_producer", lease_ttl_s=40, **extra), tp=p_tp,
                   extra_args=("--max-num-batched-tokens", str(CHUNK_TOKENS), "--no-enable-prefix-caching"),
                   env=p_env)
    d = vllm_serve(f"stream-d-tp{d_tp}", model, logs, d_conf or kvsvc("kv_consumer", **extra), tp=d_tp,
                   extra_args=d_args)
    procs: list[Served] = [p, d]
    try:
        p.wait_ready()
        d.wait_ready()
        r = router(logs, p, d, "--progressive")
        procs.append(r)
        r.wait_ready(60)
        yield p, d, r
    finally:
        for s in procs:
            s.stop()


@pytest.fixture(scope="module")
def streamed(engines, reference, tmp_path_factory):
    with pair(engines.model, tmp_path_factory.mktemp("streamed")) as (p, d, r):
        # The router streams to a P once it has seen an answer of it (naming P's servers).
        assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[5], 8))) == reference["alone-5"][0]
        yield p, d, r


def chunks_read(d: Served) -> tuple[float, float]:
    m = d.metrics()
    return m.get("vllm:kvsvc_streamed_chunks_growing_total", 0.0), m.get("vllm:kvsvc_streamed_chunks_final_total", 0.0)


def nothing_held(p: Served, d: Served) -> None:
    assert p.blocks_all_free(), ("P still holds blocks", p.tail())
    assert d.blocks_all_free(), ("D still holds blocks", d.tail())


def test_streamed_requests_equal_the_aggregated_run(streamed, reference):
    p, d, r = streamed
    releases = Releases(kvsvc_servers(p.log))
    try:
        pulled = d.wait_metric("vllm:kvsvc_overhead_seconds_count", 1)  # the fixture's first request
        before = sum(chunks_read(d))
        routed = r.post("/v1/completions", completion(PROMPTS[10], 8))
        assert tokens_and_logprobs(routed) == reference["alone-10"][0]
        streamed_ids = streamed_token_ids(streamed_events(r.url, completion(PROMPTS[9], 8, stream=True)))
        assert streamed_ids == reference["alone-9"][0]["token_ids"]
        # Both were streamed: D read them as committed chunks (not as a whole lease), and
        # each stream lease was consumed on P.
        assert d.wait_metric("vllm:kvsvc_streamed_chunks_final_total", 1) >= 1
        growing, final = chunks_read(d)
        assert growing + final - before >= 2, (growing, final)
        # The chunk completing each prompt was committed layer by layer as P's forward saved them.
        assert p.wait_metric("vllm:kvsvc_layer_commits_total", 2) >= 2
        # A prompt whose last chunk fills whole blocks (128 tokens: chunks 64 and 64, blocks of
        # 16 or 32): P commits those blocks' first layers while it computes the rest, and D may
        # read them then -- the bytes of a layer read before the forward wrote it would change
        # the answer. Whether D's wait is outstanding when a partial commit lands is timing
        # (D may still be reading the first chunk and then see the whole one), so only P's
        # commits are asserted here; tests/e2e/test_progressive_digests.py reads partial
        # chunks deterministically, holding each commit.
        growing_before = chunks_read(d)[0]
        routed = r.post("/v1/completions", completion(PROMPTS[8], 8))
        same([tokens_and_logprobs(routed)], [reference["all"][8]], batched=True)  # (the reference batched it)
        assert p.wait_metric("vllm:kvsvc_layer_commits_total", 3) >= 3
        print(f"D read {chunks_read(d)[0] - growing_before:.0f} growing chunks of the 128-token prompt")
        print(f"D read {growing:.0f} chunks while P prefilled and {final:.0f} after")  # timing, not asserted
        # kvsvc's overhead above the READs is counted for pulled transfers only (a stream's
        # call also waits for P's prefill).
        assert d.metrics()["vllm:kvsvc_overhead_seconds_count"] == pulled
        got = releases.wait([], timeout_s=5)
        streams = {rid: reasons for rid, reasons in got.items() if rid.startswith("kvsvc-stream-")}
        assert len(streams) >= 2 and all(v == ["RELEASE_REASON_CONSUMED"] for v in streams.values()), got
        assert releases.live_leases() == 0
    finally:
        releases.close()
    nothing_held(p, d)


def test_d_holding_a_prefix_reads_only_the_tail(streamed, reference):
    """LONGER twice: the second time D holds its whole blocks (its prefix cache) and reads
    only the last, partial one of P's stream; both answers equal the aggregated run."""
    p, d, r = streamed
    first = r.post("/v1/completions", completion(LONGER, 8))
    assert tokens_and_logprobs(first) == reference["longer"][0]
    bytes_before = d.metrics().get("vllm:kvsvc_bytes_transferred_sum", 0.0)
    count_before = d.metrics().get("vllm:kvsvc_bytes_transferred_count", 0.0)
    again = r.post("/v1/completions", completion(LONGER, 8))
    assert tokens_and_logprobs(again) == reference["longer"][0]
    assert d.wait_metric("vllm:kvsvc_bytes_transferred_count", count_before + 1) >= count_before + 1
    tail = d.metrics()["vllm:kvsvc_bytes_transferred_sum"] - bytes_before
    whole = bytes_before / max(count_before, 1)
    assert 0 < tail < whole / 2, (tail, whole)  # one block of LONGER's five
    nothing_held(p, d)


def _go_away(url: str, after_events: int) -> int:
    """Send a long streamed request and close the connection after reading `after_events` of
    its data events (0: right after sending it, before any answer); how many were read."""
    body = json.dumps(completion(PROMPTS[10], 300, ignore_eos=True, stream=True)).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        seen = 0
        stream = sock.makefile("rb")
        while seen < after_events:
            line = stream.readline()
            if not line:
                break
            seen += line.startswith(b"data: {")
        return seen  # closing the socket here is the client going away


def _a_stream_released(releases: Releases, seen: set[str], timeout_s: float = 120) -> None:
    """Until P released a stream lease not in seen (the request the client left)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(rid.startswith("kvsvc-stream-") and rid not in seen for rid in releases.by_request()):
            return
        time.sleep(0.05)
    raise AssertionError(f"no new stream lease was released: {releases.by_request()}")


@pytest.mark.parametrize("after_events", [0, 1, 50])
def test_a_client_that_goes_away_mid_stream_leaves_nothing_held(streamed, reference, after_events):
    """The client goes away right after sending (wherever P's prefill, D's read or the router
    then are), at D's first token, and mid-decode (50 of 300 tokens): both engines abort the
    request, P's lease is revoked or released, no block stays held on either side, and the
    next request is served exactly."""
    p, d, r = streamed
    releases = Releases(kvsvc_servers(p.log))
    try:
        seen = set(releases.by_request())
        assert _go_away(r.url, after_events) == after_events
        # The router goes on with the request after the client left (right after sending:
        # P may not even have it yet): its stream lease ends first -- consumed by D, which
        # then notices the client gone at its first token -- and only then is nothing held.
        _a_stream_released(releases, seen)
        nothing_held(p, d)
        assert releases.live_leases() == 0
    finally:
        releases.close()
    assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[10], 8))) == reference["alone-10"][0]


def test_the_long_request_the_abort_test_sends_is_served_whole(streamed):
    """What the test above abandons is a request the engines serve (not one refused at once)."""
    _, _, r = streamed
    answer = r.post("/v1/completions", completion(PROMPTS[10], 300, ignore_eos=True))
    assert len(answer["choices"][0]["token_ids"]) == 300


def _claimed_mid_stream(p_server: str, lease_id: str, timeout_s: float = 120) -> int:
    """Until P's server lists lease_id claimed by D; its blocks then (P's first chunk)."""
    deadline = time.monotonic() + timeout_s
    with Client(p_server) as c:
        while time.monotonic() < deadline:
            leases = c.list_leases(request_ids=[lease_id]).leases
            if leases and leases[0].state == pb.LEASE_STATE_CLAIMED:
                return leases[0].num_blocks
            time.sleep(0.05)
    raise AssertionError(f"D never claimed {lease_id}")


def test_a_p_killed_mid_stream_fails_the_load_typed_and_d_recomputes_exactly(engines, reference, tmp_path):
    """P's kvsvc server takes the first chunk of each stream and drops its later commits
    (KVSVC_FAULTS=stream_stalled: P hung mid-prefill), so D is held on a growing lease -- claimed,
    one chunk read -- when P's whole engine is killed. D's load fails typed (P unreachable), D
    recomputes the request (kv_load_failure_policy "recompute") token for token, holds no block,
    and serves the next request exactly. Driven as the router drives a stream (P and D at once),
    without the router, so that P's answer is in before P is killed."""
    with pair(engines.model, tmp_path, p_env={"KVSVC_FAULTS": "stream_stalled"}) as (p, d, _):
        warm = p.post("/v1/completions", {**completion(PROMPTS[5], 1),
                                          "kv_transfer_params": {"do_remote_decode": True}})
        ident = stream_params.identity(warm["kv_transfer_params"])
        assert ident is not None
        assert tokens_and_logprobs(d.post("/v1/completions", {**completion(PROMPTS[5], 8),
                                                              "kv_transfer_params": warm["kv_transfer_params"]})) \
            == reference["alone-5"][0]  # a whole lease: the fault leaves it alone
        order = stream_params.new_stream()
        failed_before = d.metrics().get("vllm:kvsvc_num_failed_transfers_total", 0.0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            on_d = pool.submit(d.post, "/v1/completions", {
                **completion(PROMPTS[10], 8), "kv_transfer_params": stream_params.decode_stream_params(ident, order)})
            p.post("/v1/completions", {**completion(PROMPTS[10], 1),
                                       "kv_transfer_params": stream_params.prefill_stream_params(order)})
            [p_server] = kvsvc_servers(p.log)
            held = _claimed_mid_stream(p_server, order.lease_id)
            assert 0 < held < -(-len(PROMPTS[10]) // kernel_block_size()), held  # one chunk of four
            p.signal(signal.SIGKILL)
            p.proc.wait(30)
            answer = on_d.result(300)
        assert tokens_and_logprobs(answer) == reference["alone-10"][0]
        assert d.wait_metric("vllm:kvsvc_num_failed_transfers_total", failed_before + 1) == failed_before + 1
        why = re.findall(r"kvsvc: transfer of \S+ failed: (\w+)", d.log.read_text(errors="replace"))
        assert why == ["PEER_UNAVAILABLE"], (why, d.tail())
        assert d.blocks_all_free(), ("D still holds blocks", d.tail())
        assert tokens_and_logprobs(d.post("/v1/completions", completion(PROMPTS[9], 8))) == reference["alone-9"][0]


def test_a_stream_lost_under_the_fail_policy_is_retried_pulled_by_the_router(engines, reference, tmp_path):
    """D fails a request whose load failed (vLLM's default kv_load_failure_policy, "fail"):
    P's server gives up every second lease as D claims it (KVSVC_FAULTS, lease_released), so
    the streamed request's lease is gone -- as when P preempted it or restarted -- and D
    answers vLLM's retryable error. The router asks P again, pulled, and the client gets the
    aggregated run's answer, streamed or whole; neither engine holds a block after."""
    d_conf = dict(KVSVC, kv_role="kv_consumer", kv_connector_extra_config=dict(PATIENT))  # policy: vLLM's "fail"
    with pair(engines.model, tmp_path, p_env={"KVSVC_FAULTS": "-,lease_released"}, d_conf=d_conf) as (p, d, r):
        # Lease 1 (the router learns P: pulled), 2 (streamed: released at D's claim), 3 (the retry).
        assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[5], 8))) == reference["alone-5"][0]
        assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[10], 8))) == reference["alone-10"][0]
        # Leases 4 and 5, the client streaming: the failure was D's first event.
        events = streamed_events(r.url, completion(PROMPTS[9], 8, stream=True))
        assert not [e for e in events if "error" in e], events
        assert streamed_token_ids(events) == reference["alone-9"][0]["token_ids"]
        assert d.wait_metric("vllm:kvsvc_num_failed_transfers_total", 2) == 2
        assert r.tail().count("retrying it once") == 2, r.tail()
        nothing_held(p, d)


def test_a_streamed_block_changed_after_its_digest_fails_the_load_and_d_recomputes_it_exactly(
        engines, reference, tmp_path):
    """Content digests on both engines: P hashes each streamed block as a commit makes it
    whole, D checks every chunk it read. P's server rewrites a committed block of every
    second lease right after its digest was taken (KVSVC_FAULTS, block_rewritten: an engine
    writing a block it streamed, before D reads it), so the streamed request's load fails
    DIGEST_MISMATCH and D recomputes it; the next stream passes the check. Every answer equals
    the aggregated run."""
    with pair(engines.model, tmp_path, p_env={"KVSVC_FAULTS": "-,block_rewritten,-"}, digests=True) as (p, d, r):
        releases = Releases(kvsvc_servers(p.log))
        try:
            # Lease 1 (the router learns P: pulled), 2 (streamed: a block rewritten), 3 (streamed).
            for k in (5, 10, 9):
                got = tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[k], 8)))
                assert got == reference[f"alone-{k}"][0], k
            streams: list[str] = []
            for _ in range(600):  # the release events trail the answers a little
                streams = [rid for rid in releases.by_request() if rid.startswith("kvsvc-stream-")]
                if len(streams) >= 2:
                    break
                time.sleep(0.05)
            assert len(streams) == 2, releases.by_request()
            assert releases.live_leases() == 0
        finally:
            releases.close()
        why = re.findall(r"kvsvc: transfer of \S+ failed: (\w+)", d.log.read_text(errors="replace"))
        assert why == ["DIGEST_MISMATCH"], (why, d.tail())
        assert d.wait_metric("vllm:kvsvc_streamed_chunks_final_total", 1) >= 1  # the clean stream was read
        nothing_held(p, d)


def test_a_stream_p_preempts_is_revoked_and_d_recomputes_it_exactly(engines, reference, tmp_path):
    """P's cache holds 20 blocks of 32 tokens; two 400-token prompts (13 blocks each) prefill
    side by side, 64 tokens each a step, so vLLM preempts one of them mid-prefill and hands its
    blocks to the other. Its lease is revoked before that step's forward may overwrite them: D's
    load of it fails and D recomputes it; the other streams whole. Both answers equal the
    aggregated run of the pair; neither engine holds a block after, nor P a lease."""
    assert kernel_block_size() == 32 and all(len(x) == 400 for x in PREEMPTED)  # 13 + 13 blocks > 20
    p = Engine("preempt-p", engines.model, tmp_path, connector=kvsvc("kv_producer", lease_ttl_s=40), engine_args={
        "num_gpu_blocks_override": 20, "max_num_batched_tokens": 128, "long_prefill_token_threshold": 64,
        "enable_prefix_caching": False})
    d = Engine("preempt-d", engines.model, tmp_path, connector=kvsvc("kv_consumer"))
    try:
        p.wait_ready()
        d.wait_ready()
        [warm] = p.generate([PROMPTS[5]], 1, [{"do_remote_decode": True}])
        ident = stream_params.identity(warm["kv_transfer_params"])
        assert ident is not None
        d.generate([PROMPTS[5]], 8, [warm["kv_transfer_params"]])
        orders = [stream_params.new_stream() for _ in PREEMPTED]
        releases = Releases(kvsvc_servers(p.log))
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                on_d = pool.submit(d.generate, PREEMPTED, 8, [stream_params.decode_stream_params(ident, o)
                                                              for o in orders])
                p.generate(PREEMPTED, 1, [stream_params.prefill_stream_params(o) for o in orders])
                got = on_d.result(600)
            same(got, reference["preempted"], batched=True)
            preempted = p.log.read_text(errors="replace").count("is not streamed any more (preempted on P)")
            assert preempted >= 1, ("P preempted no stream", p.tail())
            assert d.kvsvc_totals()["failed"] == preempted  # each preempted stream's load, recomputed
            assert p.blocks_free() and d.blocks_free()
            assert releases.live_leases() == 0
        finally:
            releases.close()
    finally:
        d.stop()
        p.stop()


@pytest.mark.full
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_streamed_across_tp_sizes_equals_the_same_pair_pulling(engines, tmp_path, p_tp, d_tp):
    """P and D of different TP sizes: each P worker commits its own server's lease, and each D
    worker reads the heads it needs from every P server as they commit. The oracle is the same
    pair pulling after P's prefill (a TP-2 engine's numerics are not a TP-1 engine's); neither
    engine keeps a prefix cache, so each request moves its whole KV."""
    with pair(engines.model, tmp_path, p_tp, d_tp, ("--no-enable-prefix-caching",)) as (p, d, r):
        pulled = tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[10], 8)))  # P not known yet
        assert d.metrics().get("vllm:kvsvc_streamed_chunks_final_total", 0) == 0
        for _ in range(2):
            assert tokens_and_logprobs(r.post("/v1/completions", completion(PROMPTS[10], 8))) == pulled
        assert d.wait_metric("vllm:kvsvc_streamed_chunks_final_total", 2 * d_tp) >= 2 * d_tp  # per D worker
        nothing_held(p, d)
