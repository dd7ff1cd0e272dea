//! Merge the routing of a prefill and a decode response body, as a Rust router would:
//!
//! ```text
//! cargo run --example merge -- PREFILL.json DECODE.json > merged.json
//! ```
//!
//! The merged body is the decode body with each choice's routing replaced by the merge with the
//! prefill routing of the same choice; every other byte is unchanged. Errors go to stderr with
//! exit code 2 (a malformed body) or 1 (inconsistent halves).

use std::io::Write;
use std::process::ExitCode;

use routed_experts::{merge_response, ErrorKind, MergeOptions, DEFAULT_MAX_BYTES};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [prefill, decode] = &args[..] else {
        eprintln!("usage: merge PREFILL_BODY DECODE_BODY (files; the merged body goes to stdout)");
        return ExitCode::from(2);
    };
    let read = |path: &str| {
        std::fs::read(path).map_err(|e| {
            eprintln!("merge: cannot read {path}: {e}");
            ExitCode::from(2)
        })
    };
    let (prefill, decode) = match (read(prefill), read(decode)) {
        (Ok(p), Ok(d)) => (p, d),
        (Err(code), _) | (_, Err(code)) => return code,
    };
    match merge_response(&prefill, &decode, MergeOptions::new(DEFAULT_MAX_BYTES)) {
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
