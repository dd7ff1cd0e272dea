//! The compact sidecar `{"data": base64, "shape": [T, L, K], "start": S, "dtype": name}`
//! (format.md §3.1; prime-rl, Dynamo, and what a merge writes back): it states its own
//! positions, so it is read anywhere routing sits. Its codec is `sidecar.rs`.

use serde_json::Value;

use super::declared::{check_named, Hints, Producer};
use super::places::{Place, Rule};
use super::sidecar::{self, SidecarFields};
use crate::error::Result;
use crate::payload::Payload;

/// The compact sidecar's producer entry.
pub(super) const PRODUCER: Producer = Producer {
    name: "compact",
    described: "a compact sidecar",
    detects,
    decode,
    encode,
    last_resort: false,
    json_string: false,
    writes_at: &[
        Place::Choice,
        Place::Prompt,
        Place::Message,
        Place::Sglang,
        Place::Nvext,
    ],
    rule: |_| Rule::SelfPlaced,
    ignores_start: None,
};

fn decode(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    decode_compact_fields(
        sidecar::parse_fields_decoding(text, max_bytes)?,
        hints,
        max_bytes,
    )
}

/// A compact sidecar's fields (from JSON or a dict) with the caller's hints applied.
pub fn decode_compact_fields(
    mut fields: SidecarFields<'_>,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Payload> {
    if fields.start.is_none() {
        // Older producers wrote no start: the caller's hint supplies it (else 0).
        fields.start = hints.start.map(Value::from);
    }
    let sidecar = sidecar::validate(fields, max_bytes)?;
    check_named(PRODUCER.name, &sidecar.header, hints)?;
    sidecar.into_payload()
}

fn detects(text: &[u8]) -> bool {
    text.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'{')
}

fn encode(p: &Payload) -> Result<Vec<u8>> {
    Ok(sidecar::encode(p))
}
