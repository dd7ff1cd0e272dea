"""vLLM's disaggregated-serving protocol as the proxy speaks it: what prefill and decode each
receive, how the client's request is checked, and the OpenAI-shaped errors the client gets."""

from __future__ import annotations

from typing import Any

import orjson

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
REQUEST_ID = "x-request-id"

# What vLLM's disaggregated prefill expects: compute the prompt, keep the KV cache for a remote
# decode, return the parameters the decode server needs to fetch it.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class UpstreamError(Exception):
    """A request that ends in an error response. `side` says whose fault it is ("client",
    "prefill", "decode", "merge", "proxy"); `retry_after` (seconds) goes into a 503's header;
    `retryable` marks a connection that was never made (safe to try another server); `param`
    names the request field at fault; `allow` lists the methods a 405's path takes; `close`
    ends the client's connection with the response."""

    def __init__(
        self,
        side: str,
        status: int,
        message: str,
        *,
        retry_after: int | None = None,
        retryable: bool = False,
        param: str | None = None,
        allow: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.side, self.status, self.message = side, status, message
        self.retry_after, self.retryable = retry_after, retryable
        self.param, self.allow, self.close = param, allow, close


class BodyError(ValueError):
    """A client body the proxy refuses (a 400); `param` names the field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def prefill_request(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request for the prefill server: one token, no streaming, KV cache kept for decode.
    `routed_experts_prompt_start` and every other client field go through unchanged."""
    req = dict(body)
    req["max_tokens"] = 1
    if chat or "max_completion_tokens" in body:
        req["max_completion_tokens"] = 1
    # vLLM refuses min_tokens above max_tokens: they are for decode only (as vLLM's own proxy).
    req.pop("min_tokens", None)
    req.pop("min_completion_tokens", None)
    req["stream"] = False
    req.pop("stream_options", None)
    req["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return req


def decode_request(body: dict[str, Any], kv_transfer_params: bytes | None) -> bytes:
    """The request for the decode server, as JSON: the client's, with the `kv_transfer_params`
    that prefill returned (their raw JSON text, spliced in without being parsed again)."""
    if kv_transfer_params is None:
        return encode_request(body)
    text = encode_request({k: v for k, v in body.items() if k != "kv_transfer_params"})
    separator = b"" if text == b"{}" else b","
    return text[:-1] + separator + b'"kv_transfer_params":' + kv_transfer_params + b"}"


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """The client's request as a dict; anything else is a BodyError (a 400): not JSON (NaN and
    Infinity are not JSON, nor integers beyond 64 bits), not an object, nested deeper than 1024,
    a `routed_experts_prompt_start` that is not a non-negative integer."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BodyError(f"not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    start = body.get("routed_experts_prompt_start")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise BodyError(
            f"routed_experts_prompt_start must be a non-negative integer, got {start!r}",
            param="routed_experts_prompt_start",
        )
    return body


def encode_request(body: dict[str, Any]) -> bytes:
    """`body` as JSON for an upstream. orjson reads 1024 levels of nesting but writes about
    255 (by release): a deeper body is the client's error (a 400), found before any upstream is
    called."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as e:
        raise BodyError(f"the request body cannot be written back as JSON ({e})") from None


def error_body(status: int, side: str, message: str, param: str | None = None) -> bytes:
    """The JSON error every failure gives the client, as a response or as a final stream event:
    OpenAI's shape (`message`, `type`, `param`: the request field at fault or null, `code`) plus
    `side`."""
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    error = {"message": message, "type": kind, "param": param, "side": side, "code": status}
    return orjson.dumps({"error": error})


def error_event(status: int, side: str, message: str) -> bytes:
    """`error_body` as a server-sent event."""
    return b"data: " + error_body(status, side, message) + b"\n\n"
