//! The cap on decoded bytes: oversized payloads are refused before allocating. The cap is a
//! value every decoding call takes (`max_bytes`); the core keeps no process-wide state, so each
//! caller (the Python binding, a proxy, a Rust router) holds its own.

use crate::error::{Error, ErrorKind};
use crate::payload::dtype::DType;
use crate::payload::Shape;

/// 1 GiB: far above the largest real rollout (Kimi K2 at 128k tokens is 126 MB as uint16),
/// far below what would take a trainer node down.
pub const DEFAULT_MAX_BYTES: usize = 1 << 30;

/// The one bound on a declared shape: its non-zero dimensions times the item size (what it
/// claims, whatever the data length) must fit `limit`. Checked before anything that depends on
/// the shape is allocated or looped over.
pub fn check_shape(shape: Shape, dtype: DType, limit: usize) -> crate::error::Result<()> {
    match shape.declared_bytes(dtype) {
        Some(n) if n <= limit => Ok(()),
        Some(n) => Err(too_large(
            n,
            limit,
            format!(
                "`shape`: {shape} of {dtype} declares {n} bytes (non-zero dimensions times the \
                 item size), which exceeds the limit of {limit} bytes"
            ),
        )),
        // No limit holds it: saying to raise one would send the reader the wrong way.
        None => Err(crate::error::Error::malformed(format!(
            "`shape`: {shape} of {dtype} declares more than 2**64 bytes (the product of its \
             non-zero dimensions and the item size overflows): no routing is that large, so \
             the shape is wrong"
        ))),
    }
}

/// `nbytes` must fit `limit`.
pub fn check(nbytes: usize, limit: usize) -> crate::error::Result<()> {
    if nbytes > limit {
        return Err(too_large(
            nbytes,
            limit,
            format!("payload of {nbytes} decoded bytes exceeds the limit of {limit} bytes"),
        ));
    }
    Ok(())
}

/// [`ErrorKind::TooLarge`]: the message says what passed the limit; how to raise it is the
/// caller's to add (a Python setting, a command's flag).
fn too_large(bytes: usize, limit: usize, message: String) -> Error {
    let kind = ErrorKind::TooLarge {
        bytes: bytes as u64,
        limit: limit as u64,
    };
    Error::new(kind, message)
}
