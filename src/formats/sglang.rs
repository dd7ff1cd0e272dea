//! SGLang's routing: base64 of flat little-endian values (int32 unless told), with no shape
//! and no start (the caller gives `num_layers` and `top_k`); rows `[S, P + G - 1)`. Tried last
//! by detection: only text that reads as base64 is taken for it.

use super::declared::{Hints, Producer};
use super::places::{Place, Rule};
use super::sidecar;
use crate::error::{Error, ErrorKind, Result};
use crate::kernels::b64;
use crate::payload::dtype::DType;
use crate::payload::{Payload, Shape};

/// SGLang's producer entry.
pub(super) const PRODUCER: Producer = Producer {
    name: "sglang",
    described: "SGLang's flat base64 values",
    detects,
    decode,
    encode,
    last_resort: true,
    json_string: true,
    writes_at: &[Place::Sglang, Place::Nvext],
    rule: |_| Rule::EndsBeforeLastToken,
    ignores_start: Some("SGLang 0.5.8 to 0.5.11 ignore routed_experts_start_len"),
};

/// How many bytes of a long text `looks_like_base64` reads: enough to tell base64 from anything
/// else without a second pass over tens of MB (the decoder validates every byte anyway).
const SNIFF_BYTES: usize = 4096;

/// Whole 4-character groups whose head and tail are base64: what SGLang's values are (the empty
/// text is zero rows). The middle of a long text is left to the decoder, which reads every byte
/// and names a bad one.
fn looks_like_base64(text: &[u8]) -> bool {
    if text.is_empty() {
        return true;
    }
    if text.len() % 4 != 0 {
        return false;
    }
    let (head, tail) = text.split_at(text.len() - 4);
    let head_ok = head[..head.len().min(SNIFF_BYTES)]
        .iter()
        .all(|&c| b64::is_alphabet(c));
    let pad = tail.iter().rev().take_while(|&&c| c == b'=').count();
    head_ok && pad <= 2 && tail[..4 - pad].iter().all(|&c| b64::is_alphabet(c))
}

/// lmdeploy with Ray transport puts base64 of a pickled Ray ObjectRef (or pickled array) where
/// routing goes, or a key into its Ray shared store. Neither is routing data: say so, rather
/// than decode a pickle as expert ids or report only a bad base64 character.
fn refuse_lmdeploy_reference(text: &[u8]) -> Result<()> {
    const WHAT: &str = "lmdeploy with Ray transport returns a Ray ObjectRef or a shared-store key \
                        here; resolve it in lmdeploy's client (ray.get) and pass the array, nested \
                        lists or a compact sidecar instead";
    // Only the first and last groups are decoded (each validated as it is): text that is not
    // base64 is left to the decoder, which reads it all anyway and names the bad character.
    let n = b64::decoded_len(text, "sglang").unwrap_or(0);
    if n < 3 {
        return Ok(());
    }
    let (Ok(head), Ok(last)) = (
        b64::decode_range(text, 0, 2),
        b64::decode_range(text, n - 1, n),
    ) else {
        return Ok(());
    };
    // Pickle protocols 2-5 open with PROTO (0x80, version) and close with STOP ('.').
    if head[0] == 0x80 && (2..=5).contains(&head[1]) && last[0] == b'.' {
        return Err(Error::new(ErrorKind::Unplaced, format!(
            "a pickled Python object, not routing data: {WHAT}"
        )));
    }
    Ok(())
}

fn decode(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    refuse_lmdeploy_reference(text)?;
    let (Some(layers), Some(top_k)) = (hints.num_layers, hints.top_k) else {
        return Err(Error::malformed(
            "sglang: flat base64 values carry no shape: give num_layers and top_k".to_string(),
        ));
    };
    let dtype = hints.dtype.unwrap_or(DType::I32);
    let bytes = b64::decoded_len(text, "sglang").map_err(|e| e.context("sglang"))?;
    let row = layers
        .checked_mul(top_k)
        .and_then(|r| r.checked_mul(dtype.itemsize()))
        .filter(|&r| r > 0);
    let row = row.ok_or_else(|| {
        Error::field(
            "num_layers x top_k",
            "a positive product",
            format!("{layers} x {top_k}"),
        )
    })?;
    if bytes % row != 0 {
        return Err(Error::malformed(format!(
            "sglang: {bytes} bytes is not a whole number of rows of {layers} layers x top_k {top_k} of {dtype} ({row} bytes)"
        )));
    }
    let shape = Shape::new(bytes / row, layers, top_k);
    sidecar::decode_base64(
        text,
        hints.start.unwrap_or(0),
        shape,
        dtype,
        max_bytes,
        "sglang data",
    )
}

fn detects(text: &[u8]) -> bool {
    looks_like_base64(text)
}

fn encode(p: &Payload) -> Result<Vec<u8>> {
    Ok(b64::encode(p.astype(DType::I32)?.bytes()))
}
