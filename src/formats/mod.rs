//! Every routing format in the wild (format.md §3.2), detected and decoded to one payload type, and
//! encoded back byte-compatibly with each producer.

mod not_routing;
pub mod npy;
pub mod sidecar;

use std::borrow::Cow;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::kernels::b64;
use crate::kernels::buffer::AlignedBytes;
use crate::kernels::jsonscan::Scanner;
use crate::payload::dtype::DType;

use crate::formats::sidecar::SidecarFields;
use crate::payload::{DTypeChoice, Header, Payload, Shape};

/// A routing format of the wild (format.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `{"data": base64, "shape": [T, L, K], "start": S, "dtype": name}` (prime-rl, Dynamo).
    Compact,
    /// base64 of a whole `.npy` file (vLLM); no start.
    VllmNpy,
    /// base64 of flat little-endian values, int32 unless told (SGLang); no shape, no start.
    Sglang,
    /// `nrlre1:<dtype>:<T>x<L>x<K>:<base64>` (NeMo-RL); no start.
    Nemo,
    /// Nested integer lists `[[[...]]]` (lmdeploy); no start.
    Lists,
}

impl Format {
    /// Every format.
    pub const ALL: [Format; 5] = [
        Format::Compact,
        Format::VllmNpy,
        Format::Sglang,
        Format::Nemo,
        Format::Lists,
    ];

    /// The format's name (`"compact"`, `"vllm_npy"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Format::Compact => "compact",
            Format::VllmNpy => "vllm_npy",
            Format::Sglang => "sglang",
            Format::Nemo => "nemo",
            Format::Lists => "lists",
        }
    }

    /// The format of a name; an unknown one is a `PayloadError`.
    pub fn parse(name: &str) -> Result<Format> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                Error::field(
                    "format",
                    "one of compact, vllm_npy, sglang, nemo, lists",
                    format!("{name:?}"),
                )
            })
    }
}

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

const NEMO_PREFIX: &[u8] = b"nrlre1:";
/// How a base64 `.npy` file begins (the magic `\x93NUMPY`): what `detect` reads as vLLM's format.
pub const NPY_B64_PREFIX: &[u8] = b"k05VTVBZ";

/// The format of a text value: JSON text, or the content of a JSON string. Text that is none of
/// them (binary, an image, plain text, an SSE capture) is a `PayloadError` that says what it
/// looks like: SGLang's flat base64 is chosen only for text that reads as base64.
pub fn detect(text: &[u8]) -> Result<Format> {
    match text.iter().find(|c| !c.is_ascii_whitespace()) {
        Some(b'{') => Ok(Format::Compact),
        Some(b'[') => Ok(Format::Lists),
        _ if text.starts_with(NEMO_PREFIX) => Ok(Format::Nemo),
        _ if text.starts_with(NPY_B64_PREFIX) => Ok(Format::VllmNpy),
        _ if looks_like_base64(text) => Ok(Format::Sglang),
        _ => Err(Error::payload(format!(
            "not routing in any known format (compact, vllm_npy, sglang, nemo, lists): {}",
            not_routing::describe(text)
        ))),
    }
}

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

/// Decode a value of any format given as text, detecting which.
pub fn decode_text(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<(Format, Payload)> {
    let format = detect(text)?;
    Ok((format, decode_as(format, text, hints, max_bytes)?))
}

/// A routing value handed over whole, as a caller's text (a file, a string): refused when it
/// is empty or white space (never read as zero rows of SGLang's), and read inside its quotes
/// when it is one JSON string literal (what `json.dump` writes for a string value), so
/// `"k05VTVBZ..."` is read as the `.npy` text it holds. Bodies do not come this way: a
/// routing string in a body is read by where it sits (format.md §3.2).
pub fn input_text(text: &[u8]) -> Result<Cow<'_, [u8]>> {
    let trimmed = text.trim_ascii();
    let empty = |what: &str| {
        Err(Error::payload(format!(
            "empty input: {what}, not a routing value (a value holds at least its format's \
             header or text)"
        )))
    };
    if trimmed.is_empty() {
        return if text.is_empty() {
            empty("0 bytes")
        } else {
            empty(&format!("{} bytes of white space", text.len()))
        };
    }
    if trimmed.first() != Some(&b'"') {
        return Ok(Cow::Borrowed(text));
    }
    let inner = json_string_content(trimmed).map_err(|e| e.context("a JSON string"))?;
    if inner.trim_ascii().is_empty() {
        return empty("a JSON string holding nothing");
    }
    Ok(Cow::Owned(inner.into_owned()))
}

