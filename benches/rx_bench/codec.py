"""`routed-experts bench`: this library beside what a user would write instead, in one run.

Each operation is timed as the best of `repeat` runs (the least disturbed by the rest of the
machine) and reported with its throughput and its ratio to the alternatives.
"""

from __future__ import annotations

import json
import resource
import threading
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import numpy as np

import routed_experts as rx
from routed_experts._synthetic import MODELS, best_of, synthetic_rollout
from rx_bench import baselines


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
    # One copy of the same bytes (both bodies, for a merge) into memory already mapped: the
    # floor the ratios are taken against (`memcpy` also pays for faulting in fresh pages).
    copy: float = 0.0
    # Page faults per call of ours (every thread of the process), the cost of first touch.
    faults: float = 0.0

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
        copied: tuple[bytes, ...] = (),
    ) -> Row:
        copied = copied or (data,)
        mapped = bytearray(sum(map(len, copied)))

        def copy() -> None:
            at = 0
            for part in copied:
                baselines.copy_into(memoryview(mapped)[at: at + len(part)], part)
                at += len(part)

        return Row(
            model,
            tokens,
            op,
            len(data),
            ours=best_of(ours, repeat),
            fast=_optional(lambda: best_of(fast, repeat)) if fast else None,
            stdlib=best_of(stdlib, max(1, repeat // 3)) if stdlib else None,
            memcpy=best_of(lambda: baselines.memcpy(data), repeat),
            copy=best_of(copy, repeat),
            faults=faults_per_call(ours, repeat),
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
            copied=(prefill_body, decode_body),
        ),
        row(
            "merge_response (general)",
            decode_body,
            lambda: rx.merge_response(prefill_body, decode_body, splice=False),
            lambda: baselines.merge_response(prefill_body, decode_body),
            None,
            copied=(prefill_body, decode_body),
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


def measure_quality(model: str, tokens: int, repeat: int) -> list[Row]:
    """agreement and expert_load beside numpy (the `fast` column; there is no stdlib one) and
    one copy of their inputs into mapped memory: a rollout against a recompute in which 10% of
    the routers picked one other expert."""
    p = synthetic_rollout(model, tokens)
    layers, top_k, experts = MODELS[model]
    a = p.array
    b = a.copy()
    rng = np.random.default_rng(1)
    changed = rng.random(a.shape[:2]) < 0.1
    rows_changed = b[changed].astype(np.int64)
    # One expert of each changed router replaced by one the router did not pick: the first of
    # row[0] + 1, row[0] + 2, ... (mod experts) that is not in the row.
    pick = np.full(len(rows_changed), -1)
    for step in range(top_k, 0, -1):
        candidate = (rows_changed[:, 0] + step) % experts
        free = ~(rows_changed == candidate[:, None]).any(axis=1)
        pick = np.where(free, candidate, pick)
    rows_changed[:, 0] = pick
    b[changed] = rows_changed.astype(b.dtype)
    q = rx.RoutedExperts.from_array(b, dtype=p.dtype)
    both, one = a.tobytes() + b.tobytes(), a.tobytes()
    dst = bytearray(len(both))
    return [
        Row(model, tokens, "agreement", len(both),
            ours=best_of(lambda: rx.agreement(p, q), repeat),
            fast=best_of(lambda: baselines.agreement(a, b), max(1, repeat // 3)),
            stdlib=None, memcpy=best_of(lambda: baselines.copy_into(dst, both), repeat)),
        Row(model, tokens, "expert_load", len(one),
            ours=best_of(lambda: rx.expert_load(p, experts), repeat),
            fast=best_of(lambda: baselines.expert_load(a, experts), max(1, repeat // 3)),
            stdlib=None,
            memcpy=best_of(lambda: baselines.copy_into(memoryview(dst)[: len(one)], one), repeat)),
    ]


def quality_table(rows: list[Row]) -> str:
    columns = ["model", "tokens", "operation", "input MB", "routed_experts ms", "numpy ms",
               "memcpy ms", "vs numpy", "/ memcpy"]
    return _markdown(columns, [
        [r.model, str(r.tokens), r.op, f"{r.nbytes / 1e6:.1f}", _fmt_ms(r.ours), _fmt_ms(r.fast),
         _fmt_ms(r.memcpy), _ratio(r.fast, r.ours), f"{r.ours / r.memcpy:.1f}x"]
        for r in rows
    ])


def run_quality(
    models: list[str], token_counts: list[int], repeat: int, out: TextIO
) -> list[Row]:
    rows: list[Row] = []
    for model in models:
        for tokens in token_counts:
            print(f"measuring replay quality, {model}, {tokens} tokens ...", file=out, flush=True)
            rows.extend(measure_quality(model, tokens, repeat))
    print(quality_table(rows), file=out)
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


_PEAK_CHILD = """
import gc, sys
import numpy as np

import routed_experts as rx

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

body = open(sys.argv[1], "rb").read()
gc.collect()
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
p = rx.from_response(body)
print(status("VmHWM:") - before, p.nbytes, len(body))
"""


def peak_memory(model: str, tokens: int) -> tuple[int, int, int]:
    """(peak growth in bytes, output array bytes, body bytes) of one `from_response` in a fresh
    process: what decoding costs beyond the body the caller already holds. Linux only (it
    resets the process's peak RSS through /proc/self/clear_refs)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(body(synthetic_rollout(model, tokens).to_dict()))
        f.flush()
        out = subprocess.run(
            [sys.executable, "-c", _PEAK_CHILD, f.name], capture_output=True, text=True, check=True
        ).stdout.split()
    grew, output, size = (int(x) for x in out)
    return grew, output, size


def faults_per_call(fn: Callable[[], object], calls: int) -> float:
    """Page faults (minor and major, every thread) per call of `fn`, over `calls` calls."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt) / calls


def _fmt_ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:.2f}"


def _ratio(other: float | None, ours: float) -> str:
    return "n/a" if other is None else f"{other / ours:.1f}x"


def _markdown(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    columns = ["model", "tokens", "operation", "MB", "routed_experts ms", "GB/s",
               "orjson+pybase64 ms", "stdlib ms", "copy ms", "vs orjson", "vs stdlib",
               "/ copy", "faults"]
    return _markdown(columns, [
        [r.model, str(r.tokens), r.op, f"{r.nbytes / 1e6:.1f}", _fmt_ms(r.ours),
         f"{r.nbytes / r.ours / 1e9:.2f}", _fmt_ms(r.fast), _fmt_ms(r.stdlib),
         _fmt_ms(r.copy), _ratio(r.fast, r.ours), _ratio(r.stdlib, r.ours),
         f"{r.ours / r.copy:.2f}x", f"{r.faults:.0f}"]
        for r in rows
    ])


def run(
    models: list[str],
    token_counts: list[int],
    repeat: int,
    out: TextIO,
    json_out: str | None = None,
) -> list[Row]:
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
    # Threads and memory at the largest size up to 32k tokens (the common RL rollout).
    m = models[0]
    t = max([n for n in token_counts if n <= 32768] or token_counts[:1])
    scaling = thread_scaling(m, t, repeat)
    print(
        f"\ntwo threads decoding independent bodies ({m}, {t} tokens): "
        f"{scaling:.2f}x the throughput of one (a body of 4 MiB and more is already spread "
        f"over the cores by one call, so two callers share them rather than add to them)",
        file=out,
    )
    grew, output, size = peak_memory(m, t)
    print(
        f"peak memory of from_response ({m}, {t} tokens): grew {grew / 1e6:.1f} MB for a "
        f"{output / 1e6:.1f} MB array from a {size / 1e6:.1f} MB body: "
        f"{(grew - output) / size * 100:+.1f}% of the body beyond the array",
        file=out,
    )
    if json_out:
        with open(json_out, "w") as f:
            summary = {"grew": grew, "output": output, "body": size}
            rows_out = [r.as_dict() for r in rows]
            json.dump({"rows": rows_out, "thread_scaling": scaling, "peak": summary}, f, indent=1)
    return rows
