"""One RL step's routing, every hop, measured (`make bench-step`; a short round in CI,
`make bench-step-ci`): GRPO groups of `n` choices over a long prompt, at the model geometries
of DEVELOPERS.md.

stand-in engines (prefill, decode) -> the proxy (`routed-experts proxy`, its defaults) ->
the rollout side (HTTP, then each choice's routing collected) -> the trainer side (the group
packed into one batch, then each rank's share: context parallel x pipeline stages).

Three ways side by side, each in a fresh process so its peak memory is its own:

- `library, engine answer`: the proxy's default answer (vLLM's `.npy` text, the prompt's rows
  in every choice), fed to an `rx.BodyReader` as it arrives and read as a group (the prompt's
  rows held once, shared by the choices' samples; the reader holds compact sidecars' base64
  decoded, `.npy` text as text), packed with `rx.pack` (int32), shared out with `rx.shard` (in
  the process, and with `--ray` by trainer ranks that read the batch from Ray's object store, each
  only its share), and each rank's share written straight from the samples with
  `rx.pack_shard` into one reused buffer, no batch at all (`direct`);
- `library, shared answer`: the same with `"routed_experts_prompt_routing": "shared"` (the
  prompt's rows once, format.md §4.1);
- `glue`: the engine answer read as RL frameworks do today (`json.loads` of the body, then
  `np.load` of each choice's base64), one full int64 batch per step (`np.concatenate`), each
  rank's share cut from it with numpy.

Per hop: seconds, bytes, and the process's peak resident size so far above what it held before
its first request (the rollout side's peak after `collect`, the step's after `shard`), beside
the information the group holds (its rows, in the engine's dtype). The proxy's peak resident
size is read from /proc after each way's requests. Loopback only;
every round is bounded."""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GEOMETRIES = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2"]
WAYS = ["library, engine answer", "library, shared answer", "glue"]
HERE = Path(__file__).resolve()


