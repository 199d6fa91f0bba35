"""A small encoder -> prefill -> decode proxy for OpenAI-style chat requests, after the pattern of
vLLM's examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py (which is not in the
wheel), self-contained on aiohttp (a vLLM dependency):

  1. every image/audio item of the request goes to an encoder server, alone, as a chat request
     with max_tokens 1 (the encoder publishes its embedding to ecd); all of them must succeed;
  2. the original request goes to a prefill server with max_tokens 1 and kv_transfer_params
     {"do_remote_decode": true} (it loads the embeddings from ecd, stores the prompt's KV blocks
     in ecd and answers with kv_transfer_params naming its daemon and the blocks), unless no
     prefill server is given;
  3. the original request, with the prefill's kv_transfer_params, goes to a decode server, whose
     answer (JSON or event stream) is the proxy's answer (it loads the prompt's KV through ecd
     and generates).

On one node the transfer parameters change nothing: every engine finds what the previous stage
stored by key (an image's mm_hash, a prompt block's hash) in the node's daemon. Across nodes
they tell the decode node's daemon which peer to pull the blocks from (docs/vllm.md, "Across
nodes"), as vLLM's own P/D proxies do for its NixlConnector.

    python proxy.py --port 10001 --encode-servers-urls http://127.0.0.1:19534 \\
        --prefill-servers-urls http://127.0.0.1:19535 --decode-servers-urls http://127.0.0.1:19536
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import time
import uuid

import aiohttp
from aiohttp import web

MM_TYPES = {"image_url", "audio_url", "input_audio", "video_url"}
log = logging.getLogger("epd-proxy")


def mm_items(request: dict) -> list[dict]:
    return [part for msg in request.get("messages", []) if isinstance(msg.get("content"), list)
            for part in msg["content"] if isinstance(part, dict) and part.get("type") in MM_TYPES]


class Proxy:
    def __init__(self, encode: list[str], prefill: list[str], decode: list[str]) -> None:
        self.encode, self.prefill, self.decode = encode, prefill, decode
        self._e, self._p, self._d = (itertools.cycle(u) if u else None for u in (encode, prefill, decode))
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _post(self, url: str, body: dict, req_id: str, stage: str) -> dict:
        async with self.session.post(f"{url}/v1/chat/completions", json=body,
                                     headers={"x-request-id": req_id}) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise web.HTTPBadGateway(text=f"{stage} {url} answered {resp.status}: {text}")
            return await resp.json(content_type=None) if text else {}

    async def encode_items(self, request: dict, req_id: str) -> None:
        items = mm_items(request)
        jobs = [self._post(next(self._e), {"model": request.get("model"), "max_tokens": 1, "stream": False,
                                           "messages": [{"role": "user", "content": [item]}]},
                           f"{req_id}-enc{i}", "encoder")
                for i, item in enumerate(items)]
        await asyncio.gather(*jobs)

    async def chat(self, http_request: web.Request) -> web.StreamResponse:
        request = await http_request.json()
        req_id = http_request.headers.get("x-request-id", uuid.uuid4().hex)
        t0 = time.perf_counter()
        if self._e is not None:
            await self.encode_items(request, req_id)
        t1 = time.perf_counter()
        if self._p is not None:
            body = {**request, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
            body.pop("max_completion_tokens", None)
            body.pop("stream_options", None)
            prefilled = await self._post(next(self._p), body, f"{req_id}-prefill", "prefill")
            params = prefilled.get("kv_transfer_params")
            if isinstance(params, dict):  # where the decode side's daemon finds the prompt's blocks
                request = {**request, "kv_transfer_params": params}
        t2 = time.perf_counter()
        url = next(self._d)
        timing = f"encode {1e3 * (t1 - t0):.0f} ms, prefill {1e3 * (t2 - t1):.0f} ms"
        if not request.get("stream"):
            answer = await self._post(url, request, req_id, "decode")
            log.info("[%s] %s, decode %.0f ms", req_id, timing, 1e3 * (time.perf_counter() - t2))
            return web.json_response(answer, headers={"x-epd-timing": timing})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        async with self.session.post(f"{url}/v1/chat/completions", json=request,
                                     headers={"x-request-id": req_id}) as resp:
            if resp.status != 200:
                raise web.HTTPBadGateway(text=f"decode {url} answered {resp.status}: {await resp.text()}")
            await response.prepare(http_request)
            async for chunk in resp.content.iter_any():
                await response.write(chunk)
        await response.write_eof()
        return response

    async def health(self, http_request: web.Request) -> web.Response:
        async def ok(url: str) -> bool:
            try:
                async with self.session.get(f"{url}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False
        urls = self.encode + self.prefill + self.decode
        states = await asyncio.gather(*(ok(u) for u in urls))
        body = dict(zip(urls, states))
        return web.json_response(body, status=200 if all(states) else 503)

    async def models(self, http_request: web.Request) -> web.Response:
        async with self.session.get(f"{self.decode[0]}/v1/models") as resp:
            return web.json_response(await resp.json(), status=resp.status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=10001)
    # the same flags as vLLM's disagg_epd_proxy.py: comma-separated URLs; prefill "disable" = E -> PD
    parser.add_argument("--encode-servers-urls", required=True, help="encoder server URLs, comma-separated")
    parser.add_argument("--prefill-servers-urls", required=True,
                        help='prefill server URLs, comma-separated; "disable" or "none" for E -> PD')
    parser.add_argument("--decode-servers-urls", required=True, help="decode (or PD) server URLs, comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    def urls(text: str) -> list[str]:
        return [] if text.strip().lower() in ("disable", "none", "") else \
            [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    proxy = Proxy(urls(args.encode_servers_urls), urls(args.prefill_servers_urls), urls(args.decode_servers_urls))
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    web.run_app(app, host=args.host, port=args.port, print=lambda *a: log.info("listening on %s:%d",
                                                                              args.host, args.port))


if __name__ == "__main__":
    main()
