"""The baseline of `routed-experts bench-proxy`: what vLLM's example disaggregated proxy does
(FastAPI + httpx), without merging routing. Not part of the proxy: it passes decode's zeroed
prompt rows on, which is the bug the proxy exists to fix.

(No `from __future__ import annotations` here: FastAPI reads the handler's annotations.)
"""

import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from routed_experts.proxy.protocol import PREFILL_KV_TRANSFER_PARAMS


def passthrough_app(prefill: Sequence[str], decode: Sequence[str]) -> FastAPI:
    """Prefill with max_tokens=1 and kv_transfer_params, read its JSON, then relay the decode
    reply's bytes as they come."""
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        req = await request.json()
        headers = {"x-request-id": request.headers.get("x-request-id", "bench")}
        p = dict(req, max_tokens=1, stream=False)
        p["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
        r = await client.post(next(prefills) + "/v1/completions", json=p, headers=headers)
        r.raise_for_status()
        kv = r.json().get("kv_transfer_params")
        if kv:
            req["kv_transfer_params"] = kv
        url = next(decodes) + "/v1/completions"

        async def relay() -> AsyncIterator[Any]:
            async with client.stream("POST", url, json=req, headers=headers) as d:
                async for chunk in d.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="application/json")

    return app
