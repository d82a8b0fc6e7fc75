"""The router against stand-in engines (aiohttp servers that answer as vLLM's OpenAI server
does): what it forwards, for how long it streams, and what /health and /v1/models say.
test_serve.py runs it in front of real `vllm serve` engines."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from kvsvc.integrations.vllm.router import make_app

PARAMS = {"do_remote_prefill": True, "remote_request_id": "p-1"}
# vLLM's answer to a request that finished with an error (a KV load that failed under
# kv_load_failure_policy "fail"), as its OpenAI server words it.
VLLM_500 = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}


class StandIn:
    """One engine: records what it got; D streams its answer in chunks, slowly."""

    def __init__(self, name: str, models: list[str], chunks: int = 0, pause_s: float = 0.0) -> None:
        """chunks 0: a prefill engine, answering after pause_s; else a decode engine streaming
        that many chunks, pause_s apart."""
        self.name, self.models, self.chunks, self.pause_s = name, models, chunks, pause_s
        self.seen: list[tuple[str | None, dict]] = []
        self.healthy = True
        self.garbled = False  # P answers 200 with what vLLM never sends
        self.stuck = False  # P answers only once let_go is set
        self.let_go = asyncio.Event()
        self.params: dict = PARAMS  # P's kv_transfer_params
        self.status = 200  # P's answer
        self.arrived = asyncio.Event()  # a request came
        self.answer_after: asyncio.Event | None = None  # P answers only once this is set
        self.cut = asyncio.Event()  # D: the router closed D's answer before its end
        # D: how its next answers fail, one entry per request: "status" (HTTP 500, as vLLM
        # answers a request whose KV load failed), "event" (a stream whose first event is that
        # error), "late" (the error after a first token).
        self.failures: list[str] = []
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.headers.get("X-Request-Id"), body))
        self.arrived.set()
        if not self.chunks:  # P
            await asyncio.sleep(self.pause_s)
            if self.stuck:
                await self.let_go.wait()
            if self.answer_after is not None:
                await self.answer_after.wait()
            if self.garbled:
                return web.Response(text="<html>a proxy's error page</html>", content_type="text/html")
            if self.status != 200:
                return web.json_response({"error": {"message": "bad prompt"}}, status=self.status)
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": self.params})
        failure = self.failures.pop(0) if self.failures else ""
        if failure == "status":
            return web.json_response({"error": VLLM_500}, status=500)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if failure:
            if failure == "late":
                await out.write(b"data: 0\n\n")
            await out.write(b"data: " + json.dumps({"error": VLLM_500}).encode() + b"\n\ndata: [DONE]\n\n")
            await out.write_eof()
            return out
        try:
            for i in range(self.chunks):
                await asyncio.sleep(self.pause_s)
                await out.write(f"data: {i}\n\n".encode())
            await out.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.cut.set()
            raise
        return out

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": self.name}
                                                             for m in self.models]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 500)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def _routed(prefill: list[StandIn], decode: list[StandIn], timeout_s: float = 600.0,
                  progressive: bool = False) -> TestServer:
    for e in (*prefill, *decode):
        await e.server.start_server()
    router = TestServer(make_app([e.url for e in prefill], [e.url for e in decode], timeout_s, progressive))
    await router.start_server()
    return router


async def _close(*servers: TestServer) -> None:
    for s in servers:
        await s.close()


async def test_a_stream_longer_than_the_timeout_is_not_cut_and_both_engines_get_one_request_id():
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=6, pause_s=0.3)
    router = await _routed([p], [d], timeout_s=1.0)  # D streams for ~1.8 s
    try:
        async with ClientSession() as s:
            async with s.post(str(router.make_url("/v1/completions")), json={"prompt": "hi", "stream": True},
                              headers={"X-Request-Id": "client-7"}) as r:
                text = await r.text()
                assert r.status == 200 and r.headers["X-Request-Id"] == "client-7"
            assert text == "".join(f"data: {i}\n\n" for i in range(6))
            async with s.post(str(router.make_url("/v1/completions")), json={"prompt": "again"}) as r:
                minted = r.headers["X-Request-Id"]
        assert [rid for rid, _ in p.seen] == [rid for rid, _ in d.seen] == ["client-7", minted]
        assert len(minted) == 32 and minted != "client-7"
        assert p.seen[0][1]["max_tokens"] == 1 and p.seen[0][1]["kv_transfer_params"]["do_remote_decode"]
        assert d.seen[0][1]["kv_transfer_params"] == PARAMS and d.seen[0][1]["stream"] is True
    finally:
        await _close(router, p.server, d.server)


async def test_the_prefill_call_keeps_its_limit():
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=1)
    p.stuck = True  # P answers only after the router's limit
    router = await _routed([p], [d], timeout_s=0.5)
    try:
        async with ClientSession() as s, s.post(str(router.make_url("/v1/completions")), json={"prompt": "x"}) as r:
            assert r.status == 504  # the client is not left hanging, and is told who did not answer
            assert (await r.json())["error"] | {"message": ""} == {
                "type": "ENGINE_TIMEOUT", "code": 504, "engine": p.url, "role": "prefill", "message": ""}
        assert d.seen == []
    finally:
        p.let_go.set()
        await _close(router, p.server, d.server)


async def error_of(router: TestServer) -> tuple[int, dict]:
    async with ClientSession() as s, s.post(str(router.make_url("/v1/completions")), json={"prompt": "x"}) as r:
        return r.status, (await r.json())["error"]


async def test_an_engine_that_cannot_be_used_is_named_in_a_typed_answer():
    """Never a bare 500: P or D unreachable, or P answering what vLLM never sends, is a 502
    in OpenAI's error shape naming the engine, its role and why."""
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=1)
    router = await _routed([p], [d])
    try:
        p.garbled = True
        status, error = await error_of(router)
        assert (status, error["type"], error["role"], error["engine"]) == (502, "ENGINE_BAD_ANSWER", "prefill", p.url)
        assert d.seen == []
        p.garbled = False
        d_url = d.url
        await d.server.close()
        status, error = await error_of(router)
        assert (status, error["type"], error["role"], error["engine"]) == (502, "ENGINE_UNREACHABLE", "decode", d_url)
        assert d_url in error["message"]
        p_url = p.url
        await p.server.close()
        status, error = await error_of(router)
        assert (status, error["type"], error["role"], error["engine"]) == (502, "ENGINE_UNREACHABLE", "prefill", p_url)
    finally:
        await _close(router, p.server, d.server)