/// Decode text known to be in `format` (as [`detect`] found it).
pub fn decode_as(format: Format, text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    match format {
        Format::Compact => decode_compact(text, hints, max_bytes),
        Format::Lists => decode_lists(text, hints, max_bytes),
        Format::Nemo => decode_nemo(text, hints, max_bytes),
        Format::VllmNpy => decode_vllm_npy(text, hints, max_bytes),
        Format::Sglang => decode_sglang(text, hints, max_bytes),
    }
}

/// Decode a raw JSON value from a body: an object, a list, or a string holding any format.
pub fn decode_json_value(raw: &[u8], hints: &Hints, max_bytes: usize) -> Result<(Format, Payload)> {
    decode_text(&json_string_content(raw)?, hints, max_bytes)
}

/// The content of a JSON string value (borrowed unless it has escapes), or the raw JSON text
/// of any other value.
pub fn json_string_content(raw: &[u8]) -> Result<Cow<'_, [u8]>> {
    if raw.first() != Some(&b'"') {
        return Ok(Cow::Borrowed(raw));
    }
    let mut s = Scanner::new(raw, "routing string");
    let st = s.string()?;
    s.end()?;
    s.string_value(&st)
}

/// A hint that contradicts what the payload carries is an error, never silently preferred.
pub fn check_hints(format: Format, h: &Header, hints: &Hints) -> Result<()> {
    let name = format.name();
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

fn decode_compact(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
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
    check_hints(Format::Compact, &sidecar.header, hints)?;
    sidecar.into_payload()
}

fn decode_lists(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let err = |what: String| {
        Error::payload(format!(
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
    check_hints(Format::Lists, &p.header(), hints)?;
    Ok(p)
}

fn decode_nemo(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let err = |what: String| {
        Error::payload(format!(
            "nemo: expected nrlre1:<dtype>:<T>x<L>x<K>:<base64>, {what}"
        ))
    };
    let rest = &text[NEMO_PREFIX.len()..];
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
    check_hints(Format::Nemo, &p.header(), hints)?;
    Ok(p)
}

fn decode_vllm_npy(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let len = b64::decoded_len(text, "vllm_npy").map_err(|e| e.context("vllm_npy"))?;
    crate::limits::check(len, max_bytes.saturating_add(4096))?;
    if let Some(p) = npy_in_place(text, len, hints, max_bytes) {
        return Ok(p);
    }
    npy_whole_file(text, len, hints, max_bytes)
}

/// The file decoded as a whole, for what the direct path does not take: the same errors, in
/// the same order, as ever (a bad character anywhere before a bad header).
fn npy_whole_file(text: &[u8], len: usize, hints: &Hints, max_bytes: usize) -> Result<Payload> {
    // Decode the whole file once, then move the data to the front of the same buffer.
    let mut file = AlignedBytes::zeroed(len);
    b64::decode_into(text, file.as_mut_bytes(), "vllm_npy")?;
    let h = npy::parse_header(file.as_bytes())?;
    crate::limits::check_shape(h.shape, h.dtype, max_bytes)?;
    let want = h.shape.nbytes(h.dtype)?;
    let have = len - h.data_offset;
    if have != want {
        return Err(Error::payload(format!(
            "vllm_npy: expected {want} data bytes for shape {} of {}, got {have}",
            h.shape, h.dtype
        )));
    }
    file.as_mut_bytes().copy_within(h.data_offset.., 0);
    file.truncate(want);
    let p = Payload::new(hints.start.unwrap_or(0), h.shape, h.dtype, file)?;
    check_hints(Format::VllmNpy, &p.header(), hints)?;
    Ok(p)
}

/// Characters of a `.npy` file's base64 decoded first for its header: 4095 bytes (a whole
/// number of groups), far more than any header vLLM writes (128 bytes).
#[cfg(not(any(test, fuzzing)))]
const NPY_HEAD: usize = 4095;
/// The tests and the fuzzer take a short head, so that small files go through both parts.
#[cfg(any(test, fuzzing))]
const NPY_HEAD: usize = 132;

/// A `.npy` file of `len` bytes in base64 `text`, decoded straight into the payload's memory:
/// the header from the first groups, then the data where it belongs (no zeroing, no move to the
/// front, the decode split among the cores). `None` for anything it does not take (a header
/// past `NPY_HEAD`, any error), which the whole-file path then reads, for its errors.
fn npy_in_place(text: &[u8], len: usize, hints: &Hints, max_bytes: usize) -> Option<Payload> {
    let head_len = len.min(NPY_HEAD);
    let head = b64::decode_range(text, 0, head_len).ok()?;
    let h = npy::parse_header(&head).ok()?;
    crate::limits::check_shape(h.shape, h.dtype, max_bytes).ok()?;
    let want = h.shape.nbytes(h.dtype).ok()?;
    if len.checked_sub(h.data_offset)? != want {
        return None;
    }
    let in_head = &head[h.data_offset..];
    // The groups after the head's (it ends on a group unless it is the whole file).
    let rest = if head_len == len {
        &[][..]
    } else {
        &text[head_len / 3 * 4..]
    };
    let mut decoded = false;
    // SAFETY: the closure reports `want` bytes written only when all of them were: the
    // header's share copied, the rest decoded whole (`decode_uninit` returned true).
    let data = unsafe {
        AlignedBytes::written_up_to(want, |out| {
            if out.len() < want {
                return 0;
            }
            let (first, second) = out[..want].split_at_mut(in_head.len());
            b64::write_uninit(first, in_head);
            decoded = b64::decode_uninit(rest, second);
            if decoded {
                want
            } else {
                0
            }
        })
    };
    if !decoded {
        return None;
    }
    let p = Payload::new(hints.start.unwrap_or(0), h.shape, h.dtype, data).ok()?;
    check_hints(Format::VllmNpy, &p.header(), hints).ok()?;
    Some(p)
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
        return Err(Error::payload(format!(
            "a pickled Python object, not routing data: {WHAT}"
        )));
    }
    Ok(())
}

fn decode_sglang(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    refuse_lmdeploy_reference(text)?;
    let (Some(layers), Some(top_k)) = (hints.num_layers, hints.top_k) else {
        return Err(Error::payload(
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
        return Err(Error::payload(format!(
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

/// The value in `format`, as the text its producer emits (a compact sidecar's JSON object;
/// the content of the JSON string for the string formats; a JSON array for lists).
pub fn encode(p: &Payload, format: Format) -> Result<Vec<u8>> {
    Ok(match format {
        Format::Compact => sidecar::encode(p),
        Format::VllmNpy => {
            let mut file = npy::write_header(p.dtype(), p.shape());
            file.extend_from_slice(p.bytes());
            b64::encode(&file)
        }
        Format::Sglang => b64::encode(p.astype(DType::I32)?.bytes()),
        Format::Nemo => {
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
            let mut out =
                format!("nrlre1:{dtype}:{}x{}x{}:", s.tokens, s.layers, s.top_k).into_bytes();
            out.extend_from_slice(&b64::encode(p.astype(dtype)?.bytes()));
            out
        }
        Format::Lists => {
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
            out
        }
    })
}

/// The value in `format` as JSON text: strings quoted (base64 and the nemo envelope need no
/// escaping), objects and arrays as they are.
pub fn encode_json(p: &Payload, format: Format) -> Result<Vec<u8>> {
    let text = encode(p, format)?;
    Ok(match format {
        Format::Compact | Format::Lists => text,
        _ => {
            let mut out = Vec::with_capacity(text.len() + 2);
            out.push(b'"');
            out.extend_from_slice(&text);
            out.push(b'"');
            out
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::DEFAULT_MAX_BYTES;

    fn sample() -> Payload {
        let values: Vec<i64> = (0..24).map(|v| v * 3).collect();
        Payload::from_values(&values, Shape::new(4, 3, 2), 0, DTypeChoice::Compact).unwrap()
    }

    /// The direct `.npy` path takes only what the whole-file path reads the same way, and the
    /// files it passes on keep their old errors: sound and flawed files, header and data.
    #[test]
    fn caller_text_empty_is_refused_and_a_json_string_is_read_inside() {
        for text in [&b""[..], b"  \n", b"\"\"", b"\" \""] {
            let e = input_text(text).unwrap_err().to_string();
            assert!(e.contains("empty input"), "{e}");
        }
        assert_eq!(&*input_text(b"\"nrlre1:x\"").unwrap(), b"nrlre1:x");
        assert_eq!(&*input_text(b" \"a\\/b\" ").unwrap(), b"a/b");
        assert_eq!(&*input_text(b"[[[1]]]").unwrap(), b"[[[1]]]");
        assert!(input_text(b"\"unterminated").is_err());
    }

    #[test]
    fn npy_in_place_agrees_with_the_whole_file() {
        let mut next = crate::test_rng::xorshift(0x1234_5678_9abc_def1u64);
        let flaws: [&[u8]; 7] = [b"*", b"=", b" ", b"A", b"/", b"    ", b"A==="];
        let (mut direct, mut sound) = (0, 0);
        for tokens in [0usize, 1, 2, 3, 5, 17, 40, 100] {
            for dtype in DType::ALL {
                let values: Vec<i64> = (0..tokens * 6).map(|_| (next() % 100) as i64).collect();
                let p = Payload::from_values(
                    &values,
                    Shape::new(tokens, 3, 2),
                    0,
                    DTypeChoice::Exact(dtype),
                )
                .unwrap();
                let text = encode(&p, Format::VllmNpy).unwrap();
                for trial in 0..12 {
                    let mut t = text.clone();
                    if trial > 0 {
                        let at = next() as usize % t.len();
                        let pick = next() as usize % flaws.len();
                        let replaced = if pick >= 5 { at..at } else { at..at + 1 };
                        t.splice(replaced, flaws[pick].iter().copied());
                    }
                    let Ok(len) = b64::decoded_len(&t, "vllm_npy") else {
                        continue;
                    };
                    let whole = npy_whole_file(&t, len, &Hints::default(), DEFAULT_MAX_BYTES);
                    sound += usize::from(whole.is_ok());
                    if let Some(q) = npy_in_place(&t, len, &Hints::default(), DEFAULT_MAX_BYTES) {
                        direct += 1;
                        assert_eq!(
                            Some(&q),
                            whole.as_ref().ok(),
                            "{:?}",
                            String::from_utf8_lossy(&t)
                        );
                    }
                    let got = decode_vllm_npy(&t, &Hints::default(), DEFAULT_MAX_BYTES);
                    assert_eq!(format!("{got:?}"), format!("{whole:?}"));
                }
                assert!(npy_in_place(
                    &text,
                    b64::decoded_len(&text, "x").unwrap(),
                    &Hints::default(),
                    DEFAULT_MAX_BYTES
                )
                .is_some());
            }
        }
        // Both paths ran: most sound files went the direct way.
        assert!(
            direct > 100 && direct <= sound,
            "{direct} direct of {sound} sound"
        );
    }

    #[test]
    fn every_format_round_trips() {
        let p = sample();
        let hints = Hints {
            num_layers: Some(3),
            top_k: Some(2),
            ..Hints::default()
        };
        for f in Format::ALL {
            let text = encode(&p, f).unwrap();
            let (found, back) = decode_text(&text, &hints, DEFAULT_MAX_BYTES).unwrap();
            assert_eq!(found, f);
            assert!(back.same_routing(&p), "{f:?}");
        }
    }

    #[test]
    fn wrong_hints_and_missing_hints_are_errors() {
        let p = sample();
        let text = encode(&p, Format::Nemo).unwrap();
        let wrong = Hints {
            num_layers: Some(4),
            ..Hints::default()
        };
        let e = decode_text(&text, &wrong, DEFAULT_MAX_BYTES)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`num_layers`: expected 4 (as given), got 3 in the nemo payload"),
            "{e}"
        );
        let sglang = encode(&p, Format::Sglang).unwrap();
        let e = decode_text(&sglang, &Hints::default(), DEFAULT_MAX_BYTES)
            .unwrap_err()
            .to_string();
        assert!(e.contains("give num_layers and top_k"), "{e}");
    }
}
