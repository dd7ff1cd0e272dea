//! Replays every checked-in seed (fuzz/seeds/) and every input a fuzzer ever crashed on
//! (fuzz/regressions/) through the fuzz targets' bodies, under `cargo test`.

#[path = "harness.rs"]
mod harness;

use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) {
    // Run as a test of crates/proxy, where the core and the proxy are both dependencies.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut count = 0;
    for kind in ["seeds", "regressions"] {
        let Ok(dir) = std::fs::read_dir(root.join(kind).join(target)) else {
            continue;
        };
        for entry in dir {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(outcome.is_ok(), "{target}: {} panics", path.display());
            count += 1;
        }
    }
    assert!(count > 0, "{target}: no seeds found");
}

/// One `#[test]` per fuzz target, named after it.
macro_rules! replay_targets {
    ($($target:ident),*) => {$(
        #[test]
        fn $target() {
            replay(stringify!($target), harness::$target);
        }
    )*};
}

replay_targets!(
    sidecar,
    formats,
    response,
    merge_response,
    stream_merge,
    npy_header,
    trajectory,
    quality,
    proxy,
    upstream_reply
);
