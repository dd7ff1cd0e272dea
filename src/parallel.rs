//! Splitting one pass over token rows across the machine's cores (scoped threads, no pool):
//! the statistics are sums, so each part counts its rows and the parts are added up.

use std::ops::Range;

/// Below this many input bytes per thread, a thread costs more than it saves.
const MIN_BYTES_PER_THREAD: usize = 4 << 20;
/// More threads than this only contend for memory bandwidth.
const MAX_THREADS: usize = 8;

/// `f` over contiguous parts of `0..rows`, in order, run on up to as many threads as the
/// machine has cores (one, on this thread, for small inputs). `bytes` is the input size that
/// decides how many parts are worth it.
pub(crate) fn over_rows<R: Send>(
    rows: usize,
    bytes: usize,
    f: impl Fn(Range<usize>) -> R + Sync,
) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let parts = cores
        .min(MAX_THREADS)
        .min(bytes / MIN_BYTES_PER_THREAD)
        .min(rows)
        .max(1);
    if parts == 1 {
        return vec![f(0..rows)];
    }
    let per = rows.div_ceil(parts);
    let ranges: Vec<Range<usize>> = (0..parts)
        .map(|i| (i * per).min(rows)..((i + 1) * per).min(rows))
        .collect();
    std::thread::scope(|s| {
        let f = &f;
        let (first, rest) = ranges.split_first().expect("parts >= 2");
        // A thread that cannot be started (a process at its thread limit) leaves its part to
        // this thread: slower, never an error.
        let handles: Vec<_> = rest
            .iter()
            .map(|r| {
                let spawned = std::thread::Builder::new().spawn_scoped(s, move || f(r.clone()));
                spawned.map_err(|_| r.clone())
            })
            .collect();
        let mut out = vec![f(first.clone())];
        for handle in handles {
            out.push(match handle {
                // A panic in a part is re-raised here, as it would be without threads.
                Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                Err(range) => f(range),
            });
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_row_once_in_order() {
        for rows in [0, 1, 2, 3, 7, 1000] {
            for bytes in [0, MIN_BYTES_PER_THREAD * 3, usize::MAX] {
                let parts = over_rows(rows, bytes, |r| r);
                let flat: Vec<usize> = parts.iter().flat_map(|r| r.clone()).collect();
                assert_eq!(
                    flat,
                    (0..rows).collect::<Vec<_>>(),
                    "rows {rows} bytes {bytes}"
                );
            }
        }
    }
}
