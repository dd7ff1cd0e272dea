"""The `routed-experts` command: demo (default), inspect, compare, plot, merge, convert, bench,
proxy, bench-proxy."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

import routed_experts as rx
from routed_experts import RoutedExperts, RoutedExpertsError
from routed_experts._synthetic import MODELS, best_of, synthetic_rollout

# Where `routed-experts proxy` reads the upstream API key when --upstream-api-key is not given.
UPSTREAM_KEY_ENV = "ROUTED_EXPERTS_UPSTREAM_API_KEY"

def _progress(text: str) -> None:
    """A step of work that can take more than a moment, on stderr when it is a terminal (never
    in a pipe or a log, and never on stdout, which carries only results)."""
    if sys.stderr.isatty():
        print(f"routed-experts: {text}...", file=sys.stderr, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    _progress(f"making a synthetic {args.model} rollout of {args.tokens:,} tokens")
    p = synthetic_rollout(args.model, args.tokens)
    layers, top_k, experts = MODELS[args.model]
    print(
        f"rollout: {args.model} ({layers} MoE layers, top_k {top_k}, {experts} experts), "
        f"{p.num_tokens} tokens -> {p!r}, {p.nbytes / 1e6:.2f} MB decoded"
    )
    _progress("encoding, decoding and comparing it")
    wire = p.to_json()
    back = RoutedExperts.from_json(wire)
    if back != p or not np.array_equal(back.array, p.array):
        print("FAILED: decode(encode(p)) != p", file=sys.stderr)
        return 1
    _progress("timing encode and decode, 5 runs each")
    t_enc = best_of(p.to_json, 5)
    t_dec = best_of(lambda: RoutedExperts.from_json(wire), 5)
    mb = len(wire) / 1e6
    print(f"encode: {mb:.2f} MB sidecar in {t_enc * 1e3:.2f} ms ({mb / t_enc / 1e3:.2f} GB/s)")
    print(f"decode: {mb:.2f} MB sidecar in {t_dec * 1e3:.2f} ms ({mb / t_dec / 1e3:.2f} GB/s)")
    print("verified: decode(encode(rollout)) == rollout, array read-only and zero-copy")
    return 0


@contextmanager
def _in_file(path: str) -> Iterator[None]:
    """An error about a file's content names the file: a field it names is the file's, not a
    flag."""
    try:
        yield
    except RoutedExpertsError as e:
        name = "stdin" if path == "-" else path
        if str(e).startswith(f"{name}: "):
            raise  # named already
        named = type(e)(f"{name}: {e}")
        for attr in ("kind", "details", "exit_code"):  # what the exit code is read from
            if hasattr(e, attr):
                setattr(named, attr, getattr(e, attr))
        raise named from None


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def _write_output(path: str | None, data: bytes) -> None:
    if path is None or path == "-":
        sys.stdout.buffer.write(data + b"\n")
    else:
        with open(path, "wb") as f:
            f.write(data)


def _hints(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: getattr(args, k)
        for k in ("start", "num_layers", "top_k")
        if getattr(args, k) is not None
    }


def _what(path: str, data: bytes) -> tuple[str, str | None, int | None]:
    """What a file is (the core's sniffer, `rx._core._sniff`): every message about a file is
    built from its answer. Routing values, raw `.npy` files and response bodies are read; for
    anything else the error says what the file is and what to do."""
    kind, detail, generated = rx._core._sniff(data)
    name = "stdin" if path == "-" else path
    refused = {
        "empty": f"{name}: empty, no routing value or response body in it (save the server's "
                 "answer into it, or pass another file)",
        "binary": f"{name}: {detail}, not a routing value or a response body",
        "error_reply": f"{name}: the server's error reply, not a response: {detail} (fix the "
                       "request and save the answer it gets)",
        "json": f"{name}: {detail}, neither a routing value nor a response body (pass the body "
                "the server answered, or one routing value)",
        "text": f"{name}: not a routing value or a response body: {detail}",
    }
    if kind in refused:
        raise rx.PayloadError(refused[kind])
    return kind, detail, generated


def _choice(path: str, kind: str, args: argparse.Namespace) -> int | None:
    """The `--choice` to read from a file of `kind`: 0 when not given (the body says which it
    has: a choice it lacks is an error naming them); None for a routing value, which has no
    choices, and an error when `--choice` is given for one."""
    if kind == "response":
        return int(args.choice or 0)
    if getattr(args, "choice", None) is not None:
        name = "stdin" if path == "-" else path
        raise rx.PayloadError(f"{name}: --choice {args.choice}: a routing value has no "
                              "choices (--choice is for response bodies)")
    return None


def _from_npy(data: bytes, args: argparse.Namespace) -> RoutedExperts:
    """A raw `np.save` file (vLLM's rows before base64): its array, from `--start` (0)."""
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError) as e:  # a cut or malformed file
        raise rx.PayloadError(f"a .npy file numpy cannot read: {e}") from None
    return RoutedExperts.from_array(array, start=args.start or 0)


def _read_routing(path: str, data: bytes, args: argparse.Namespace,
                  kind: str, detail: str | None) -> tuple[RoutedExperts | None, str]:  # fmt: skip
    """The routing a file of `kind` holds and how it was read (for `inspect`'s format line);
    None for a response without routing."""
    choice = _choice(path, kind, args)
    with _in_file(path):
        if kind == "response":
            return rx.from_response(data, choice or 0, **_hints(args)), "response body"
        if kind == "npy":
            return _from_npy(data, args), "raw .npy (np.save)"
        return rx.decode(data, **_hints(args)), str(detail)


def cmd_inspect(args: argparse.Namespace) -> int:
    _progress(f"reading {'stdin' if args.file == '-' else args.file}")
    text = _read_input(args.file).strip()
    kind, detail, _ = _what(args.file, text)
    p, how = _read_routing(args.file, text, args, kind, detail)
    lines = [f"format: {how}"]
    if p is None and args.allow_missing:
        print("\n".join([*lines, f"choice {args.choice or 0}: no routing"]))
        return 0
    if p is None:
        raise _no_routing(f"{args.file}: the response carries no routing (ask for it: vLLM's "
                          "--enable-return-routed-experts, SGLang's return_routed_experts); "
                          "--allow-missing reports it and exits 0")
    # Printed once the file has been read whole: an error leaves nothing half-said on stdout.
    print("\n".join(lines))
    print(f"shape: {p.shape} (tokens, layers, top_k)")
    print(f"dtype: {p.dtype}")
    print(f"positions: [{p.start}, {p.stop})")
    print(f"size: {p.nbytes} bytes decoded")
    if p.num_tokens:
        arr = p.array
        print(f"values: min {int(arr.min())}, max {int(arr.max())}")
    if args.stats:
        print_load(rx.expert_load(p, _num_experts(args, p)))
    return 0


def _num_experts(args: argparse.Namespace, *payloads: RoutedExperts) -> int:
    """--num-experts, or one more than the largest id (experts never chosen past it are not
    seen, so give the model's count when it matters)."""
    if args.num_experts is not None:
        return int(args.num_experts)
    return max((int(p.array.max()) + 1 for p in payloads if p.num_tokens), default=1)


def print_load(load: rx.ExpertLoad) -> None:
    """The per-layer load table: imbalance (max over mean), coefficient of variation, and how
    many experts the layer never chose."""
    print(
        f"expert load: {load.rows} rows, {load.num_layers} layers, {load.num_experts} experts"
        f" ({load.missing_rows} rows marked missing, skipped)"
    )
    print(f"{'layer':>5}  {'imbalance':>9}  {'cv':>6}  {'never chosen':>12}")
    for layer, (imb, cv, never) in enumerate(
        zip(load.imbalance, load.cv, load.never_chosen_per_layer)
    ):
        print(f"{layer:>5}  {imb:>9.3f}  {cv:>6.3f}  {int(never):>12}")
    worst = int(np.nanargmax(load.imbalance)) if load.rows else 0
    print(f"worst layer: {worst} (imbalance {load.imbalance[worst]:.3f})")
    never = load.never_chosen.tolist()
    print(f"experts no layer chose: {len(never)}" + (f" {never[:20]}" if never else ""))


def _routing(path: str, args: argparse.Namespace) -> RoutedExperts:
    """The routing in a file: a routing value in any format, a raw `.npy`, or one choice of a
    body."""
    data = _read_input(path).strip()
    kind, detail, _ = _what(path, data)
    found, _ = _read_routing(path, data, args, kind, detail)
    if found is None:
        raise _no_routing(f"{path}: the response carries no routing (ask the server for it)")
    return found


def _no_routing(message: str) -> rx.PayloadError:
    """The error of a response without routing where routing was expected: exit code 3."""
    e = rx.PayloadError(message)
    e.exit_code = 3  # type: ignore[attr-defined]
    return e


def cmd_compare(args: argparse.Namespace) -> int:
    a, b = _routing(args.a, args), _routing(args.b, args)
    try:
        r = rx.agreement(a, b)
    except RoutedExpertsError as e:  # about the two files together: name both
        raise type(e)(f"comparing {args.a} (a) with {args.b} (b): {e}") from None
    print(f"positions compared: [{r.start}, {r.stop}), {r.compared_rows} rows "
          f"({r.excluded_rows} excluded: marked missing on a side)")
    print(f"exact match:            {r.exact_match:.4f} of routers pick the same expert set")
    print(f"overlap:                {r.overlap:.4f} of each top-{r.top_k} shared on average")
    print(f"tokens with difference: {r.tokens_with_difference:.4f} differ in at least one layer")
    print(f"differing per token:    {r.differing_per_token:.3f} of {r.num_layers} layers")
    print(f"{'layer':>5}  {'exact match':>11}  {'overlap':>7}")
    for layer, (exact, overlap) in enumerate(zip(r.exact_match_per_layer, r.overlap_per_layer)):
        print(f"{layer:>5}  {exact:>11.4f}  {overlap:>7.4f}")
    return 0


# What `plot -o` writes, by the file's suffix (matplotlib's own names for them).
PLOT_FORMATS = ("png", "pdf", "svg")


def _plot_output(path: str) -> str:
    """`plot -o`: a file whose suffix is a format it writes, in a folder that exists (checked
    before anything is read, so a mistake costs nothing)."""
    out = Path(path)
    allowed = ", ".join(f".{f}" for f in PLOT_FORMATS)
    if out.is_dir():
        raise rx.ConfigError(f"-o {path}: a folder; name the file to write ({allowed})")
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        said = f"the suffix .{suffix}" if suffix else "no suffix"
        raise rx.ConfigError(f"-o {path}: {said}; the suffix says the format: {allowed}")
    if not out.parent.is_dir():
        raise rx.ConfigError(f"-o {path}: the folder {out.parent} does not exist")
    return suffix


def cmd_plot(args: argparse.Namespace) -> int:
    _plot_output(args.output)
    try:
        from routed_experts.plot import plot_routing
    except ImportError as e:
        return _needs_extras("plot", "plot", e)
    a = _routing(args.file, args)
    b = _routing(args.other, args) if args.other else None
    payloads = [a] if b is None else [a, b]
    plot_routing(a, b, _num_experts(args, *payloads), args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    prefill, decode = _read_input(args.prefill), _read_input(args.decode)
    seen = [_what(args.prefill, prefill), _what(args.decode, decode)]
    kinds = ["a response body" if k == "response" else "a routing value" for k, _, _ in seen]
    if kinds[0] != kinds[1]:
        raise rx.MergeError(
            f"{args.prefill} is {kinds[0]} and {args.decode} is {kinds[1]}: merge two response "
            "bodies (the merged body is written) or two routing values (the merged value is)"
        )
    generated = [g for _, _, g in seen]
    if generated[0] is not None and generated[0] > 1 and generated[1] == 1:
        # A prefill half generates one token (format.md §4): these are the other way round.
        raise rx.MergeError(
            f"the inputs look swapped: {args.prefill} counts {generated[0]} generated tokens and "
            f"{args.decode} 1, as a prefill half does; run `routed-experts merge {args.decode} "
            f"{args.prefill}`"
        )
    hints = _hints(args)
    if kinds[1] == "a response body":
        if not args.allow_missing and all(d == "no routing" for _, d, _ in seen):
            raise _no_routing(f"neither {args.prefill} nor {args.decode} carries routing: the "
                              "merged body would be decode's unchanged; --allow-missing writes "
                              "it and exits 0")
        if args.decode_start is not None:
            hints["decode_start"] = args.decode_start
        out = rx.merge_response(prefill, decode, require_routing=True, **hints)
    else:
        first, _ = _read_routing(args.prefill, prefill, args, *seen[0][:2])
        if args.decode_start is not None:
            args.start = args.decode_start
        second, _ = _read_routing(args.decode, decode, args, *seen[1][:2])
        assert first is not None and second is not None  # routing values, not bodies
        merged = rx.merge(first, second)
        out = merged.to_json()
    _write_output(args.output, out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    p = _routing(args.file, args)
    value = rx.encode(p, args.to)
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    _write_output(args.output, text.encode())
    return 0


def install_hint(extras: str) -> str:
    """`pip install NAME ...` for the packages of the comma-separated `extras`, by name: the
    extras themselves (`routed_experts[proxy]`) work only once the package is on an index."""
    names: list[str] = []
    for req in importlib.metadata.requires("routed_experts") or []:
        spec, _, marker = req.partition(";")
        if set(re.findall(r"extra\s*==\s*[\"']([^\"']+)", marker)) & set(extras.split(",")):
            name = re.split(r"[<>=!~\[ ]", spec.strip(), maxsplit=1)[0]
            if name not in names:
                names.append(name)
    return "pip install " + " ".join(names)


def _needs_extras(command: str, extras: str, e: ImportError) -> int:
    print(
        f"routed-experts {command} needs the {extras} extra: {install_hint(extras)} ({e})",
        file=sys.stderr,
    )
    return 2


def cmd_proxy(args: argparse.Namespace) -> int:
    from routed_experts.proxy import ProxyConfig, serve

    settings = {name: getattr(args, name) for name in proxy_settings()}
    if args.upstreams_file is None and not (args.prefill and args.decode):
        print(
            "routed-experts proxy: give the servers as --prefill and --decode, or in "
            "--upstreams-file",
            file=sys.stderr,
        )
        return 2
    key = args.upstream_api_key or os.environ.get(UPSTREAM_KEY_ENV)
    try:
        # Rust's declaration checks the settings (a policy's name, a header's): ConfigError.
        config = ProxyConfig(**settings, upstream_api_key=key)
        serve(
            args.prefill, args.decode, args.host, args.port, config, args.log_level,
            admin_port=args.admin_port,
        )
    except (ValueError, OSError) as e:
        print(f"routed-experts proxy: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from routed_experts.stand_in_engine import StandInEngine

    try:
        engine = StandInEngine(
            args.role, args.model, args.host, args.port,
            prefill_us_per_token=args.prefill_us_per_token, cache_blocks=args.cache_blocks,
            decode_ms=args.decode_ms, uncomputed_rows=args.uncomputed_rows,
            stream_ms=args.stream_ms,
        )
    except OSError as e:
        print(f"routed-experts engine: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 2
    print(f"stand-in {args.role} engine ({args.model}) on {engine.url}", flush=True)
    try:
        engine.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _count(minimum: int) -> Any:
    """An argparse type: an integer >= `minimum`, refused with a message otherwise."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {n}")
        return n

    return parse


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _size(minimum: int) -> Any:
    """An argparse type: a byte count >= `minimum`, as an integer or with a unit (`64MiB`,
    `1.5GB`; KiB/MiB/GiB are powers of 2, KB/MB/GB of 10)."""

    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = m and _UNITS.get(m.group(2).lower())
        if m is None or unit is None:
            raise argparse.ArgumentTypeError(
                f"expected a byte count such as 67108864 or 64MiB, got {text!r}"
            )
        number = m.group(1)
        n = int(number) * unit if "." not in number else round(float(number) * unit)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum} bytes, got {text}")
        return n

    return parse


def _url(text: str) -> str:
    """An argparse type: an upstream server's URL, checked before the proxy starts."""
    from routed_experts.proxy.config import check_url

    try:
        return check_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not n > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return n


def _seconds_or_zero(text: str) -> float:
    """An argparse type: a finite number, zero or more."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= n < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number from 0 up, got {text}")
    return n


def _add_num_experts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-experts",
        type=_count(1),
        help="the model's experts (default: one more than the largest id seen)",
    )


def _add_hints(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--start", type=_count(0), help="start position, for formats that carry none"
    )
    p.add_argument("--num-layers", type=_count(1), help="layers, for SGLang flat values")
    p.add_argument("--top-k", type=_count(1), help="top_k, for SGLang flat values")
    p.add_argument(
        "--max-bytes", type=_count(1),
        help="the largest decoded payload read, in bytes (default: the library's limit, "
        "routed_experts.get_max_bytes())",
    )


# The library names its hints as Python arguments; on the command line they are flags.
# The flags that give what a format may not carry, by the field they set.
_FLAGS = {"num_layers": "--num-layers", "top_k": "--top-k", "start": "--start",
          "decode_start": "--decode-start"}


def _as_flags(message: str, args: argparse.Namespace) -> str:
    """The core's words for the hints, in the CLI's: a field contradicted by a flag's value
    names the flag; any other field is the file's and keeps its name."""
    for field, flag in _FLAGS.items():
        if getattr(args, field, None) is not None:
            message = message.replace(
                f"`{field}`: expected {getattr(args, field)} (as given)",
                f"`{field}`: expected {getattr(args, field)} (as given by {flag})",
            )
    message = message.replace("give num_layers and top_k", "give --num-layers and --top-k")
    message = message.replace("pass decode_start (--decode-start)", "pass --decode-start")
    message = message.replace("`choice`: expected", "--choice: expected")
    message = message.replace(
        "read its routing with from_response(body, choice), or merge two bodies with "
        "merge_response",
        "give the whole body to the command (--choice picks a choice), or merge two bodies")
    # The command's own way to raise the size limit, where the library names its arguments.
    for said in ("routed_experts.set_max_bytes or max_bytes=", "routed_experts.set_max_bytes"):
        message = message.replace(f"raise it with {said}", "raise it with --max-bytes")
    return message


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """Every (sub-)command's --help shows each option's default; a mistake on the command line
    is said first and in one line, then where the flags are (argparse prints the whole usage
    first: some 30 lines for `proxy`, with the error below them)."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("formatter_class", _HelpFormatter)
        super().__init__(**kw)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")


def _add_proxy_limits(p: argparse.ArgumentParser) -> None:
    """The proxy's timeouts and limits: one flag per setting Rust declares, with its default,
    bound and help from that declaration (`routed_experts_proxy::config`)."""
    from routed_experts.proxy.config import settings_declared

    for s in settings_declared():
        kind = {"seconds": _seconds, "count": _count(s.minimum), "bytes": _size(s.minimum)}
        default: Any = s.default if s.unit != "bytes" else size_text(s.default)
        p.add_argument(
            "--" + s.name.replace("_", "-"),
            type=kind[s.unit],
            default=float(default) if s.unit == "seconds" else default,
            help=s.help,
        )


def _add_proxy_choices(p: argparse.ArgumentParser) -> None:
    """The proxy's text settings but the API key (its own flag, with the environment): one
    flag each, default and help from Rust's declaration, which also checks the values (a
    policy's name, a header's) when the config is made."""
    from routed_experts._core import _proxy_choices
    from routed_experts.proxy.config import text_settings_declared

    for name, default, help_text in text_settings_declared():
        if name == "upstream_api_key":
            continue
        # A setting's names (a policy's, a format's), as Rust declares them, shown in the
        # usage and checked here too.
        choices = dict(_proxy_choices()).get(name)
        p.add_argument("--" + name.replace("_", "-"), default=default, help=help_text,
                       choices=choices)


def size_text(n: int) -> str:
    """A byte count as the flags write it: `64MiB` for whole binary units, else the number."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def proxy_settings() -> list[str]:
    """The ProxyConfig fields the proxy's flags set (all but the API key, which may come from
    the environment)."""
    from routed_experts.proxy.config import settings_declared, text_settings_declared

    text = [name for name, _, _ in text_settings_declared() if name != "upstream_api_key"]
    return [s.name for s in settings_declared()] + text


@dataclass(frozen=True)
class Arg:
    """One argument of a subcommand: `add_argument`'s flags and options."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, what it does, the function that runs it, and its arguments (an
    `arg(...)`, or a shared group such as `_add_hints`)."""

    name: str
    help: str
    func: Callable[[argparse.Namespace], int]
    args: list[Arg | Callable[[argparse.ArgumentParser], None]]


# Every subcommand, declared once: `build_parser` makes the parser from this list.
COMMANDS: list[Command] = [
    Command(
        "demo",
        "encode, decode and verify a synthetic rollout (default)",
        cmd_demo,
        [
            arg("--model", choices=sorted(MODELS), default="qwen3-30b-a3b", help="model geometry"),
            arg("--tokens", type=_count(1), default=4096, help="tokens in the rollout"),
        ],
    ),
    Command(
        "inspect",
        "print a payload's format, shape, dtype, positions, size",
        cmd_inspect,
        [
            arg("file", help="a routing value or response body file, or - for stdin"),
            arg("--choice", type=_count(0), help="choice index in a response body (default 0)"),
            arg("--stats", action="store_true", help="print per-layer expert load and imbalance"),
            arg("--allow-missing", action="store_true",
                help="a response without routing is reported and exits 0 (else exit 3)"),
            _add_num_experts,
            _add_hints,
        ],
    ),
    Command(
        "compare",
        "agreement of two routings of the same positions, overall and per layer",
        cmd_compare,
        [
            arg("a", help="a routing value or response body file (e.g. the rollout's)"),
            arg("b", help="the other (e.g. the trainer's recompute)"),
            arg("--choice", type=_count(0), help="choice in response bodies (default 0)"),
            _add_hints,
        ],
    ),
    Command(
        "plot",
        "draw expert load (layers x experts) and, given two, agreement per layer "
        "(needs matplotlib)",
        cmd_plot,
        [
            arg("file", help="a routing value or response body file"),
            arg("other", nargs="?", help="a second routing of the same positions"),
            arg("-o", "--output", required=True, help="the PNG (or PDF, SVG) to write"),
            arg("--choice", type=_count(0), help="choice in response bodies (default 0)"),
            _add_num_experts,
            _add_hints,
        ],
    ),
    Command(
        "merge",
        "merge prefill and decode routing (sidecars or response bodies)",
        cmd_merge,
        [
            arg("prefill", help="prefill sidecar or response body file, or - for stdin"),
            arg("decode", help="decode sidecar or response body file"),
            arg("-o", "--output", help="output file (default: stdout)"),
            arg("--allow-missing", action="store_true",
                help="bodies without routing are merged as they are (decode's body written "
                "unchanged) and exit 0 (else exit 3)"),
            arg("--decode-start", type=_count(0),
                help="where decode's rows start (vLLM's P/D: the prompt's length - 1); default: "
                "--start, else derived from the decode body's token counts (format.md §4)"),
            _add_hints,
        ],
    ),
    Command(
        "convert",
        "convert a routing value to another format",
        cmd_convert,
        [
            arg("file", help="a routing value or response body file, or - for stdin"),
            arg(
                "--to",
                required=True,
                choices=rx.FORMATS,
                help="the format to write",
            ),
            arg("--choice", type=_count(0), help="choice in a response body (default 0)"),
            arg("-o", "--output", help="output file (default: stdout)"),
            _add_hints,
        ],
    ),
    Command(
        "proxy",
        "P/D proxy that merges routed experts",
        cmd_proxy,
        [
            arg(
                "--prefill",
                nargs="+",
                action="extend",
                default=[],
                type=_url,
                help="prefill server URL(s): several after one flag, or the flag repeated (or "
                     "--upstreams-file)",
            ),
            arg(
                "--decode",
                nargs="+",
                action="extend",
                default=[],
                type=_url,
                help="decode server URL(s): several after one flag, or the flag repeated",
            ),
            arg("--host", default="127.0.0.1", help="address to listen on"),
            arg(
                "--port",
                type=_count(0),
                default=8000,
                help="port to listen on (0: a free one, logged)",
            ),
            _add_proxy_limits,
            _add_proxy_choices,
            arg(
                "--admin-port",
                type=_count(1),
                help="serve /health and /metrics on this port only (default: on --port)",
            ),
            arg(
                "--upstream-api-key",
                help="API key sent to the servers instead of the client's Authorization (or "
                     "ROUTED_EXPERTS_UPSTREAM_API_KEY)",
            ),
            arg(
                "--log-level",
                default="info",
                choices=["debug", "info", "warning", "error"],
                help="info logs one line per request",
            ),
        ],
    ),
    Command(
        "engine",
        "a stand-in prefill or decode engine (vLLM's P/D protocol, synthetic routing; no "
        "GPU) to try the proxy with",
        cmd_engine,
        [
            arg("--role", required=True, choices=["prefill", "decode"],
                help="which half of vLLM's P/D protocol it answers: prefill (the prompt's "
                     "routing, and the KV parameters decode needs) or decode (the rest)"),
            arg("--host", default="127.0.0.1", help="address to listen on"),
            arg(
                "--port",
                type=_count(0),
                default=8100,
                help="port to listen on (0: a free one, printed)",
            ),
            arg(
                "--model",
                choices=sorted(MODELS),
                default="qwen3-30b-a3b",
                help="routing geometry",
            ),
            arg(
                "--prefill-us-per-token",
                type=_seconds_or_zero,
                default=0.0,
                help="prefill: microseconds of compute per prompt token not in the prefix cache "
                     "(one prompt at a time)",
            ),
            arg(
                "--cache-blocks",
                type=_count(0),
                default=0,
                help="prefill: a prefix cache of this many 16-token blocks (LRU; 0: none)",
            ),
            arg(
                "--decode-ms",
                type=_seconds_or_zero,
                default=0.0,
                help="decode: milliseconds each request takes",
            ),
            arg(
                "--stream-ms",
                type=_seconds_or_zero,
                default=0.0,
                help="milliseconds between a stream's events (0: all at once); stop the engine "
                     "mid-stream to see what the proxy's client then gets",
            ),
            arg(
                "--uncomputed-rows",
                choices=("error", "zeros"),
                default="error",
                help="decode asked for routing of prompt positions whose KV it received: answer "
                     "500 (error, where vLLM 0.32 dies) or send those rows zeroed (zeros, as vLLM "
                     "before 0.32)",
            ),
        ],
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="routed-experts", description="MoE routed-experts payload tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {rx.__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        for a in command.args:
            if isinstance(a, Arg):
                p.add_argument(*a.flags, **a.options)
            else:
                a(p)
        p.set_defaults(func=command.func)
    return parser


# The benchmarks are not in the installed package: from a clone, make runs them.
MOVED = {"bench": "make bench-table (or bench-quality)", "bench-proxy": "make bench-proxy"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MOVED:
        print(f"routed-experts {argv[0]}: the benchmarks are not part of the installed package; "
              f"in a clone of the repository run `{MOVED[argv[0]]}` (PYTHONPATH=benches python "
              f"-m rx_bench {argv[0]} ...; docs/development.md)", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])
    try:
        if getattr(args, "max_bytes", None) is not None:
            rx.set_max_bytes(args.max_bytes)
        rc = int(args.func(args))
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # The reader left (`inspect ... | head`): end quietly, and let nothing more be written
        # to the closed pipe at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (RoutedExpertsError, OSError) as e:
        print(f"routed-experts: {type(e).__name__}: {_as_flags(str(e), args)}", file=sys.stderr)
        return _exit_code(e)


def _exit_code(e: BaseException) -> int:
    """The command's exit codes, the same as `cargo run --example merge`'s (README, "The
    command"): 1 parts that do not fit together (MergeError), 2 malformed input, a bad argument
    or an unreadable file, 3 no routing where routing was expected."""
    if getattr(e, "exit_code", None) == 3 or getattr(e, "kind", None) == "missing_routing":
        return 3
    return 1 if isinstance(e, rx.MergeError) else 2


if __name__ == "__main__":
    sys.exit(main())
