"""A minimal prefill/decode router for vLLM engines that use KvsvcConnector.

    python -m kvsvc.integrations.vllm.router --prefill http://P:8100 --decode http://D:8200 --port 8000

Clients talk to it as to one OpenAI-compatible vLLM server (/v1/completions,
/v1/chat/completions, /v1/models). Each request goes to a prefill engine first, with
"kv_transfer_params": {"do_remote_decode": true} and one output token, then to a
decode engine with the kv_transfer_params P answered, unchanged; D's answer (streamed
or not) is the client's. Both engines get the same X-Request-Id (the client's, or one
the router makes), so one request has one id in every log. Engines are taken round
robin. If P answers an error, that error is the answer; an engine that cannot be reached,
does not answer in time or answers what vLLM never sends is answered 502 or 504 in
OpenAI's error shape, with "type" ENGINE_UNREACHABLE, ENGINE_TIMEOUT or ENGINE_BAD_ANSWER
and the engine's URL and role. A client that goes away while D works closes D's request,
which vLLM aborts (and kvsvc then gives P's blocks back).

A decode that fails before its first token with vLLM's retryable error (HTTP 500, or a
stream whose first event is that error: vLLM's answer when a KV load failed under
kv_load_failure_policy "fail" -- P's lease expired, P restarted, a stream P gave up) is
retried once, pulled: P (the next one) prefills the request again and D reads it after P's
answer. Nothing has reached the client by then; a second failure is the answer.

Time limits: P's call is bounded (--timeout-s: one token); D's answer is not, as a long
generation may stream for as long as it needs -- only connecting to D is bounded.
/health answers 200 while at least one prefill and one decode engine answer their own
/health, else 503; both list each engine's state. /v1/models lists the models that some
prefill and some decode engine both serve.

With --progressive, a request goes to P and D at once (once P answered once, naming its
servers): P leases it under a lease id and token the router mints and commits it chunk by
chunk as it prefills; D's params name that lease, and D reads each chunk while P computes
the next (docs/ARCHITECTURE.md, "Progressive pull"). P's error is then the answer too, and
D's request is closed.

It is an example of the protocol, small enough to read in one go: a production router
adds load-aware choice and retries. Needs aiohttp (vLLM depends on it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from kvsvc.integrations.vllm import stream_params

log = logging.getLogger("kvsvc.router")

FORWARDED_HEADERS = ("authorization",)
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256
CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0
KEEPALIVE_S = 2.0
MAX_FIRST_EVENT_BYTES = 1 << 20  # what is read of D's stream to tell a failure from a first token


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P gets: the request, producing one token, leasing its KV for a decode engine."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in body:  # chat's name for it wins over max_tokens
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """What D gets: the client's request, with P's kv_transfer_params as P gave them."""
    return {**body, "kv_transfer_params": params}


def request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is usable, else a new one: sent to P and D alike."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return uuid.uuid4().hex


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequest"}}, status=400)


def engine_failed(role: str, url: str, reason: str, detail: str) -> web.Response:
    """The answer when an engine could not be used: OpenAI's error shape, naming the engine,
    its role and why -- 504 when it did not answer in time, 502 otherwise (unreachable, or an
    answer that is not what vLLM sends). reason: ENGINE_UNREACHABLE, ENGINE_TIMEOUT or
    ENGINE_BAD_ANSWER."""
    status = 504 if reason == "ENGINE_TIMEOUT" else 502
    return web.json_response({"error": {
        "message": f"the {role} engine at {url} failed: {detail}", "type": reason, "code": status,
        "engine": url, "role": role}}, status=status)


def _why(e: BaseException) -> tuple[str, str]:
    if isinstance(e, TimeoutError):
        return "ENGINE_TIMEOUT", "no answer within the router's limit"
    return "ENGINE_UNREACHABLE", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Router:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float, progressive: bool = False) -> None:
        self.prefill_urls = [u.rstrip("/") for u in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self._prefill_timeout = ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        # No total: D streams a long generation for as long as it takes.
        self._decode_timeout = ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        self._probe_timeout = ClientTimeout(total=PROBE_TIMEOUT_S)
        self._session: ClientSession | None = None
        # Progressive pull: each P engine's servers as its last answer named them (a request
        # is streamed to a P once one of its answers was seen).
        self.progressive = progressive
        self._identity: dict[str, dict[str, Any]] = {}

    async def start(self, app: web.Application) -> None:
        # Idle connections are dropped well before the engines drop them (vLLM's HTTP server
        # closes one after 5 s idle): a request sent on one the engine just closed fails
        # with "Server disconnected", and a POST is not retried.
        self._session = ClientSession(connector=TCPConnector(keepalive_timeout=KEEPALIVE_S))

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _bad_request("the body is not JSON")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers[REQUEST_ID_HEADER] = request_id(request.headers.get(REQUEST_ID_HEADER))
        path = request.path
        p_url = next(self._prefill)
        ident = self._identity.get(p_url) if self.progressive else None
        if ident is not None:
            got = await self._streamed(body, headers, path, p_url, ident)
        else:
            got = await self._pulled(body, headers, path, p_url)
        if isinstance(got, web.Response):
            return got
        d, d_url = got
        first = await _first_answer(d)
        if first is None:  # vLLM's retryable failure, before any token: once more, pulled
            log.warning("decode engine %s failed %s before its first token (its KV load, under vLLM's "
                        "kv_load_failure_policy \"fail\"): retrying it once, prefilled again", d_url,
                        headers[REQUEST_ID_HEADER])
            got = await self._pulled(body, headers, path, next(self._prefill))
            if isinstance(got, web.Response):
                return got
            d, d_url = got
            first = await _first_answer(d, last_try=True)
        return await self._relay(request, d, d_url, headers, first or b"")

    async def _pulled(self, body: dict[str, Any], headers: dict[str, str], path: str,
                      p_url: str) -> tuple[Any, str] | web.Response:
        """P prefills the request and leases its KV; then D gets it with P's params. D's
        answer (not read yet) and its URL, or what the client gets when P or D failed."""
        assert self._session is not None
        answer = await self._ask_prefill(p_url, path, prefill_body(body), headers)
        if isinstance(answer, web.Response):
            return answer
        try:
            params = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError):
            return engine_failed("prefill", p_url, "ENGINE_BAD_ANSWER", "its answer is not a JSON object")
        if not params:
            log.warning("prefill engine returned no kv_transfer_params for %s: the decode engine prefills itself",
                        headers[REQUEST_ID_HEADER])
        self._learn(p_url, params)
        d_url = next(self._decode)
        try:
            d = await self._session.post(d_url + path, json=decode_body(body, params), headers=headers,
                                         timeout=self._decode_timeout)
        except (TimeoutError, ClientError, OSError) as e:
            return _decode_failed(d_url, headers, e)
        return d, d_url

    async def _ask_prefill(self, p_url: str, path: str, p_body: dict[str, Any],
                       headers: dict[str, str]) -> bytes | web.Response:
        """P's answer (its body), or what the client gets when P failed: P's own error as it
        gave it (vLLM's JSON), or a typed 502/504 when P could not be used."""
        assert self._session is not None
        try:
            async with self._session.post(p_url + path, json=p_body, headers=headers,
                                          timeout=self._prefill_timeout) as p:
                answer = await p.read()
        except (TimeoutError, ClientError, OSError) as e:
            log.warning("prefill engine %s failed for %s: %s", p_url, headers[REQUEST_ID_HEADER], e)
            return engine_failed("prefill", p_url, *_why(e))
        if p.status != 200:
            return web.Response(body=answer, status=p.status, content_type=p.content_type)
        return answer

    def _learn(self, p_url: str, params: Any) -> None:
        """Keep what P's answer says of P's servers: a streamed request's D params name them."""
        ident = stream_params.identity(params) if isinstance(params, dict) else None
        if ident is not None:
            self._identity[p_url] = ident

    async def _streamed(self, body: dict[str, Any], headers: dict[str, str], path: str, p_url: str,
                        ident: dict[str, Any]) -> tuple[Any, str] | web.Response:
        """P and D at once: P leases the request under a lease id and token minted here and
        commits it chunk by chunk; D's params name that lease, and D reads each chunk while P
        computes the next. P's error (or P not answering) is the answer, and D's request is
        closed (vLLM aborts it; kvsvc frees P's lease)."""
        assert self._session is not None
        order = stream_params.new_stream()
        d_url = next(self._decode)
        p_body = {**prefill_body(body), "kv_transfer_params": stream_params.prefill_stream_params(order)}
        d_call = asyncio.ensure_future(self._session.post(
            d_url + path, json=decode_body(body, stream_params.decode_stream_params(ident, order)), headers=headers,
            timeout=self._decode_timeout))
        handed_on = False
        try:
            answer = await self._ask_prefill(p_url, path, p_body, headers)
            if isinstance(answer, web.Response):
                return answer
            with contextlib.suppress(ValueError, AttributeError):
                self._learn(p_url, json.loads(answer).get("kv_transfer_params"))
            try:
                d = await d_call
            except (TimeoutError, ClientError, OSError) as e:
                return _decode_failed(d_url, headers, e)
            handed_on = True
            return d, d_url
        finally:
            if not handed_on:
                await _close(d_call)

    async def _relay(self, request: web.Request, d: Any, d_url: str, headers: dict[str, str],
                     first: bytes) -> web.StreamResponse:
        """D's answer, as D gives it (streamed or not), to the client: what was read of it
        already (first), then the rest."""
        async with d:
            out = web.StreamResponse(status=d.status, headers={
                "Content-Type": d.headers.get("Content-Type", "application/json"),
                REQUEST_ID_HEADER: headers[REQUEST_ID_HEADER]})
            try:
                await out.prepare(request)  # the client may have gone while D worked: it fails here
                if first:
                    await out.write(first)
                async for chunk in d.content.iter_any():
                    await out.write(chunk)
            except (TimeoutError, ClientError, OSError) as e:  # end the answer short (D's is closed below)
                log.warning("the answer to %s ended short: the client or the decode engine %s went away (%s)",
                            headers[REQUEST_ID_HEADER], d_url, e)
                return out
            await out.write_eof()
            return out

    async def _get(self, url: str) -> tuple[int, Any]:
        """(HTTP status, JSON body or None) of a GET to an engine; status 0 when it did not answer."""
        assert self._session is not None
        try:
            # A probe's connection is closed after it: it must not be pooled for a request.
            async with self._session.get(url, timeout=self._probe_timeout, headers={"Connection": "close"}) as r:
                try:
                    return r.status, await r.json(content_type=None)
                except (json.JSONDecodeError, ValueError):
                    return r.status, None
        except (TimeoutError, ClientError, OSError):
            return 0, None

    async def health(self, request: web.Request) -> web.Response:
        async def state(url: str) -> str:
            status, _ = await self._get(url + "/health")
            return "ok" if status == 200 else f"down ({status or 'no answer'})"

        prefill = await asyncio.gather(*(state(u) for u in self.prefill_urls))
        decode = await asyncio.gather(*(state(u) for u in self.decode_urls))
        ready = "ok" in prefill and "ok" in decode
        return web.json_response({"status": "ok" if ready else "unavailable",
                                  "prefill": dict(zip(self.prefill_urls, prefill, strict=True)),
                                  "decode": dict(zip(self.decode_urls, decode, strict=True))},
                                 status=200 if ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        async def served(url: str) -> dict[str, Any]:
            status, body = await self._get(url + "/v1/models")
            data = body.get("data") if status == 200 and isinstance(body, dict) else None
            return {m["id"]: m for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)}

        prefill = await asyncio.gather(*(served(u) for u in self.prefill_urls))
        decode = await asyncio.gather(*(served(u) for u in self.decode_urls))
        on_p = set().union(*prefill)
        both = {mid: m for per in decode for mid, m in per.items() if mid in on_p}
        return web.json_response({"object": "list", "data": list(both.values())})


async def _first_answer(d: Any, last_try: bool = False) -> bytes | None:
    """What D answered up to its first token: its whole answer when not streamed, else its
    stream up to the end of the first event. None (D's answer closed) when that is vLLM's
    retryable failure -- HTTP 500, or a first event that is an error of code 500 -- and this
    is not the last try. A D that breaks off here leaves what was read (the relay ends it); a
    client that goes away meanwhile closes D's answer (vLLM then aborts the request)."""
    try:
        if d.headers.get("Content-Type", "").startswith("text/event-stream"):
            got = b""
            while b"\n\n" not in got and len(got) < MAX_FIRST_EVENT_BYTES:
                line = await d.content.readline()
                if not line:
                    break
                got += line
            failed = d.status == 200 and _is_retryable(got.removeprefix(b"data: "))
        else:
            got = await d.content.read(MAX_FIRST_EVENT_BYTES) if d.status == 500 else b""
            failed = d.status == 500
    except (TimeoutError, ClientError, OSError):
        return b""
    except BaseException:
        d.close()
        raise
    if failed and not last_try:
        d.close()
        return None
    return got


def _is_retryable(event: bytes) -> bool:
    """Whether a stream's first event is vLLM's error of code 500 (a KV load that failed)."""
    try:
        error = json.loads(event).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == 500


def _decode_failed(d_url: str, headers: dict[str, str], e: BaseException) -> web.Response:
    log.warning("decode engine %s failed for %s: %s", d_url, headers[REQUEST_ID_HEADER], e)
    return engine_failed("decode", d_url, *_why(e))


async def _close(call: asyncio.Future[Any]) -> None:
    """End a D call not handed on: cancelled if it has not answered, else its answer closed
    (either way vLLM aborts the request)."""
    if not call.done():
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await call
        return
    if not call.cancelled() and call.exception() is None:
        call.result().close()


def make_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0,
             progressive: bool = False) -> web.Application:
    router = Router(prefill, decode, timeout_s, progressive)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.proxy)
    app.router.add_post("/v1/chat/completions", router.proxy)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvsvc.integrations.vllm.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill engines' base URLs (http://host:port)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode engines' base URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="limit of one prefill call (D's answer has none: it streams as long as it generates)")
    ap.add_argument("--progressive", action="store_true",
                    help="send each request to P and D at once: D reads P's KV chunk by chunk while P prefills "
                         "(once a P engine answered once: its answer names its servers)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill, args.decode, args.timeout_s, args.progressive), host=args.host,
                port=args.port)


if __name__ == "__main__":
    main()
