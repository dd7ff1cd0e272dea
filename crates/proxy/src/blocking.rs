//! Large work on a runtime thread: the runtime is told the thread blocks, so other connections
//! move to the other workers meanwhile.

/// Bodies at least this large are read or merged with the runtime told the thread blocks
/// (`block_in_place`).
pub(crate) const BLOCKING_BYTES: usize = 8 << 20;

/// Run `f` telling the runtime this thread blocks, when the work is large.
pub(crate) fn blocking_if<T>(large: bool, f: impl FnOnce() -> T) -> T {
    if large {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}
