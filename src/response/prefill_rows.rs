//! Prefill's side of a streaming merge, built once per stream: each routing value decoded into
//! its rows (the body's text is not needed after this), and what a merge of any decode routing
//! with this body would refuse.

use super::{decode_found, MergeOptions};
use crate::body::{split, BodyRouting};
use crate::error::{Error, Result};
use crate::formats::{sidecar, Hints};
use crate::payload::Payload;

/// The prefill body's routing as every event of a stream merges with it: rows held decoded
/// (one copy, 3/4 of their base64 text), found by choice index as `merge_response` finds them.
#[derive(Debug)]
pub struct PrefillRows {
    /// (choice index, the value decoded with the hints the merge applies, or why not).
    values: Vec<(u64, Result<Payload>)>,
    /// Why any decode routing is refused whatever it is (routing weights, a sidecar key a merge
    /// would drop), as `merge_response` checks before it merges.
    refusal: Option<Error>,
    /// vLLM 0.21's split prompt rows: merged by `split`, which is not streamed.
    split: bool,
}

impl PrefillRows {
    /// Decode the prefill body's routing (as `read_prefill` or `read_body` found it) once. A
    /// value that does not decode is kept as its error: the merge fails with it only if a
    /// decode value is merged with it, as `merge_response` would.
    pub fn new(routing: &BodyRouting, opts: &MergeOptions) -> PrefillRows {
        let values = routing
            .values
            .iter()
            .map(|f| {
                // As merge_found: start hints are for formats that carry no start.
                let hints = routing_experts_hints(f.fields.is_some(), opts);
                let decoded = decode_found(f, &hints, opts.max_bytes)
                    .map(|(_, p)| p)
                    .map_err(|e| e.context("prefill"));
                (f.index, decoded)
            })
            .collect();
        let refusal = routing
            .weights
            .as_deref()
            .map(split::weights_error)
            .or_else(|| {
                routing.values.iter().find_map(|f| {
                    let key = f.fields.as_ref()?.extra_key.as_deref()?;
                    Some(sidecar::extra_key_error(&f.path, key))
                })
            });
        PrefillRows {
            values,
            refusal,
            split: routing.prompt.is_some(),
        }
    }

    /// Whether the body carries no routing.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && !self.split
    }

    /// Bytes of decoded rows held.
    pub fn held_bytes(&self) -> usize {
        self.values
            .iter()
            .map(|(_, p)| p.as_ref().map_or(0, |p| p.bytes().len()))
            .sum()
    }

    pub(crate) fn refusal(&self) -> Option<&Error> {
        self.refusal.as_ref()
    }

    pub(crate) fn split(&self) -> bool {
        self.split
    }

    /// Whether every value is one choice's, so it serves every decode choice whatever its
    /// index (`one_choice` in response.rs).
    pub(crate) fn one_choice(&self) -> bool {
        self.values
            .first()
            .is_some_and(|(i, _)| self.values.iter().all(|(j, _)| j == i))
    }

    /// The value a decode choice merges with (`None`: missing on the prefill side).
    pub(crate) fn for_choice(&self, index: u64) -> Option<&Result<Payload>> {
        self.values
            .iter()
            .find(|(i, _)| *i == index)
            .or_else(|| self.one_choice().then(|| &self.values[0]))
            .map(|(_, p)| p)
    }
}

/// The hints `merge_found` decodes a prefill value with.
fn routing_experts_hints(compact: bool, opts: &MergeOptions) -> Hints {
    Hints {
        start: if compact { None } else { opts.hints.start },
        ..opts.hints
    }
}
