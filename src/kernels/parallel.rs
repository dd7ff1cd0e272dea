//! Splitting one pass across the machine's cores (scoped threads, no pool): over token rows,
//! where the statistics are sums (each part counts its rows and the parts are added up), and
//! over an input and the output it maps to part for part (base64 text and bytes).

use std::ops::Range;
use std::sync::{Mutex, OnceLock};

/// Below this many input bytes per thread, a thread costs more than it saves.
#[cfg(not(any(test, fuzzing)))]
const MIN_BYTES_PER_THREAD: usize = 4 << 20;
/// The tests and the fuzzer split small inputs, so that they go through the threads' code too.
#[cfg(any(test, fuzzing))]
const MIN_BYTES_PER_THREAD: usize = 16;
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
    let parts = threads_for(bytes).min(rows).max(1);
    let per = rows.div_ceil(parts);
    let ranges: Vec<Range<usize>> = (0..parts)
        .map(|i| (i * per).min(rows)..((i + 1) * per).min(rows))
        .collect();
    each(ranges, f)
}

/// How many threads `bytes` of input are worth, at least 1.
pub(crate) fn threads_for(bytes: usize) -> usize {
    let worth = bytes / MIN_BYTES_PER_THREAD;
    if worth < 2 {
        return 1;
    }
    cores().min(MAX_THREADS).min(worth)
}

/// The cores this process may use, read once. `available_parallelism` reads the cgroup quota
/// files on every call (opens, stats and reads under /sys and /proc): called per decode, that
/// was a fifth of the proxy's CPU under load (issue 39). A quota changed while the process
/// runs is not seen; a process started under it is.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// `f` over matching parts of `input` and `out`, on as many threads as `input` is worth: parts
/// hold whole units, `unit.0` elements of input to `unit.1` of output, and `f` is told which
/// part is the last (the only one that may be short). `true` when `f` is for every part;
/// `false`, calling nothing, when the two lengths do not split into the same number of parts.
pub(crate) fn over_pairs<T: Sync, U: Send>(
    input: &[T],
    out: &mut [U],
    unit: (usize, usize),
    f: impl Fn(bool, &[T], &mut [U]) -> bool + Sync,
) -> bool {
    let units = input
        .len()
        .div_ceil(threads_for(std::mem::size_of_val(input)))
        .div_ceil(unit.0)
        .max(1);
    let (per_in, per_out) = (units * unit.0, units * unit.1);
    let parts = input.len().div_ceil(per_in);
    if out.len().div_ceil(per_out) != parts {
        return false;
    }
    let numbered: Vec<_> = input
        .chunks(per_in)
        .zip(out.chunks_mut(per_out))
        .enumerate()
        .collect();
    each(numbered, |(i, (a, b))| f(i + 1 == parts, a, b))
        .into_iter()
        .all(|ok| ok)
}

/// `f` of each item, each on its own thread (the first on this one), results in order.
pub(crate) fn each<I: Send, R: Send>(items: Vec<I>, f: impl Fn(I) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    // Each item waits in a slot its thread takes it from: a thread that cannot be started (a
    // process at its thread limit) leaves its item there for this thread (slower, never an
    // error), since a failed spawn drops the closure and anything moved into it.
    let slots: Vec<Mutex<Option<I>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let take = |slot: &Mutex<Option<I>>| slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    std::thread::scope(|s| {
        let (f, take) = (&f, &take);
        let handles: Vec<_> = slots[1..]
            .iter()
            .map(|slot| {
                std::thread::Builder::new()
                    .spawn_scoped(s, move || take(slot).map(f))
                    .ok()
            })
            .collect();
        let mut out = Vec::with_capacity(slots.len());
        out.extend(take(&slots[0]).map(f));
        for (handle, slot) in handles.into_iter().zip(&slots[1..]) {
            // A panic in a part is re-raised here, as it would be without threads.
            let done =
                handle.and_then(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            out.extend(done.or_else(|| take(slot).map(f)));
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
