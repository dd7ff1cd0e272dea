//! Merge the routing of a prefill and a decode response body, as a Rust router would:
//!
//! ```text
//! cargo run --example merge -- PREFILL.json DECODE.json [--decode-start N] [--allow-missing] > merged.json
//! ```
//!
//! The merged body is the decode body with each choice's routing replaced by the merge with the
//! prefill routing of the same choice; every other byte is unchanged. Where decode's rows start
//! (vLLM's P/D: the prompt's length - 1) is derived from the decode body's token counts
//! (format.md §4) unless `--decode-start` says. Errors go to stderr; the exit codes are the
//! `routed-experts` command's: 1 halves that do not fit together, 2 a malformed body or a bad
//! argument, 3 no routing where routing was expected (`--allow-missing`: neither body carries
//! any, and decode's is written unchanged).

use std::io::Write;
use std::process::ExitCode;

use routed_experts::{merge_response, read_body, ErrorKind, MergeOptions, DEFAULT_MAX_BYTES};

/// The command line: two files, then the flags in any order.
struct Args {
    prefill: String,
    decode: String,
    decode_start: Option<u64>,
    allow_missing: bool,
}

fn parse(args: &[String]) -> Option<Args> {
    let [prefill, decode, flags @ ..] = args else {
        return None;
    };
    let mut out = Args {
        prefill: prefill.clone(),
        decode: decode.clone(),
        decode_start: None,
        allow_missing: false,
    };
    let mut flags = flags.iter();
    while let Some(flag) = flags.next() {
        match flag.as_str() {
            "--allow-missing" => out.allow_missing = true,
            "--decode-start" => out.decode_start = Some(flags.next()?.parse().ok()?),
            _ => return None,
        }
    }
    Some(out)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(Args {
        prefill,
        decode,
        decode_start,
        allow_missing,
    }) = parse(&args)
    else {
        eprintln!(
            "usage: merge PREFILL_BODY DECODE_BODY [--decode-start N] [--allow-missing] (files; \
             the merged body goes to stdout)"
        );
        return ExitCode::from(2);
    };
    let read = |path: &str| {
        std::fs::read(path).map_err(|e| {
            eprintln!("merge: cannot read {path}: {e}");
            ExitCode::from(2)
        })
    };
    let (prefill, decode) = match (read(&prefill), read(&decode)) {
        (Ok(p), Ok(d)) => (p, d),
        (Err(code), _) | (_, Err(code)) => return code,
    };
    let opts = MergeOptions {
        decode_start,
        require_routing: true,
        ..MergeOptions::new(DEFAULT_MAX_BYTES)
    };
    // Neither body carries routing: decode's would come back unchanged.
    let routed = |body: &[u8]| read_body(body).is_ok_and(|r| !r.is_empty());
    if !allow_missing && !routed(&prefill) && !routed(&decode) {
        eprintln!(
            "merge: neither body carries routing: the merged body would be decode's unchanged \
             (--allow-missing writes it)"
        );
        return ExitCode::from(3);
    }
    match merge_response(&prefill, &decode, opts) {
        Ok(merged) => {
            let mut out = std::io::stdout().lock();
            match out.write_all(&merged).and_then(|()| out.write_all(b"\n")) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("merge: cannot write the merged body: {e}");
                    ExitCode::from(2)
                }
            }
        }
        // The kind says which rule was broken; the message names the values.
        Err(e) if matches!(e.kind(), ErrorKind::MissingRouting(_)) => {
            eprintln!("merge: {e}");
            ExitCode::from(3)
        }
        Err(e) if matches!(e.kind(), ErrorKind::Gap { .. }) => {
            eprintln!("merge: rows missing between the halves: {e}");
            ExitCode::from(1)
        }
        Err(e) if !e.kind().is_malformed_input() => {
            eprintln!("merge: inconsistent halves: {e}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("merge: malformed input: {e}");
            ExitCode::from(2)
        }
    }
}
