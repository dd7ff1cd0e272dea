//! What every producer's file declares and needs, with nothing of the registry (`PRODUCERS`):
//! a leaf, so the producers' files and the registry in `mod.rs` do not import each other.

use super::places::{Place, Rule};
use crate::error::{Error, Result};
use crate::payload::dtype::DType;
use crate::payload::{Header, Payload};

/// What the caller knows that a format may not carry. A hint that contradicts what the payload
/// does carry is an error, never silently preferred.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    /// The position of row 0, for formats that carry none.
    pub start: Option<u64>,
    /// Layers, for SGLang's flat values (checked against formats that carry them).
    pub num_layers: Option<usize>,
    /// top_k, for SGLang's flat values (checked against formats that carry them).
    pub top_k: Option<usize>,
    /// The element type, for SGLang's flat values (int32 if not given).
    pub dtype: Option<DType>,
}

/// What a producer's format is, declared in its own file (`formats/<name>.rs`).
pub(crate) struct Producer {
    /// Its name (`Format::name`, `Format::parse`).
    pub name: &'static str,
    /// Its name in messages ("vLLM's .npy").
    pub described: &'static str,
    /// Whether a text is in this format. No two producers claim the same text, except that a
    /// `last_resort` one is asked only when no other claims it (tested).
    pub detects: fn(&[u8]) -> bool,
    /// Its detection reads what others' also fit (SGLang's bare base64 also reads a `.npy`).
    pub last_resort: bool,
    /// The text (the content of a JSON string, for the string formats) to a payload.
    pub decode: fn(&[u8], &Hints, usize) -> Result<Payload>,
    /// A payload to the text its producer emits.
    pub encode: fn(&Payload) -> Result<Vec<u8>>,
    /// It travels as a JSON string (else as a JSON object or array).
    pub json_string: bool,
    /// The places its producers write it at (format.md §3.2).
    pub writes_at: &'static [Place],
    /// The rows it covers at a place (format.md §3.3).
    pub rule: fn(Place) -> Rule,
    /// Which releases send rows from position 0 when asked for a later start, named when a
    /// body's rows say so (format.md §3.5).
    pub ignores_start: Option<&'static str>,
}

/// A hint that contradicts what the payload carries is an error, never silently preferred.
pub(crate) fn check_named(name: &str, h: &Header, hints: &Hints) -> Result<()> {
    let mismatch = |field: &str, given: String, found: String| {
        Err(Error::field(
            field,
            format!("{given} (as given)"),
            format!("{found} in the {name} payload"),
        ))
    };
    if let Some(l) = hints.num_layers.filter(|&l| l != h.shape.layers) {
        return mismatch("num_layers", l.to_string(), h.shape.layers.to_string());
    }
    if let Some(k) = hints.top_k.filter(|&k| k != h.shape.top_k) {
        return mismatch("top_k", k.to_string(), h.shape.top_k.to_string());
    }
    if let Some(d) = hints.dtype.filter(|&d| d != h.dtype) {
        return mismatch("dtype", d.to_string(), h.dtype.to_string());
    }
    if let Some(s) = hints.start.filter(|&s| s != h.start) {
        return mismatch("start", s.to_string(), h.start.to_string());
    }
    Ok(())
}
