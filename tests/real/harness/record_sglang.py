"""Record what a real SGLang release sends: `/generate`, `/v1/completions` and
`/v1/chat/completions`, each body byte for byte beside the truth (the same model's own routing,
from transformers).

    python record_sglang.py RELEASE OUT_DIR        (in that release's engine environment)

Writes OUT_DIR/manifest.json (as record.py writes vLLM's: the release, the environment, the
model, and for each case its request, status, body file and truth) and one file per body
(`.json` for a JSON reply, `.sse` for an event stream), exactly as the server sent it. Servers:
one for an 8-expert model, one for a 288-expert model (ids above 255), both with no dense
layer (SGLang's qwen3_moe ignores `mlp_only_layers`: a dense layer would run as a MoE one).

The OpenAI endpoints return no token ids: a case's sequence is its prompt as the server's
tokenizer (and chat template) makes it, then the tokens a greedy `/generate` of the same ids
returns (its `twin`, checked to give the same text and counts).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402
import sglang_engine  # noqa: E402
import tiny_model  # noqa: E402

SHORT = record.SHORT
LONG = record.LONG
DENSE: list[int] = []  # no dense layer (see the docstring)
GEN, COMP, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"


def alive_after(server: Any) -> bool:
    """Whether the server still serves after a request: its process lives (SGLang takes its
    whole process tree down when a scheduler dies) and `/health` answers 200. SGLang's
    `/health` may run a one-token generation through the scheduler, which on two busy cores
    can take longer than vLLM's few seconds: it is given a minute."""
    if not server.alive():
        HEALTH["after"] = "the server process had exited"
        return False
    try:
        with record.engine.urllib.request.urlopen(server.url + "/health", timeout=60) as r:
            ok = r.status == 200
            HEALTH["after"] = f"/health {r.status}"
    except record.engine.urllib.error.HTTPError as e:
        ok = False
        HEALTH["after"] = f"/health {e.code} {e.read()[:200].decode(errors='replace')}"
    except (record.engine.urllib.error.URLError, OSError) as e:
        ok = False
        HEALTH["after"] = f"/health did not answer: {e!r}"
    if ok and not server.alive():
        HEALTH["after"] = "the server process exited"
    return ok and server.alive()


HEALTH: dict[str, str] = {}


record.alive_after = alive_after  # the recorder's check, for SGLang


