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


class StandIn:
    """One engine: records what it got; D streams its answer in chunks, slowly."""

    def __init__(self, name: str, models: list[str], chunks: int = 0, pause_s: float = 0.0) -> None:
        """chunks 0: a prefill engine, answering after pause_s; else a decode engine streaming
        that many chunks, pause_s apart."""
        self.name, self.models, self.chunks, self.pause_s = name, models, chunks, pause_s
        self.seen: list[tuple[str | None, dict]] = []
        self.healthy = True
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.headers.get("X-Request-Id"), body))
        if not self.chunks:  # P
            await asyncio.sleep(self.pause_s)
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(self.chunks):
            await asyncio.sleep(self.pause_s)
            await out.write(f"data: {i}\n\n".encode())
        await out.write_eof()
        return out

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": self.name}
                                                             for m in self.models]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 500)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def _routed(prefill: list[StandIn], decode: list[StandIn], timeout_s: float = 600.0) -> TestServer:
    for e in (*prefill, *decode):
        await e.server.start_server()
    router = TestServer(make_app([e.url for e in prefill], [e.url for e in decode], timeout_s))
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
    p, d = StandIn("p", ["m"], pause_s=5.0), StandIn("d", ["m"], chunks=1)
    router = await _routed([p], [d], timeout_s=0.5)
    try:
        async with ClientSession() as s, s.post(str(router.make_url("/v1/completions")), json={"prompt": "x"}) as r:
            assert r.status == 504  # the router's timeout, as aiohttp answers it: the client is not left hanging
        assert d.seen == []
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
