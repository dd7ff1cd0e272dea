//! How a merge is asked for ([`MergeOptions`]), and the choices' values it takes: what the
//! merges of whole bodies, of `.npy` text, of streamed events and the row checks all read.

use crate::body::Found;
use crate::formats::Hints;

/// How [`merge_response`](super::merge_response) works.
#[derive(Clone, Copy, Debug)]
pub struct MergeOptions {
    /// Limit on each decoded payload.
    pub max_bytes: usize,
    /// Join base64 text directly when the cut falls on a 3-byte boundary (same result, faster).
    pub splice: bool,
    /// Hints for the prefill values (and the decode values, unless `decode_start` is given).
    pub hints: Hints,
    /// The start of the decode values, for formats that carry none (a delta from `P-1`).
    pub decode_start: Option<u64>,
    /// Write the merged value in the decode value's format instead of a compact sidecar.
    pub keep_format: bool,
    /// Refuse a decode body without routing when the prefill body has some (a proxy's policy:
    /// a client that asked for routing must not get a 200 without it). Off by default: format.md §4
    /// passes a decode body without routing through unchanged.
    pub require_routing: bool,
    /// Leave the text that the merge would encode again from other base64 text on another byte
    /// grid (vLLM's `.npy` rows written as a compact sidecar) to be written as the body is sent
    /// ([`Part::Recoded`](super::Part), from
    /// [`Spliced::take_checked_recoded_parts`](super::Spliced::take_checked_recoded_parts)).
    /// Off by default; [`Spliced::checked_slices`](super::Spliced::checked_slices) refuses such
    /// a body, having no slice to give for that text. In a streaming merge
    /// ([`EventMerge`](super::EventMerge)) it leaves prefill's rows, on the output's grid or
    /// not, to be written as they are sent ([`EventMerge::take_deferred`](super::EventMerge::take_deferred)).
    pub defer_recode: bool,
    /// Answer a group in the shared-prompt shape (format.md §4.1): the prompt's rows once, as a
    /// compact sidecar at the top-level `prompt_routed_experts`, and each choice's value holding
    /// only the rows after them, so a group of `n` choices carries the prompt once, not `n`
    /// times. Every value is then a compact sidecar, whatever `keep_format` says. Off by
    /// default: each choice's value holds its whole sequence.
    pub shared_prompt: bool,
}

impl MergeOptions {
    /// Defaults: splice on, no hints, merged values written as compact sidecars.
    pub fn new(max_bytes: usize) -> Self {
        MergeOptions {
            max_bytes,
            splice: true,
            hints: Hints::default(),
            decode_start: None,
            keep_format: false,
            require_routing: false,
            defer_recode: false,
            shared_prompt: false,
        }
    }
}

/// The routing of a body with routing for one choice only (perhaps at two places): it serves
/// every decode choice.
pub(crate) fn one_choice<'f, 'a>(found: &'f [Found<'a>]) -> Option<&'f Found<'a>> {
    let first = found.first()?;
    found
        .iter()
        .all(|f| f.index == first.index)
        .then_some(first)
}

/// The hints one side's value is decoded with: the caller's, the start aside for compact values,
/// which carry their own (the start hints are for formats that carry none).
pub(crate) fn side_hints(f: &Found, start: Option<u64>, opts: &MergeOptions) -> Hints {
    Hints {
        start: if f.fields.is_some() { None } else { start },
        ..opts.hints
    }
}