def _status_kb(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _resident() -> int:
    """This process's resident size now, its peak so far reset to it (Linux's `clear_refs` 5),
    so that a peak read later is of what came after, not of imports and set-up before. Where
    the kernel refuses the reset, the peak keeps counting from the process's start (so reads
    higher, never lower)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_kb("VmRSS") * 1024


def _peak_above(base: int) -> int:
    """This process's peak resident size since it started, above `base` (bytes)."""
    return _status_kb("VmHWM") * 1024 - base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, seconds: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {seconds} s") from None
            time.sleep(0.1)


def _ranks(cp: int, pp: int, layers: int) -> list[tuple[int, tuple[int, int]]]:
    """Every rank's (cp rank, its pipeline stage's layers)."""
    step = -(-layers // pp)
    stages = [(lo, min(lo + step, layers)) for lo in range(0, layers, step)]
    return [(r, s) for r in range(cp) for s in stages]


def child(args: argparse.Namespace) -> None:
    """One way, in this process: every hop of `args.groups` groups, reported as JSON."""
    import httpx
    import numpy as np

    import routed_experts as rx

    way, hops = args.way, {}
    rx.set_max_bytes(16 << 30)  # a step's packed batch runs to gigabytes (int32, 94 layers)
    prompt = [(i * 7919) % 50_000 + 1 for i in range(args.prompt_tokens)]
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "n": args.n,
                            "max_tokens": args.generated}  # fmt: skip
    if way == "library, shared answer":
        body["routed_experts_prompt_routing"] = "shared"

    # Hop 1: the groups' answers over HTTP from the proxy: the glue takes each whole, the
    # library feeds each chunk to a reader as it arrives (long base64 strings held decoded).
    # The client's first request (its connection, the modules it loads) comes before the base:
    # the peaks are of the groups, not of an HTTP client's set-up.
    with httpx.Client(timeout=600) as client:
        client.get(args.proxy + "/health").raise_for_status()
        base, began, answers, readers = _resident(), time.perf_counter(), [], []
        wire, feeding = 0, 0.0  # bytes, and seconds inside `BodyReader.feed`
        for g in range(args.groups):
            request = {**body, "prompt": [g + 1, *prompt[1:]]}
            with client.stream("POST", args.proxy + "/v1/completions", json=request) as reply:
                if reply.status_code != 200:
                    raise SystemExit(f"{way}: {reply.status_code} {reply.read()[:300]!r}")
                if way == "glue":
                    answers.append(reply.read())
                    wire += len(answers[-1])
                    continue
                reader = rx.BodyReader()
                for chunk in reply.iter_raw(1 << 16):
                    fed = time.perf_counter()
                    reader.feed(chunk)
                    feeding += time.perf_counter() - fed
                    wire += len(chunk)
                readers.append(reader)
    hops["wire"] = {"seconds": time.perf_counter() - began, "peak": _peak_above(base),
                    "bytes": wire, "feed_seconds": feeding}  # fmt: skip

    # Hop 2: the rollout side collects each choice's routing.
    began = time.perf_counter()
    samples: list[Any] = []
    if way == "glue":
        for a in answers:
            for c in json.loads(a)["choices"]:
                raw = base64.b64decode(c["routed_experts"])
                samples.append(np.load(io.BytesIO(raw), allow_pickle=False))
    else:  # each group once: its prompt's rows shared by its choices' samples
        for r in readers:
            samples.extend(r.group())
        readers.clear()
    hops["collect"] = {"seconds": time.perf_counter() - began, "peak": _peak_above(base)}
    answers.clear()
    # What the group holds: prompt rows once and each choice's own, in the engine's dtype.
    first = np.asarray(samples[0] if way == "glue" else samples[0][-1].array)
    row_bytes = first.shape[1] * first.shape[2] * first.dtype.itemsize
    own = args.generated - 1
    info = args.groups * (args.prompt_tokens + args.n * own) * row_bytes

    # Hop 3: the trainer side packs the step's samples and takes each rank's share.
    began = time.perf_counter()
    if way == "glue":
        batch = np.concatenate([s.astype(np.int64) for s in samples])
        cu = np.cumsum([0] + [len(s) for s in samples])
    else:
        batch, cu = rx.pack(samples, pad_each_to_multiple=2 * args.cp)
    hops["pack"] = {"seconds": time.perf_counter() - began, "peak": _peak_above(base),
                    "bytes": int(batch.nbytes)}  # fmt: skip
    layers = batch.shape[1]
    began, share_bytes = time.perf_counter(), 0
    for cp_rank, stage in _ranks(args.cp, args.pp, layers):
        if way == "glue":
            share = _glue_share(batch, cu, args.cp, cp_rank, stage)
        else:
            share, _, _ = rx.shard(batch, cu, cp_size=args.cp, cp_rank=cp_rank, layers=stage)
        share_bytes += int(share.nbytes)
        del share
    hops["shard"] = {"seconds": time.perf_counter() - began, "peak": _peak_above(base),
                     "bytes": share_bytes, "ranks": args.cp * args.pp}  # fmt: skip
    if args.ray:
        hops["ray"] = _through_ray(batch, cu, args, way == "glue")
    del batch
    if way != "glue":
        hops["direct"] = _direct_shares(samples, args, layers)
    samples.clear()
    print(json.dumps({"way": way, "hops": hops, "choices": args.groups * args.n,
                      "information": info}))  # fmt: skip


def _direct_shares(samples: list[Any], args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """Each rank's share written straight from the samples (`rx.pack_shard`), no batch, into one
    buffer reused from rank to rank (as a trainer reuses a pinned one from step to step); the
    peak is this process's above what it held before (the samples)."""
    import numpy as np

    import routed_experts as rx

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, began, share_bytes, buf = _resident(), time.perf_counter(), 0, None
    ranks = _ranks(args.cp, args.pp, layers)
    for cp_rank, stage in ranks:
        share, _, _ = rx.pack_shard(samples, pad_each_to_multiple=2 * args.cp, cp_size=args.cp,
                                    cp_rank=cp_rank, layers=stage, out=buf)  # fmt: skip
        if buf is None:  # sized once: every rank's rows, the widest stage's layers
            widest = max(hi - lo for _, (lo, hi) in ranks)
            buf = np.empty(share.shape[0] * widest * share.shape[2], dtype=share.dtype)
        share_bytes += int(share.nbytes)
        del share
    return {"seconds": time.perf_counter() - began, "peak": _peak_above(base),
            "bytes": share_bytes, "ranks": len(ranks)}  # fmt: skip


def _glue_share(batch: Any, cu: Any, cp: int, cp_rank: int, stage: tuple[int, int]) -> Any:
    """What the glue does for a rank: its contiguous piece of every sample (index arrays, one
    fancy-indexing copy), then its stage's layers."""
    import numpy as np

    idx = np.concatenate([np.arange(lo + (hi - lo) * cp_rank // cp,
                                    lo + (hi - lo) * (cp_rank + 1) // cp)
                          for lo, hi in zip(cu[:-1], cu[1:])])  # fmt: skip
    return batch[idx][:, stage[0]:stage[1]]


def _rank_share(batch: Any, cu: Any, cp: int, cp_rank: int, stage: tuple[int, int],
                glue: bool) -> tuple[int, int]:  # fmt: skip
    """One trainer rank in a Ray worker: its share of the batch it reads from the object store
    (a read-only view of the store's buffer, no copy); the share's bytes and the worker's peak
    above what it held before."""

    import routed_experts as rx

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _resident()
    if glue:
        share = _glue_share(batch, cu, cp, cp_rank, stage)
    else:
        share, _, _ = rx.shard(batch, cu, cp_size=cp, cp_rank=cp_rank, layers=stage)
    return int(share.nbytes), _peak_above(base)


def _through_ray(batch: Any, cu: Any, args: argparse.Namespace, glue: bool) -> dict[str, Any]:
    """The packed batch handed to the trainer's ranks as RL stacks hand samples over: put in
    Ray's object store once, each rank (a Ray task) reading only its share."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        began = time.perf_counter()
        ref = ray.put(batch)
        put = time.perf_counter() - began
        task = ray.remote(_rank_share)
        ranks = _ranks(args.cp, args.pp, batch.shape[1])
        got = ray.get([task.remote(ref, cu, args.cp, r, stage, glue) for r, stage in ranks])
        return {"seconds": time.perf_counter() - began, "put_seconds": put,
                "bytes": sum(b for b, _ in got), "rank_peak": max(p for _, p in got)}  # fmt: skip
    finally:
        ray.shutdown()


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def run_geometry(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    exe = str(Path(sys.executable).with_name("routed-experts"))
    ports = [_free_port() for _ in range(3)]
    engines = [_start([exe, "engine", "--role", role, "--port", str(port), "--model", model])
               for role, port in zip(("prefill", "decode"), ports)]  # fmt: skip
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rows = []
    try:
        for url in urls[:2]:
            _wait(url + "/health")
        for way in WAYS:
            # A proxy of its own for each way, so its peak is that way's.
            proxy = _start([exe, "proxy", "--port", str(ports[2]), "--prefill", urls[0],
                            "--decode", urls[1]])  # fmt: skip
            try:
                _wait(urls[2] + "/health")
                idle = _status_kb("VmRSS", str(proxy.pid)) * 1024
                out = subprocess.run(
                    [sys.executable, str(HERE), "--child", "--way", way, "--proxy", urls[2],
                     *_sizes(args)],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                peak = _status_kb("VmHWM", str(proxy.pid)) * 1024
            finally:
                _stop([proxy])
            if out.returncode != 0:
                raise SystemExit(f"bench-step: {model}, {way} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["model"], row["proxy_peak"], row["proxy_idle"] = model, peak, idle
            rows.append(row)
            print(_line(row, args), flush=True)
    finally:
        _stop(engines)
    return rows


def _sizes(args: argparse.Namespace) -> list[str]:
    return ["--groups", str(args.groups), "--n", str(args.n), "--prompt-tokens",
            str(args.prompt_tokens), "--generated", str(args.generated), "--cp", str(args.cp),
            "--pp", str(args.pp), *(["--ray"] if args.ray else [])]  # fmt: skip


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _line(row: dict[str, Any], args: argparse.Namespace) -> str:
    h = row["hops"]
    return (
        f"{row['model']:16} {row['way']:24} wire {_mb(h['wire']['bytes']):>8} MB "
        f"{h['wire']['seconds']:6.2f} s (fed {h['wire'].get('feed_seconds', 0):4.2f} s) | "
        f"collect {h['collect']['seconds']:5.2f} s, rollout "
        f"peak {_mb(h['collect']['peak']):>7} MB (information {_mb(row['information'])} MB) | "
        f"pack {h['pack']['seconds']:5.2f} s {_mb(h['pack']['bytes']):>8} MB | shard "
        f"x{h['shard']['ranks']} {h['shard']['seconds']:5.2f} s | step peak "
        f"{_mb(h['shard']['peak']):>8} MB | proxy peak {_mb(row['proxy_peak'])} MB ("
        f"{(row['proxy_peak'] - row['proxy_idle']) / row['information']:.2f}x the information "
        f"above its idle {_mb(row['proxy_idle'])} MB)"
        + (f" | direct x{h['direct']['ranks']} {h['direct']['seconds']:5.2f} s, peak "
           f"{_mb(h['direct']['peak'])} MB" if "direct" in h else "")
        + (f" | ray: put {h['ray']['put_seconds']:.2f} s, ranks {h['ray']['seconds']:.2f} s, "
           f"a rank's peak {_mb(h['ray']['rank_peak'])} MB" if "ray" in h else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--way", help=argparse.SUPPRESS)
    ap.add_argument("--proxy", help=argparse.SUPPRESS)
    ap.add_argument("--model", nargs="+", default=GEOMETRIES, choices=GEOMETRIES)
    ap.add_argument("--groups", type=int, default=1, help="groups (prompts) in the step")
    ap.add_argument("--n", type=int, default=16, help="choices per group (at most 16)")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--generated", type=int, default=1024, help="tokens each choice generates")
    ap.add_argument("--cp", type=int, default=2, help="context-parallel ranks")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--ray", action="store_true",
                    help="also hand the batch to the ranks through Ray's object store")
    ap.add_argument("--json", type=Path, help="write every row here")
    ap.add_argument("--plot", type=Path, help="draw the rows of --json (no run) into this PNG")
    ap.add_argument("--check", action="store_true",
                    help="fail unless the shared answer is smaller on the wire than the "
                         "engine's and the proxy's peak stays below the engine answer's size")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.plot:
        if not args.json:
            raise SystemExit("bench-step: --plot draws the rows of --json; give both")
        plot(json.loads(args.json.read_text()), args.plot)
        return
    print(f"bench-step: {args.groups} group(s) x n={args.n}, {args.prompt_tokens} prompt + "
          f"{args.generated} generated tokens, cp={args.cp} x pp={args.pp}; "
          f"CPU: {_cpu()}", flush=True)  # fmt: skip
    rows = [r for m in args.model for r in run_geometry(m, args)]
    if args.json:
        args.json.write_text(json.dumps({"sizes": _sizes(args), "cpu": _cpu(), "rows": rows},
                                        indent=1))  # fmt: skip
    if args.check:
        failures = _check(rows)
        for f in failures:
            print("bench-step: " + f)
        if failures:
            raise SystemExit(1)


def _check(rows: list[dict[str, Any]]) -> list[str]:
    """What CI holds a short round to: every way ran every hop (a failed request or read
    stops the run before this), the shared answer is smaller on the wire than the engine's and
    held by the rollout at about its rows' size, and the proxy's peak stays within its idle
    size and a few times one choice's answer (it never holds a group's answer), and within
    twice the group's rows above its idle size.
    Speed is reported, not asserted."""
    failures = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["way"]: r for r in rows if r["model"] == model}
        engine, shared = by[WAYS[0]], by[WAYS[1]]
        if shared["hops"]["wire"]["bytes"] >= engine["hops"]["wire"]["bytes"]:
            failures.append(f"{model}: the shared answer is not smaller on the wire")
        # Read as it arrives, the shared answer is held as its rows (1.0x), not as its text and
        # its rows (2.3x and more): here 1.29-1.79x, about 3 MB of it fixed (BENCHMARKS.md);
        # 1.2x and 8 MB is a generous bound that reading the whole text would fail.
        held = shared["hops"]["collect"]["peak"]
        if held > 1.2 * shared["information"] + (8 << 20):
            failures.append(f"{model}: the rollout held {_mb(held)} MB for a shared answer of "
                            f"{_mb(shared['information'])} MB of rows")
        # One choice's answer is about the prompt's rows once, which the proxy holds (as the
        # prefill body), with its idle size beside it; n choices' worth is what it never holds.
        one_choice = engine["hops"]["wire"]["bytes"] / engine["choices"]
        if engine["proxy_peak"] > (64 << 20) + 3 * one_choice:
            failures.append(f"{model}: the proxy's peak ({_mb(engine['proxy_peak'])} MB) grew "
                            f"with the group's answer")
        # Above its idle size, the proxy holds the group's rows once as text (1.33x) and its
        # own bookkeeping: 1.36-1.61x the information measured (BENCHMARKS.md); twice it, and a
        # few MB of fixed cost, is the generous bound a regression (n copies) would pass.
        for way in (engine, shared):
            held = way["proxy_peak"] - way["proxy_idle"]
            if held > 2 * way["information"] + (4 << 20):
                failures.append(f"{model}, {way['way']}: the proxy held {_mb(held)} MB above "
                                f"its idle size, over twice the group's {_mb(way['information'])} "
                                "MB of rows")
    return failures


def plot(run: dict[str, Any], out: Path) -> None:
    """Bytes on the wire, the rollout's peak and the step's seconds (collect, pack, shard) per
    geometry, each way beside the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("bytes to the rollout (MB)", lambda h: h["wire"]["bytes"] / 1e6),
        ("rollout peak memory (MB)", lambda h: h["collect"]["peak"] / 1e6),
        ("collect + pack + shard (s)",
         lambda h: h["collect"]["seconds"] + h["pack"]["seconds"] + h["shard"]["seconds"]),
    ]  # fmt: skip
    width = 0.8 / len(WAYS)
    for ax, (title, value) in zip(axes, panels):
        for k, way in enumerate(WAYS):
            ys = [next(value(r["hops"]) for r in rows if r["model"] == m and r["way"] == way)
                  for m in models]  # fmt: skip
            ax.bar([i + k * width for i in range(len(models))], ys, width, label=way)
        ax.set_title(title)
        ax.set_xticks([i + width for i in range(len(models))], models, fontsize=8)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"One GRPO step's routing ({' '.join(run['sizes'])}); {run['cpu']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