class Recorder(record.Recorder):
    def __init__(self, release: str, out: Path, models: Path, model_dirs: dict[str, Path]):
        super().__init__(release, out, models)
        from transformers import AutoTokenizer

        self.tok = {k: AutoTokenizer.from_pretrained(str(v)) for k, v in model_dirs.items()}

    def prompt_ids(self, model: str, request: dict, endpoint: str) -> list[int]:
        tok = self.tok[model]
        if endpoint == CHAT:
            ids = tok.apply_chat_template(
                request["messages"], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        prompt = request.get("prompt", request.get("text"))
        if isinstance(prompt, list):
            return list(prompt)
        return list(tok(prompt, add_special_tokens=True)["input_ids"])


def body_json(r: Recorder, rec: dict) -> Any:
    return json.loads((r.out / rec["body"]).read_text())


def sse_events(r: Recorder, rec: dict) -> list[Any]:
    out = []
    for line in (r.out / rec["body"]).read_text().splitlines():
        if line.startswith("data: ") and line.strip() != "data: [DONE]":
            try:
                out.append(json.loads(line[6:]))
            except ValueError:
                pass
    return out


def generate_output_ids(r: Recorder, rec: dict) -> list[list[int]]:
    """Each result's output ids from a /generate body (one result or a list) or stream (the
    last event of each index: SGLang's stream repeats the ids so far, unless incremental)."""
    if rec["status"] != 200:
        return []
    if rec["body"].endswith(".sse"):
        last: dict[int, dict] = {}
        for ev in sse_events(r, rec):
            last[int(ev.get("index", 0))] = ev
        return [list(last[i].get("output_ids") or []) for i in sorted(last)]
    doc = body_json(r, rec)
    results = doc if isinstance(doc, list) else [doc]
    return [list(x.get("output_ids") or []) for x in results]


def record_cases(r: Recorder, server: Any, model: str) -> None:
    tag = model
    flag = {"return_routed_experts": True}

    def one(
        name: str,
        endpoint: str,
        request: dict,
        notes: str = "",
        seqs: Any = None,
    ) -> dict | None:
        try:
            rec = r.call(server, f"{tag}-{name}", endpoint, request)
        except record.Absent:
            return None
        if rec.get("restarted_after"):
            # The server failed its health check after this request (see `health_after`):
            # the recorder restarted it for the cases after.
            rec["health_after"] = HEALTH.get("after", "")
            notes = (notes + "; " if notes else "") + (
                "after this request the server failed its health check and was restarted"
            )
        c = r.case(f"{tag}-{name}", model, notes, reply=rec)
        c["sequences"] = seqs(rec) if (seqs and rec["status"] == 200) else []
        return c

    def from_generate(prompts: list[list[int]]) -> Any:
        def seqs(rec: dict) -> list[list[int]]:
            outs = generate_output_ids(r, rec)
            if len(prompts) == 1:
                return [prompts[0] + o for o in outs]
            return [p + o for p, o in zip(prompts, outs)]

        return seqs

    def from_twin(endpoint: str, request: dict) -> Any:
        """The prompt as the server tokenizes it, then a greedy /generate's tokens (checked
        against the body's counts and text)."""

        def seqs(rec: dict) -> list[list[int]]:
            ids = r.prompt_ids(model, request, endpoint)
            sp = {"max_new_tokens": request["max_tokens"], "temperature": 0}
            if "stop" in request:
                sp["stop"] = request["stop"]
            st, raw, _ = sglang_engine.post(
                server.url + GEN, {"input_ids": ids, "sampling_params": sp}
            )
            twin = json.loads(raw)
            out = list(twin["output_ids"])
            # `one` has just added the case this reply belongs to.
            r.cases[-1]["twin"] = {
                "request": {"input_ids": ids, "sampling_params": sp}, "status": st,
                "output_ids": out, "text": twin.get("text"),
                "meta_info": {k: twin["meta_info"].get(k) for k in
                              ("prompt_tokens", "completion_tokens", "finish_reason")},
            }  # fmt: skip
            n = 1
            if rec["body"].endswith(".json"):
                n = len(body_json(r, rec).get("choices") or [None])
            return [ids + out for _ in range(n)]

        return seqs

    # -- /generate: ids in, ids out ----------------------------------------------------------
    ids = r.prompt_ids(model, {"prompt": SHORT}, COMP)
    long_ids = r.prompt_ids(model, {"prompt": LONG}, COMP)
    sp = {"max_new_tokens": 5, "temperature": 0}
    one("generate", GEN, {"input_ids": ids, "sampling_params": sp, **flag},
        seqs=from_generate([ids]))  # fmt: skip
    if model == "e8":
        one(
            "generate-start",
            GEN,
            {"input_ids": long_ids, "sampling_params": sp, **flag, "routed_experts_start_len": 40},
            notes="routed_experts_start_len 40: rows from the requested start",
            seqs=from_generate([long_ids]),
        )
        one(
            "generate-stream",
            GEN,
            {"input_ids": ids, "sampling_params": sp, **flag, "stream": True},
            seqs=from_generate([ids]),
        )
        other = r.prompt_ids(model, {"prompt": "merge rollout trainer replay"}, COMP)
        one(
            "generate-batch",
            GEN,
            {"input_ids": [ids, other], "sampling_params": sp, **flag},
            notes="two prompts in one request: a list of results",
            seqs=from_generate([ids, other]),
        )
        one(
            "generate-n2",
            GEN,
            {"input_ids": ids, "sampling_params": {**sp, "n": 2, "temperature": 1.0}, **flag},
            notes="parallel sampling (n=2): a list of results",
            seqs=from_generate([ids]),
        )
        miss_ids = r.prompt_ids(model, {"prompt": LONG + " cache"}, COMP)
        one("cache-miss", GEN, {"input_ids": miss_ids, "sampling_params": sp, **flag},
            seqs=from_generate([miss_ids]))  # fmt: skip
        one(
            "cache-hit",
            GEN,
            {"input_ids": miss_ids, "sampling_params": sp, **flag},
            notes="the same prompt again: its prefix from the radix cache (cached_tokens)",
            seqs=from_generate([miss_ids]),
        )
    # -- /v1/completions -----------------------------------------------------------------------
    base = {"model": "tiny", "temperature": 0, **flag}
    req = {**base, "prompt": SHORT, "max_tokens": 6}
    one("completions", COMP, req, seqs=from_twin(COMP, req))
    if model != "e8":
        return
    req = {**base, "prompt": LONG, "max_tokens": 4, "routed_experts_start_len": 40}
    one("completions-start", COMP, req, notes="routed_experts_start_len 40",
        seqs=from_twin(COMP, req))  # fmt: skip
    req = {**base, "prompt": SHORT, "max_tokens": 6, "n": 2}
    one("completions-n2", COMP, req, notes="n=2, greedy: both choices the same sequence",
        seqs=from_twin(COMP, req))  # fmt: skip
    probe = json.loads(
        sglang_engine.post(server.url + COMP, {**base, "prompt": SHORT, "max_tokens": 8})[1]
    )
    text = probe["choices"][0]["text"]
    stop = next(
        (text[i] for i in range(2, len(text)) if text[i] not in text[:i] and text[i].strip()), None
    )
    if stop is not None:
        req = {**base, "prompt": SHORT, "max_tokens": 8, "stop": [stop]}
        one("completions-stop", COMP, req, notes=f"stopped by the string {stop!r}",
            seqs=from_twin(COMP, req))  # fmt: skip
    req = {**base, "prompt": SHORT, "max_tokens": 5, "stream": True,
           "stream_options": {"include_usage": True}}  # fmt: skip
    one("completions-stream", COMP, req, seqs=from_twin(COMP, req))
    # -- /v1/chat/completions ------------------------------------------------------------------
    msgs = [{"role": "user", "content": SHORT}]
    req = {**base, "messages": msgs, "max_tokens": 5}
    c = one("chat", CHAT, req, seqs=from_twin(CHAT, req))
    req = {**base, "messages": msgs, "max_tokens": 5, "return_meta_info": True}
    one("chat-meta", CHAT, req, notes="return_meta_info: the choice's meta_info too",
        seqs=from_twin(CHAT, req))  # fmt: skip
    req = {**base, "messages": msgs, "max_tokens": 4, "stream": True}
    one("chat-stream", CHAT, req, seqs=from_twin(CHAT, req))
    if c is not None and c["reply"]["status"] == 200:
        first = body_json(r, c["reply"])
        answer = first["choices"][0]["message"]["content"]
        p1 = first["usage"]["prompt_tokens"]
        turn2 = [*msgs, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "merge rollout trainer replay"}]  # fmt: skip
        req = {**base, "messages": turn2, "max_tokens": 5, "routed_experts_start_len": p1}
        one("chat-turn2", CHAT, req,
            notes="the second turn, routing from the first turn's prompt length",
            seqs=from_twin(CHAT, req))  # fmt: skip


