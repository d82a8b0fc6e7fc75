"""A minimal prefill/decode router for vLLM engines that use KvsvcConnector.

    python -m kvsvc.integrations.vllm.router --prefill http://P:8100 --decode http://D:8200 --port 8000

Clients talk to it as to one OpenAI-compatible vLLM server (/v1/completions,
/v1/chat/completions). Each request goes to a prefill engine first, with
"kv_transfer_params": {"do_remote_decode": true} and one output token, then to a
decode engine with the kv_transfer_params P answered, unchanged; D's answer (streamed
or not) is the client's. Engines are taken round robin. If P fails, its error is the
answer; a client that goes away while D works closes D's request, which vLLM aborts
(and kvsvc then gives P's blocks back).

It is an example of the protocol, small enough to read in one go: a production router
adds health checks, load-aware choice and retries. Needs aiohttp (vLLM depends on it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

log = logging.getLogger("kvsvc.router")

FORWARDED_HEADERS = ("authorization", "x-request-id")


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


class Router:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float) -> None:
        self._prefill = itertools.cycle([u.rstrip("/") for u in prefill])
        self._decode = itertools.cycle([u.rstrip("/") for u in decode])
        self._timeout = ClientTimeout(total=timeout_s)
        self._session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=self._timeout)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "the body is not JSON", "type": "BadRequest"}},
                                     status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body must be a JSON object", "type": "BadRequest"}},
                                     status=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        path = request.path
        async with self._session.post(next(self._prefill) + path, json=prefill_body(body), headers=headers) as p:
            answer = await p.read()
            if p.status != 200:
                return web.Response(body=answer, status=p.status, content_type=p.content_type)
            params = json.loads(answer).get("kv_transfer_params")
        if not params:
            log.warning("prefill engine returned no kv_transfer_params: the decode engine prefills itself")
        async with self._session.post(next(self._decode) + path, json=decode_body(body, params),
                                      headers=headers) as d:
            out = web.StreamResponse(status=d.status, headers={"Content-Type": d.headers.get("Content-Type",
                                                                                                "application/json")})
            await out.prepare(request)
            async for chunk in d.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


def make_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> web.Application:
    router = Router(prefill, decode, timeout_s)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.proxy)
    app.router.add_post("/v1/chat/completions", router.proxy)
    app.router.add_get("/health", router.health)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvsvc.integrations.vllm.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill engines' base URLs (http://host:port)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode engines' base URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit of one request to one engine")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill, args.decode, args.timeout_s), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