async def test_health_and_models_reflect_the_backends():
    p1, p2 = StandIn("p1", ["m", "only-p"]), StandIn("p2", ["m"])
    d = StandIn("d", ["m", "only-d"], chunks=1)
    router = await _routed([p1, p2], [d])
    try:
        async with ClientSession() as s:
            async with s.get(str(router.make_url("/v1/models"))) as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["m"]
            async with s.get(str(router.make_url("/health"))) as r:
                assert r.status == 200
            p1.healthy = p2.healthy = False
            async with s.get(str(router.make_url("/health"))) as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == "unavailable"
                assert set(body["prefill"].values()) == {"down (500)"} and set(body["decode"].values()) == {"ok"}
            p2.healthy = True
            d_url = d.url
            await d.server.close()  # a decode engine that does not answer at all
            async with s.get(str(router.make_url("/health"))) as r:
                body = await r.json()
                assert r.status == 503 and body["decode"] == {d_url: "down (no answer)"}
    finally:
        await _close(router, p1.server, p2.server, d.server)


@pytest.mark.parametrize("given", ["x" * 300, "bad\nid"])
def test_an_unusable_request_id_is_replaced(given):
    from kvsvc.integrations.vllm.router import request_id

    made = request_id(given)
    assert made != given and len(made) == 32 and json.dumps(made)


KVSVC_PARAMS = {  # what a kvsvc P engine answers (its servers, this request's lease)
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-1", "remote_num_tokens": 40, "tp_size": 1, "dcp_size": 1,
    "kvsvc": {"remote_address": "127.0.0.1:7000", "remote_engine_id": "p-engine", "remote_request_id": "cmpl-1",
              "remote_block_ids_per_group": [{"block_ids": [3]}], "remote_epoch": "5", "remote_tp_size": 1,
              "lease_token": "ab" * 16, "lease_pending": True, "remote_dcp_size": 1,
              "remote_servers": [{"address": "127.0.0.1:7000", "ranks": [0], "epoch": "5"}]}}


