"""A stand-in inference engine, to try the proxy (and measure its routing policies) without a
GPU: `routed-experts engine --role prefill|decode`. It speaks vLLM's disaggregated-serving
protocol as the proxy drives it, returns synthetic routing of a real model's size, and can model
a prefix cache. Standard library and numpy only, so it needs no extra.

What it answers is `VllmAnswers`, apart from the server: the proxy's tests serve the same
answers behind their fault injection (tests/engines.py), so there is one stand-in engine.
It answers as vLLM 0.32 does (held to the bodies a real vLLM 0.32 sent, tests/real/vllm/, by
tests/test_stand_in_engine.py): routing as base64 `.npy` at `choices[i].routed_experts`, rows
`[S, P + G - 1)` for the `routed_experts_prompt_start` S a request asks for (top level on
`/v1/completions` and `/v1/chat/completions`, in `sampling_params` on
`/inference/v1/generate`); no routing on completions and chat streams, and on generate streams
the whole routing with each choice's finishing event.

- Prefill answers a request with `kv_transfer_params.do_remote_decode` with its prompt's
  routing (rows [S, P)) and the `kv_transfer_params` decode needs.
- Decode refuses a request without prefill's `kv_transfer_params` (400). It received the
  prompt's whole blocks over the KV connector and computed the rest (at least the prompt's last
  position): asked for routing of a position it did not compute, it answers 500, where a real
  vLLM 0.32 decode engine dies (`BlockObjectStoreError`, then `EngineDeadError`).
- A position's routing depends only on the tokens up to it (a rolling hash), so every server
  agrees on a prompt's rows and a merge can be checked against `routing_of(tokens, G)`.
- A token is a byte of the prompt's UTF-8 text (or an id of a prompt given as ids).
- `n` choices (1 to `MAX_CHOICES`) each generate their own tokens (choice i's are all 7 + i),
  so their generated rows differ and their prompt rows agree, as a real engine's do.
- With `stream_ms`, a stream's events are written one at a time that many milliseconds apart
  (chunked), so a decode that fails or is stopped mid-stream can be shown.
- With `cache_blocks`, prefill keeps an LRU of 16-token blocks, hashed in a chain as vLLM's
  automatic prefix caching does: a prompt's leading blocks found there are cached, and only the
  rest costs compute time (`prefill_us_per_token`, one prompt at a time, as a GPU's compute is
  shared). `GET /stats` reports requests, prompt tokens and cached tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from routed_experts._core import RoutedExperts, encode
from routed_experts._synthetic import MODELS

BLOCK = 16  # tokens per prefix-cache block (vLLM's default block size)
MAX_BODY = 64 << 20  # a request body larger than this is refused (413)
MAX_CHOICES = 16  # a request's `n` past this is refused (400)
_MASK = (1 << 61) - 1  # rolling hashes are kept below a Mersenne prime


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    """The request's prompt as tokens: ids as given (`token_ids` of a generate request, or a
    prompt of ids), or the bytes of its text (chat: every message's content, in order)."""
    ids = body.get("token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return list(ids)
    if "messages" in body:
        text = "".join(str(m.get("content", "")) for m in body["messages"])
        return list(text.encode())
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return list(str(prompt).encode())


def routing_of(
    tokens: list[int], generated: int, model: str | tuple[int, int, int], choice: int = 0
) -> np.ndarray:
    """The routing a monolithic engine would record for `tokens` and `generated` more: rows
    [0, P + G - 1), each row `top_k` distinct experts per layer, a function of the tokens up to
    its position. `model`: a name of MODELS, or (layers, top_k, experts). Choice `choice`
    generates tokens 7 + `choice`, so choices share only the prompt's rows."""
    layers, top_k, experts = _dims(model)
    rows = len(tokens) + generated - 1
    hashes = np.empty(max(rows, 0), dtype=np.uint64)
    h = 0
    for i in range(rows):
        token = tokens[i] if i < len(tokens) else 7 + choice  # generated: the choice's token
        h = (h * 1_000_003 + token + 1) & _MASK
        hashes[i] = h
    per_layer = np.arange(layers, dtype=np.uint64) * np.uint64(2654435761)
    base = (hashes[:, None] ^ per_layer[None, :]) % np.uint64(experts)
    stride = np.uint64(max(experts // top_k, 1))
    ids = (base[:, :, None] + np.arange(top_k, dtype=np.uint64) * stride) % np.uint64(experts)
    return ids.astype(np.int64)


class PrefixCache:
    """An LRU of `capacity` blocks of `BLOCK` tokens, each named by a hash of its tokens and of
    every block before it (so a block matches only after the same prefix)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def lookup_and_insert(self, tokens: list[int]) -> int:
        """Tokens of `tokens` already cached (whole leading blocks); then the prompt's blocks
        are cached, the least recently used evicted."""
        chain, names = 0, []
        for lo in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            chain = hash((chain, tuple(tokens[lo : lo + BLOCK])))
            names.append(chain)
        cached = 0
        for name in names:
            if name not in self.blocks:
                break
            cached += 1
        for name in names:
            self.blocks[name] = None
            self.blocks.move_to_end(name)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return cached * BLOCK


def _dims(model: str | tuple[int, int, int]) -> tuple[int, int, int]:
    if isinstance(model, tuple):
        layers, top_k, experts = model
        if not (layers > 0 and 0 < top_k <= experts <= 1 << 16):
            raise ValueError(f"model: expected (layers, top_k, experts) with "
                             f"0 < top_k <= experts <= 65536, got {model!r}")
        return model
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(sorted(MODELS))}, got {model!r}")
    return MODELS[model]


class VllmAnswers:
    """What one vLLM engine (`role` "prefill" or "decode") answers a request: a function of the
    request (and of the prefix cache). `StandInEngine` serves it on a port; the proxy's tests
    serve it behind their fault injection (tests/engines.py), so every stand-in answers alike.

    The defaults are vLLM 0.32's. The other settings are what other engines do:
    `uncomputed_rows="zeros"` (vLLM before 0.32: decode answers rows it never computed, zeroed),
    `routing_format="compact"` (an engine that encodes with this library), `stream_routing=True`
    (routing on the finishing event of completions and chat streams too, as generate streams
    carry it: no vLLM release through 0.33 does, and the proxy's streaming merge is the same for
    every path), `release="0.27"` (vLLM 0.25 to 0.27: completions and chat ignore the start and
    send rows from 0), `release="0.21"` (vLLM 0.21's split routing, format.md §3.4: the start
    ignored, the prompt's rows as nested lists at the top, the generated ones in the choice).
    """

    def __init__(
        self,
        role: str,
        model: str | tuple[int, int, int] = "qwen3-30b-a3b",
        *,
        prefill_us_per_token: float = 0.0,
        cache_blocks: int = 0,
        decode_ms: float = 0.0,
        stream_ms: float = 0.0,
        uncomputed_rows: str = "error",
        routing_format: str = "vllm_npy",
        stream_routing: bool = False,
        release: str = "0.32",
        engine_id: str | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f'role: expected "prefill" or "decode", got {role!r}')
        if uncomputed_rows not in ("error", "zeros"):
            got = repr(uncomputed_rows)
            raise ValueError(f'uncomputed_rows: expected "error" or "zeros", got {got}')
        if routing_format not in ("vllm_npy", "compact"):
            got = repr(routing_format)
            raise ValueError(f'routing_format: expected "vllm_npy" or "compact", got {got}')
        if release not in ("0.32", "0.27", "0.21"):
            raise ValueError(f'release: expected "0.32", "0.27" or "0.21", got {release!r}')
        self.dims = _dims(model)  # (layers, top_k, experts)
        self.num_experts = self.dims[2]
        self.role, self.model = role, model if isinstance(model, str) else "moe"
        self.uncomputed_rows, self.routing_format = uncomputed_rows, routing_format
        self.stream_routing, self.release = stream_routing, release
        self.prefill_us_per_token, self.decode_ms = prefill_us_per_token, decode_ms
        self.stream_ms = stream_ms
        self.cache = PrefixCache(cache_blocks) if cache_blocks > 0 else None
        self.compute = threading.Lock()  # one prompt's compute at a time
        self.stats_lock = threading.Lock()
        self.stats: dict[str, int] = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self.engine_id = engine_id or f"stand-in-{role}-{id(self):x}"

    def truth(self, tokens: list[int], generated: int, choice: int = 0) -> np.ndarray:
        """Rows [0, P + G - 1) of choice `choice` as a monolithic engine records them
        (`routing_of`)."""
        return routing_of(tokens, generated, self.dims, choice)

    def routed_rows(
        self, tokens: list[int], generated: int, start: int, choice: int = 0
    ) -> tuple[np.ndarray, int]:
        """The rows this engine answers for a request asked from `start`, and their start."""
        return self.truth(tokens, generated, choice)[start:], start

    def routing_value(self, rows: np.ndarray, start: int) -> Any:
        """The routing value written into a reply: vLLM's base64 `.npy` (no start in it), or
        a compact sidecar."""
        p = RoutedExperts.from_array(rows, start=start, num_experts=self.num_experts)
        return encode(p, "compact" if self.routing_format == "compact" else "vllm_npy")

    def kv_transfer_params(self, tokens: list[int]) -> dict[str, Any]:
        """What prefill returns for decode to load the prompt's KV from."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(range(len(tokens) // BLOCK + 1)),
            "remote_host": "127.0.0.1",
            "remote_port": 14579,
        }

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
        """(status, content type, body) for a completion request's JSON `body`."""
        status, reply = self.reply(path, body)
        if isinstance(reply, list):
            events = [b"data: " + json.dumps(doc).encode() + b"\n\n" for doc in reply]
            return status, "text/event-stream", b"".join([*events, b"data: [DONE]\n\n"])
        return status, "application/json", json.dumps(reply).encode()

    def reply(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, reply): a JSON document, or a stream's events as a list of documents
        (`data: [DONE]` follows them)."""
        generate = path == "/inference/v1/generate"
        tokens = prompt_tokens(body)
        if not tokens:
            return _error_doc(400, "the prompt is empty")
        limits = body.get("sampling_params") or {} if generate else body
        if not isinstance(limits, dict):
            return _error_doc(400, "sampling_params must be an object")
        generated = int(limits.get("max_completion_tokens") or limits.get("max_tokens") or 16)
        n = limits.get("n", 1) if limits.get("n") is not None else 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            return _error_doc(400, f"n must be an integer in 1..{MAX_CHOICES}, got {n!r}")
        if n > 1 and self.release == "0.21":
            return _error_doc(400, "the stand-in's vLLM 0.21 answers one choice (n=1)")
        start = limits.get("routed_experts_prompt_start") or 0
        if self.release == "0.21" or (self.release == "0.27" and not generate):
            start = 0  # 0.21 takes no start; 0.25 to 0.27 take it on generate only
        if not isinstance(start, int) or not 0 <= start < len(tokens):
            return _error_doc(400, f"routed_experts_prompt_start must be in 0..{len(tokens) - 1}")
        kv = body.get("kv_transfer_params") or {}
        if self.role == "prefill":
            if not kv.get("do_remote_decode"):
                return _error_doc(400, "a prefill server takes kv_transfer_params.do_remote_decode")
            self._prefill_compute(tokens)
            if self.release == "0.21":
                return 200, self._split_reply(path, tokens, 1)
            routed = [self.routed_rows(tokens, 1, start, c) for c in range(n)]
            doc = self._reply(path, "x", routed, len(tokens), 1, body)
            doc["kv_transfer_params"] = self.kv_transfer_params(tokens)
            return 200, doc
        if not kv.get("do_remote_prefill") or not kv.get("remote_engine_id"):
            return _error_doc(400, "a decode server needs the kv_transfer_params prefill returned")
        if self.release == "0.21":
            if body.get("stream"):
                return _error_doc(400, "the stand-in's vLLM 0.21 does not stream")
            return 200, self._split_reply(path, tokens, generated)
        # The prompt's whole blocks came over the KV connector, all but its last position at
        # least: decode computed positions from `received` on and has no routing before.
        received = (len(tokens) - 1) // BLOCK * BLOCK
        if start < received and self.uncomputed_rows == "error":
            return _error_doc(
                500,
                f"routing asked from position {start}, but positions before {received} came over "
                "the KV connector and were never computed here (a real vLLM 0.32 decode engine "
                "dies: BlockObjectStoreError, EngineDeadError)",
            )
        if self.decode_ms:
            time.sleep(self.decode_ms / 1000)
        routed = [self.routed_rows(tokens, generated, start, c) for c in range(n)]
        if self.uncomputed_rows == "zeros":
            for rows, at in routed:
                rows[: max(len(tokens) - at, 0)] = 0  # the prompt's rows, never computed here
        if body.get("stream"):
            return 200, self._stream(path, routed, len(tokens), generated, body)
        return 200, self._reply(path, " tok" * generated, routed, len(tokens), generated, body)

    def _prefill_compute(self, tokens: list[int]) -> None:
        with self.compute:
            cached = self.cache.lookup_and_insert(tokens) if self.cache else 0
            if self.prefill_us_per_token:
                time.sleep((len(tokens) - cached) * self.prefill_us_per_token / 1e6)
        with self.stats_lock:
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += len(tokens)
            self.stats["cached_tokens"] += cached

    def _choice(
        self, path: str, text: str, generated: int, body: dict[str, Any], index: int = 0
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": text}
        elif path == "/v1/completions":
            choice["text"] = text
        else:
            choice["token_ids"] = [7 + index] * generated
        choice["logprobs"] = _logprobs(path, generated) if body.get("logprobs") else None
        choice["finish_reason"] = "length"
        return choice

    def _reply(
        self, path: str, text: str, routed: list[tuple[np.ndarray, int]], prompt: int,
        generated: int, body: dict[str, Any],
    ) -> dict[str, Any]:
        """A plain reply with one choice per `routed` (its rows and their start)."""
        choices = []
        for i, (rows, start) in enumerate(routed):
            choice = self._choice(path, text, generated, body, i)
            choice["routed_experts"] = self.routing_value(rows, start)
            choices.append(choice)
        usage = _usage(prompt, generated * len(routed))
        if path == "/inference/v1/generate":
            return {"request_id": f"generate-tokens-{self.role}", "model": self.model,
                    "usage": usage, "prompt_token_ids": None, "kv_transfer_params": None,
                    "choices": choices}  # fmt: skip
        return {
            "id": f"cmpl-{self.role}",
            "object": "chat.completion" if path == "/v1/chat/completions" else "text_completion",
            "model": self.model,
            "choices": choices,
            "usage": usage,
            "kv_transfer_params": None,
        }

    def _split_reply(self, path: str, tokens: list[int], generated: int) -> dict[str, Any]:
        """vLLM 0.21's body: the prompt's rows at the top (nested lists), the generated rows in
        the choice (none for prefill's one token); decode loaded the prompt's KV and ran none
        of it, so its prompt rows are zero."""
        P, prefill = len(tokens), self.role == "prefill"
        full = self.truth(tokens, generated)
        prompt_rows = full[:P].copy()
        if not prefill:
            prompt_rows[:] = 0
        text = "x" if prefill else " tok" * generated
        message = ({"message": {"role": "assistant", "content": text}}
                   if path == "/v1/chat/completions" else {"text": text})
        return {"id": f"cmpl-{self.role}", "object": "text_completion", "model": self.model,
                "prompt_routed_experts": prompt_rows.tolist(),
                "choices": [{"index": 0, **message, "finish_reason": "length",
                             "routed_experts": full[P:].tolist() or None}],
                "usage": _usage(P, generated),
                "kv_transfer_params": self.kv_transfer_params(tokens) if prefill else None}

    def _stream(
        self, path: str, routed: list[tuple[np.ndarray, int]], prompt: int, generated: int,
        body: dict[str, Any],
    ) -> list[dict[str, Any]]:
        """As vLLM 0.32 streams: routing only on `/inference/v1/generate`, the whole value on
        each choice's finishing event (`null` before it); none on completions and chat streams
        (unless `stream_routing`); a usage-only event last when `stream_options.include_usage`.
        The choices' events take turns, one token each."""
        chat, generate = path == "/v1/chat/completions", path == "/inference/v1/generate"
        kind = "chat.completion.chunk" if chat else "text_completion"
        events: list[dict[str, Any]] = []
        for i in range(generated):
            for index, (rows, start) in enumerate(routed):
                choice: dict[str, Any] = {"index": index}
                if chat:
                    choice["delta"] = {"content": " tok"}
                elif generate:
                    choice["token_ids"] = [7 + index]
                else:
                    choice["text"] = " tok"
                last = i == generated - 1
                choice["finish_reason"] = "length" if last else None
                if generate:
                    choice["routed_experts"] = self.routing_value(rows, start) if last else None
                    doc = {"request_id": "generate-tokens-decode", "usage": None,
                           "choices": [choice]}  # fmt: skip
                else:
                    if last and self.stream_routing:
                        choice["routed_experts"] = self.routing_value(rows, start)
                    doc = {"id": "cmpl-decode", "object": kind, "model": self.model,
                           "choices": [choice]}  # fmt: skip
                events.append(doc)
        options = body.get("stream_options")
        if not generate and isinstance(options, dict) and options.get("include_usage"):
            events.append({"id": "cmpl-decode", "object": kind, "model": self.model,
                           "choices": [], "usage": _usage(prompt, generated * len(routed))})
        return events


class StandInEngine:
    """One stand-in engine (`role` "prefill" or "decode") serving `VllmAnswers` on `host:port`
    (0: a free port) on threads of its own; a context manager, or `serve_forever()`."""

    def __init__(
        self,
        role: str,
        model: str = "qwen3-30b-a3b",
        host: str = "127.0.0.1",
        port: int = 0,
        prefill_us_per_token: float = 0.0,
        cache_blocks: int = 0,
        decode_ms: float = 0.0,
        uncomputed_rows: str = "error",
        stream_ms: float = 0.0,
    ) -> None:
        self.answers = VllmAnswers(
            role, model, prefill_us_per_token=prefill_us_per_token, cache_blocks=cache_blocks,
            decode_ms=decode_ms, uncomputed_rows=uncomputed_rows, stream_ms=stream_ms,
        )
        self.role, self.model = role, model
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def stats(self) -> dict[str, int]:
        """Requests, prompt tokens and cached tokens so far (prefill's; `GET /stats`)."""
        with self.answers.stats_lock:
            return dict(self.answers.stats)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        assert isinstance(host, str)  # an IPv4 listener's address
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def __enter__(self) -> StandInEngine:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine, answers, model = self, self.answers, self.model

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the proxy's pooled client expects

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # one line per request would drown the proxy's own log

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/health":
                    self._send(200, "application/json", b"{}")
                elif self.path == "/v1/models":
                    doc = {"object": "list", "data": [{"id": model, "object": "model"}]}
                    self._send(200, "application/json", json.dumps(doc).encode())
                elif self.path == "/stats":
                    self._send(200, "application/json", json.dumps(engine.stats).encode())
                else:
                    self._send(*_error(404, f"no GET {self.path[:100]}"))

            def do_POST(self) -> None:  # noqa: N802
                try:
                    length = int(self.headers.get("content-length", ""))
                except ValueError:
                    self._send(*_error(411, "a content-length is required"))
                    return
                if not 0 <= length <= MAX_BODY:
                    self._send(*_error(413, f"a body of {length} bytes is over {MAX_BODY}"))
                    return
                raw = self.rfile.read(length)
                if self.path not in PATHS:
                    self._send(*_error(404, f"no POST {self.path[:100]}"))
                    return
                try:
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise ValueError("the body is not a JSON object")
                    if answers.stream_ms and body.get("stream"):
                        status, reply = answers.reply(self.path, body)
                        if isinstance(reply, list):
                            self._send_slowly(reply)
                            return
                        self._send(status, "application/json", json.dumps(reply).encode())
                        return
                    self._send(*answers.answer(self.path, body))
                except (ValueError, TypeError) as e:
                    self._send(*_error(400, str(e)))

            def _send_slowly(self, events: list[dict[str, Any]]) -> None:
                """A stream's events one chunk at a time, `stream_ms` apart."""
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                texts = [b"data: " + json.dumps(doc).encode() + b"\n\n" for doc in events]
                for text in [*texts, b"data: [DONE]\n\n"]:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(text), text))
                    self.wfile.flush()
                    time.sleep(answers.stream_ms / 1000)
                self.wfile.write(b"0\r\n\r\n")

        return Handler


PATHS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")


def _usage(prompt: int, generated: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + generated,
            "completion_tokens": generated}


def _logprobs(path: str, generated: int) -> dict[str, Any]:
    """Each generated token's log-probability, as the request's endpoint writes them (one
    long float, so a merge that re-spelled numbers would show)."""
    lp = -0.12345678901234568
    if path == "/v1/chat/completions":
        return {"content": [{"token": " tok", "logprob": lp, "bytes": [32, 116, 111, 107],
                             "top_logprobs": []} for _ in range(generated)]}
    return {"tokens": [" tok"] * generated, "token_logprobs": [lp] * generated,
            "top_logprobs": None, "text_offset": [4 * i for i in range(generated)]}


def _error_doc(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "invalid_request_error",
                              "code": status}}


def _error(status: int, message: str) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(_error_doc(status, message)[1]).encode()