def environment() -> dict[str, Any]:
    names = ["sglang", "torch", "transformers", "tokenizers", "sglang-kernel", "sgl-kernel"]
    versions = {}
    for n in names:
        try:
            versions[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            versions[n] = None
    env = record.environment(Path(sys.executable))
    env["packages"] = versions
    return env


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("release")
    a.add_argument("out", type=Path)
    a.add_argument("--work", type=Path, default=None, help="models and logs (a temporary folder)")
    a.add_argument("--only", choices=["e8", "e288"], default=None)
    args = a.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rx-record-sglang-"))
    models = {
        "e8": tiny_model.make(work / "tiny-e8-nodense", experts=8, dense=DENSE),
        "e288": tiny_model.make(work / "tiny-e288-nodense", experts=288, dense=DENSE),
    }
    if args.only:
        models = {args.only: models[args.only]}
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    r = Recorder(args.release, args.out, work, models)
    py = Path(sys.executable)
    started: dict[str, float] = {}
    for name, path in models.items():
        t0 = record.engine.time.monotonic()
        with sglang_engine.Server(py, args.release, path, work / f"logs/{name}.log") as s:
            started[name] = round(record.engine.time.monotonic() - t0, 1)
            record_cases(r, s, name)
    r.add_truth(models)
    manifest = {
        "hook": sglang_engine.hook_note(args.release),
        "hook_parts": sglang_engine.hooks(args.release),
        "release": args.release,
        "recorded_with": environment(),
        "serve_env": {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"},
        "serve_flags": sglang_engine.SERVE_FLAGS,
        "server_start_seconds": started,
        "model": {
            "layers": tiny_model.LAYERS,
            "dense_layers": DENSE,
            "top_k": tiny_model.TOP_K,
            "experts": {"e8": 8, "e288": 288},
        },
        "cases": r.cases,
    }
    if r.absent:
        manifest["absent"] = r.absent
    (args.out / "manifest.json").write_text(record.manifest_text(manifest))
    print(f"recorded {len(r.cases)} cases into {args.out}")


if __name__ == "__main__":
    main()