async def test_progressive_sends_p_and_d_at_once_once_p_named_its_servers():
    """The first request goes P then D (P's answer names its servers); the next goes to both
    at once -- P answers only after D got the request, so a router that waited for P would
    time out -- with D's params naming the lease P is told to make."""
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=2)
    p.params = KVSVC_PARAMS
    router = await _routed([p], [d], timeout_s=5.0, progressive=True)
    try:
        async with ClientSession() as s:
            async with s.post(str(router.make_url("/v1/completions")), json={"prompt": "one"}) as r:
                assert r.status == 200
            assert d.seen[0][1]["kv_transfer_params"] == KVSVC_PARAMS and "kvsvc_stream" not in str(p.seen[0][1])
            p.answer_after = d.arrived
            d.arrived.clear()
            async with s.post(str(router.make_url("/v1/completions")), json={"prompt": "two"}) as r:
                assert r.status == 200 and await r.text() == "data: 0\n\ndata: 1\n\n"
        order = p.seen[1][1]["kv_transfer_params"]["kvsvc_stream"]
        got = d.seen[1][1]["kv_transfer_params"]
        assert got["remote_request_id"] == got["kvsvc"]["remote_request_id"] == order["lease_id"]
        assert got["kvsvc"]["lease_token"] == order["lease_token"] != KVSVC_PARAMS["kvsvc"]["lease_token"]
        assert got["kvsvc"]["progressive"] and got["kvsvc"]["lease_pending"]
        assert got["kvsvc"]["remote_servers"] == KVSVC_PARAMS["kvsvc"]["remote_servers"]
        assert p.seen[1][1]["max_tokens"] == 1 and d.seen[1][1]["prompt"] == "two"
    finally:
        await _close(router, p.server, d.server)


@pytest.mark.parametrize("fails", ["answers an error", "cannot be reached"])
async def test_progressive_p_that_fails_is_the_answer_and_ds_request_is_closed(fails):
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=50, pause_s=0.1)
    p.params = KVSVC_PARAMS
    router = await _routed([p], [d], timeout_s=5.0, progressive=True)
    try:
        async with ClientSession() as s:
            async with s.post(str(router.make_url("/v1/completions")), json={"prompt": "learn"}) as r:
                await r.read()  # D's whole answer: P is known now
            d.arrived.clear()
            p.answer_after = d.arrived  # P fails only once D is working on the request
            if fails == "answers an error":
                p.status = 400
            else:
                await p.server.close()
            async with s.post(str(router.make_url("/v1/completions")), json={"prompt": "two"}) as r:
                body = await r.json()
                if fails == "answers an error":
                    assert r.status == 400 and body == {"error": {"message": "bad prompt"}}
                else:
                    assert r.status == 502 and body["error"]["type"] == "ENGINE_UNREACHABLE"
        if fails == "answers an error":
            await asyncio.wait_for(d.cut.wait(), 10)  # D's request was closed (vLLM aborts it)
    finally:
        await _close(router, p.server, d.server)


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("failure", ["status", "event"])
async def test_a_decode_failing_before_its_first_token_is_retried_once_pulled(failure, progressive):
    """D fails the request as vLLM fails a KV load (HTTP 500, or a stream whose first event is
    that error): the router asks P again -- pulled, never streamed -- and relays D's second
    answer; nothing of the first reached the client."""
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=2)
    p.params = KVSVC_PARAMS
    router = await _routed([p], [d], timeout_s=5.0, progressive=progressive)
    try:
        async with ClientSession() as s:
            url = str(router.make_url("/v1/completions"))
            async with s.post(url, json={"prompt": "learn"}) as r:
                await r.read()  # P is known now (progressive: the next request is streamed)
            d.failures = [failure]
            async with s.post(url, json={"prompt": "two", "stream": failure == "event"}) as r:
                assert r.status == 200 and await r.text() == "data: 0\n\ndata: 1\n\n"
        assert [body["prompt"] for _, body in p.seen] == ["learn", "two", "two"]
        assert ("kvsvc_stream" in p.seen[1][1]["kv_transfer_params"]) == progressive
        assert p.seen[2][1]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
        assert d.seen[2][1]["kv_transfer_params"] == KVSVC_PARAMS  # P's answer, as given: pulled
    finally:
        await _close(router, p.server, d.server)


@pytest.mark.parametrize("failures", [["status", "status"], ["event", "event"], ["late"]])
async def test_a_decode_failing_again_or_after_a_token_is_the_answer(failures):
    """A second failure is relayed as D gave it (one retry, no more); a failure after the first
    token is D's answer as it stands (the client has tokens: never retried)."""
    p, d = StandIn("p", ["m"]), StandIn("d", ["m"], chunks=2)
    router = await _routed([p], [d], timeout_s=5.0)
    d.failures = list(failures)
    try:
        async with ClientSession() as s:
            async with s.post(str(router.make_url("/v1/completions")),
                              json={"prompt": "x", "stream": failures[0] != "status"}) as r:
                text = await r.text()
        error = json.dumps({"error": VLLM_500})
        if failures[0] == "status":
            assert r.status == 500 and json.loads(text) == {"error": VLLM_500}
        else:
            first = "data: 0\n\n" if failures == ["late"] else ""
            assert r.status == 200 and text == f"{first}data: {error}\n\ndata: [DONE]\n\n"
        assert len(p.seen) == len(d.seen) == len(failures)
    finally:
        await _close(router, p.server, d.server)
