//! Nested integer lists `[[[...]]]` (lmdeploy; vLLM 0.21's generated rows and prompt rows;
//! NeMo-RL before its PR #3292): no start; the rows they cover depend on who wrote them.

use super::declared::{check_named, Hints, Producer};
use super::places::{Place, Rule};
use crate::error::{Error, Result};
use crate::kernels::jsonscan::Scanner;
use crate::payload::dtype::DType;
use crate::payload::{DTypeChoice, Payload, Shape};

/// The nested lists' producer entry.
pub(super) const PRODUCER: Producer = Producer {
    name: "lists",
    described: "nested lists",
    detects,
    decode,
    encode,
    last_resort: false,
    json_string: false,
    writes_at: &[Place::Choice, Place::Prompt, Place::Message, Place::Sglang],
    rule,
    ignores_start: None,
};

fn decode(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let err = |what: String| {
        Error::malformed(format!(
            "lists: expected a rectangular 3-level nested list of integers, {what}"
        ))
    };
    // Every value takes at least 2 bytes of text and 8 as i64 while parsing: bound the work by
    // the limit before starting, and build no DOM.
    crate::limits::check(text.len(), max_bytes).map_err(|e| e.context("lists"))?;
    let mut s = Scanner::new(text, "lists");
    if s.peek() != Some(b'[') {
        return Err(err("got a non-list".into()));
    }
    let (mut layers, mut top_k) = (hints.num_layers, hints.top_k);
    let mut values: Vec<i64> = Vec::new();
    let mut tokens = 0;
    s.array(|s, t| {
        tokens = t + 1;
        if s.peek() != Some(b'[') {
            return Err(err(format!("got a non-list at token {t}")));
        }
        let mut n_layers = 0;
        s.array(|s, l| {
            n_layers = l + 1;
            if s.peek() != Some(b'[') {
                return Err(err(format!("got a non-list at token {t}, layer {l}")));
            }
            let mut k = 0;
            s.array(|s, _| {
                k += 1;
                let r = s.value()?;
                let v = &s.buf()[r];
                let n = std::str::from_utf8(v)
                    .ok()
                    .and_then(|v| v.parse::<i64>().ok());
                values.push(n.ok_or_else(|| {
                    err(format!(
                        "got {} at token {t}, layer {l}",
                        String::from_utf8_lossy(v)
                    ))
                })?);
                Ok(())
            })?;
            if *top_k.get_or_insert(k) != k {
                return Err(err(format!(
                    "got top_k {k} at token {t}, layer {l}, {} before",
                    top_k.unwrap_or(0)
                )));
            }
            Ok(())
        })?;
        if *layers.get_or_insert(n_layers) != n_layers {
            return Err(err(format!(
                "got {n_layers} layers at token {t}, {} before",
                layers.unwrap_or(0)
            )));
        }
        Ok(())
    })?;
    s.end()?;
    let shape = Shape::new(tokens, layers.unwrap_or(0), top_k.unwrap_or(0));
    crate::limits::check_shape(shape, hints.dtype.unwrap_or(DType::U8), max_bytes)?;
    let choice = hints.dtype.map_or(DTypeChoice::Compact, DTypeChoice::Exact);
    let p = Payload::from_values(&values, shape, hints.start.unwrap_or(0), choice)?;
    check_named(PRODUCER.name, &p.header(), hints)?;
    Ok(p)
}

fn detects(text: &[u8]) -> bool {
    text.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'[')
}

/// Who wrote the lists decides which rows they cover: NeMo-RL (at the message) writes a filler
/// last row; at a choice they are lmdeploy's or vLLM 0.21's generated rows, which cannot be
/// told apart; elsewhere (lmdeploy) rows from 0.
fn rule(place: Place) -> Rule {
    match place {
        Place::Message => Rule::WholeWithFiller,
        Place::Choice => Rule::ListsAtChoice,
        _ => Rule::FromZero,
    }
}

fn encode(p: &Payload) -> Result<Vec<u8>> {
    let s = p.shape();
    let mut out = Vec::with_capacity(p.bytes().len() * 4 + 2);
    out.push(b'[');
    let mut itoa = itoa::Buffer::new();
    for t in 0..s.tokens {
        out.extend_from_slice(if t == 0 { b"[" } else { b",[" });
        for l in 0..s.layers {
            out.extend_from_slice(if l == 0 { b"[" } else { b",[" });
            for k in 0..s.top_k {
                if k > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(
                    itoa.format(p.value_at((t * s.layers + l) * s.top_k + k))
                        .as_bytes(),
                );
            }
            out.push(b']');
        }
        out.push(b']');
    }
    out.push(b']');
    Ok(out)
}
