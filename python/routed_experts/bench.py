"""`routed-experts bench`: this library beside what a user would write instead, in one run.

Each operation is timed as the best of `repeat` runs (the least disturbed by the rest of the
machine) and reported with its throughput and its ratio to the alternatives.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import routed_experts as rx
from routed_experts import baselines
from routed_experts.cli import MODELS, synthetic_rollout


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up (page-in, allocator)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class Row:
    model: str
    tokens: int
    op: str
    nbytes: int
    ours: float
    fast: float | None
    stdlib: float | None
    memcpy: float

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def body(routing: dict[str, Any]) -> bytes:
    """A vLLM-style completion body around one routing value."""
    doc = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": "moe",
        "choices": [
            {
                "index": 0,
                "text": "hello",
                "logprobs": None,
                "finish_reason": "length",
                "routed_experts": routing,
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    return json.dumps(doc).encode()


def _optional(fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except ImportError:  # orjson / pybase64 not installed: the column stays empty
        return None


def measure(model: str, tokens: int, repeat: int) -> list[Row]:
    p = synthetic_rollout(model, tokens)
    prompt = tokens * 3 // 4
    wire = p.to_json()
    zeroed = p.to_numpy(writable=True)
    zeroed[:prompt] = 0
    prefill_body = body(p.slice(0, prompt).to_dict())
    decode_body = body(rx.RoutedExperts.from_array(zeroed, dtype=p.dtype).to_dict())
    arr = p.array

    def row(
        op: str,
        data: bytes,
        ours: Callable[[], object],
        fast: Callable[[], object] | None,
        stdlib: Callable[[], object] | None,
    ) -> Row:
        return Row(
            model,
            tokens,
            op,
            len(data),
            ours=best_of(ours, repeat),
            fast=_optional(lambda: best_of(fast, repeat)) if fast else None,
            stdlib=best_of(stdlib, max(1, repeat // 3)) if stdlib else None,
            memcpy=best_of(lambda: baselines.memcpy(data), repeat),
        )

    rows = [
        row(
            "decode sidecar",
            wire,
            lambda: rx.RoutedExperts.from_json(wire),
            lambda: baselines.decode_sidecar(wire),
            lambda: baselines.decode_sidecar(wire, fast=False),
        ),
        row(
            "from_response",
            decode_body,
            lambda: rx.from_response(decode_body),
            lambda: baselines.from_response(decode_body),
            lambda: baselines.from_response(decode_body, fast=False),
        ),
        row(
            "merge_response (splice)",
            decode_body,
            lambda: rx.merge_response(prefill_body, decode_body),
            lambda: baselines.merge_response(prefill_body, decode_body),
            lambda: baselines.merge_response(prefill_body, decode_body, fast=False),
        ),
        row(
            "merge_response (general)",
            decode_body,
            lambda: rx.merge_response(prefill_body, decode_body, splice=False),
            lambda: baselines.merge_response(prefill_body, decode_body),
            None,
        ),
        row(
            "encode (to_json)",
            wire,
            p.to_json,
            lambda: baselines.encode_sidecar(arr, 0),
            lambda: baselines.encode_sidecar(arr, 0, fast=False),
        ),
    ]
    return rows


def thread_scaling(model: str, tokens: int, repeat: int) -> float:
    """Throughput of two threads decoding independent bodies, over one thread's."""
    bodies = [body(synthetic_rollout(model, tokens, seed=s).to_dict()) for s in (1, 2)]
    per_thread = 8

    def work(b: bytes) -> None:
        for _ in range(per_thread):
            rx.from_response(b)

    def one() -> None:
        work(bodies[0])
        work(bodies[1])

    def two() -> None:
        threads = [threading.Thread(target=work, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return best_of(one, max(2, repeat // 2)) / best_of(two, max(2, repeat // 2))


def _fmt_ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:.2f}"


def _ratio(other: float | None, ours: float) -> str:
    return "n/a" if other is None else f"{other / ours:.1f}x"


def table(rows: list[Row]) -> str:
    head = (
        "| model | tokens | operation | MB | routed_experts ms | GB/s | orjson+pybase64 ms | "
        "stdlib ms | memcpy ms | vs orjson | vs stdlib | / memcpy |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.tokens} | {r.op} | {r.nbytes / 1e6:.1f} | {_fmt_ms(r.ours)} | "
            f"{r.nbytes / r.ours / 1e9:.2f} | {_fmt_ms(r.fast)} | {_fmt_ms(r.stdlib)} | "
            f"{_fmt_ms(r.memcpy)} | {_ratio(r.fast, r.ours)} | {_ratio(r.stdlib, r.ours)} | "
            f"{r.ours / r.memcpy:.1f}x |"
        )
    return "\n".join(lines)


def run(models: list[str], token_counts: list[int], repeat: int, out: TextIO) -> list[Row]:
    rows: list[Row] = []
    for model in models:
        for tokens in token_counts:
            layers, top_k, experts = MODELS[model]
            print(
                f"measuring {model} ({layers} layers, top_k {top_k}, {experts} experts), "
                f"{tokens} tokens ...",
                file=out,
                flush=True,
            )
            rows.extend(measure(model, tokens, repeat))
    print(table(rows), file=out)
    m, t = models[0], token_counts[0]
    print(
        f"\ntwo threads decoding independent bodies ({m}, {t} tokens): "
        f"{thread_scaling(m, t, repeat):.2f}x the throughput of one",
        file=out,
    )
    return rows
