//! NeMo-RL's `nrlre1:<dtype>:<T>x<L>x<K>:<base64>` string: no start; rows `[0, P + G)`, the
//! last a filler row, not routing.

use super::declared::{check_named, Hints, Producer};
use super::places::{Place, Rule};
use super::sidecar;
use crate::error::{Error, Result};
use crate::kernels::b64;
use crate::payload::dtype::DType;
use crate::payload::{Payload, Shape};

/// NeMo-RL's producer entry.
pub(super) const PRODUCER: Producer = Producer {
    name: "nemo",
    described: "NeMo-RL's nrlre1 string",
    detects,
    decode,
    encode,
    last_resort: false,
    json_string: true,
    writes_at: &[Place::Message],
    rule: |_| Rule::WholeWithFiller,
    ignores_start: None,
};

const PREFIX: &[u8] = b"nrlre1:";

fn decode(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let err = |what: String| {
        Error::malformed(format!(
            "nemo: expected nrlre1:<dtype>:<T>x<L>x<K>:<base64>, {what}"
        ))
    };
    let rest = &text[PREFIX.len()..];
    let mut parts = rest.splitn(3, |&c| c == b':');
    let (Some(dtype), Some(dims), Some(data)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(err("got fewer than 4 ':'-separated parts".into()));
    };
    let dtype = std::str::from_utf8(dtype).unwrap_or("?");
    let dtype = match dtype {
        "int8" => DType::I8,
        "int16" => DType::I16,
        "int32" => DType::I32,
        other => return Err(err(format!("got dtype {other:?} (int8, int16 or int32)"))),
    };
    let dims: Vec<usize> = std::str::from_utf8(dims)
        .unwrap_or("?")
        .split('x')
        .map(|d| d.parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            err(format!(
                "got dimensions {:?}",
                String::from_utf8_lossy(dims)
            ))
        })?;
    let [t, l, k] = dims[..] else {
        return Err(err(format!("got {} dimensions", dims.len())));
    };
    let p = sidecar::decode_base64(
        data,
        hints.start.unwrap_or(0),
        Shape::new(t, l, k),
        dtype,
        max_bytes,
        "nemo data",
    )?;
    check_named(PRODUCER.name, &p.header(), hints)?;
    Ok(p)
}

fn detects(text: &[u8]) -> bool {
    text.starts_with(PREFIX)
}

fn encode(p: &Payload) -> Result<Vec<u8>> {
    let dtype = match p.dtype() {
        d @ (DType::I8 | DType::I16 | DType::I32) => d,
        _ => {
            let (lo, hi) = p.min_max().unwrap_or((0, 0));
            [DType::I8, DType::I16, DType::I32]
                .into_iter()
                .find(|d| d.holds(lo) && d.holds(hi))
                .ok_or_else(|| {
                    Error::field(
                        "array",
                        "values that fit int32 for the nemo format",
                        format!("values in [{lo}, {hi}]"),
                    )
                })?
        }
    };
    let s = p.shape();
    let mut out = format!("nrlre1:{dtype}:{}x{}x{}:", s.tokens, s.layers, s.top_k).into_bytes();
    out.extend_from_slice(&b64::encode(p.astype(dtype)?.bytes()));
    Ok(out)
}
