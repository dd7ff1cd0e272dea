//! The process-wide cap on decoded bytes: oversized payloads are refused before allocating.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dtype::DType;
use crate::payload::Shape;

/// 1 GiB: far above the largest real rollout (Kimi K2 at 128k tokens is 126 MB as uint16),
/// far below what would take a trainer node down.
pub const DEFAULT_MAX_BYTES: usize = 1 << 30;

static MAX_BYTES: AtomicUsize = AtomicUsize::new(DEFAULT_MAX_BYTES);

/// The process-wide limit (default [`DEFAULT_MAX_BYTES`]).
pub fn max_bytes() -> usize {
    MAX_BYTES.load(Ordering::Relaxed)
}

/// Set the process-wide limit.
pub fn set_max_bytes(n: usize) {
    MAX_BYTES.store(n, Ordering::Relaxed);
}

/// The one bound on a declared shape: its non-zero dimensions times the item size (what it
/// claims, whatever the data length) must fit `limit`. Checked before anything that depends on
/// the shape is allocated or looped over.
pub fn check_shape(shape: Shape, dtype: DType, limit: usize) -> crate::Result<()> {
    match shape.declared_bytes(dtype) {
        Some(n) if n <= limit => Ok(()),
        declared => Err(crate::Error::payload(format!(
            "`shape`: {shape} of {dtype} declares {} (non-zero dimensions times the item size), \
             which exceeds the limit of {limit} bytes (raise it with \
             routed_experts.set_max_bytes or max_bytes=)",
            match declared {
                Some(n) => format!("{n} bytes"),
                None => "more than 2**64 bytes (overflows)".to_string(),
            }
        ))),
    }
}

/// `nbytes` must fit `limit`.
pub fn check(nbytes: usize, limit: usize) -> crate::Result<()> {
    if nbytes > limit {
        return Err(crate::Error::payload(format!(
            "payload of {nbytes} decoded bytes exceeds the limit of {limit} bytes \
             (raise it with routed_experts.set_max_bytes or max_bytes=)"
        )));
    }
    Ok(())
}
