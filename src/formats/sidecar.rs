//! The compact sidecar (format.md §3.1): `{"data":"<base64>","shape":[T,L,K],"start":S,"dtype":"uint8"}`.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use serde_json::Value;

use crate::error::{Error, ErrorKind, Result};
use crate::kernels::b64;
use crate::kernels::buffer::AlignedBytes;
use crate::kernels::jsonscan::{Scanner, Str};
use crate::limits;
use crate::payload::dtype::DType;
use crate::payload::{Header, Payload, Shape};

/// The `data` field as found: base64 text, or the JSON type it had instead.
#[derive(Debug, Clone)]
pub enum DataField<'a> {
    /// The base64 text.
    Base64(Cow<'a, [u8]>),
    /// The JSON type it had instead (for the error).
    NotAString(&'static str),
}

/// The four fields of a sidecar, from JSON text or from a Python dict.
#[derive(Debug, Default, Clone)]
pub struct SidecarFields<'a> {
    /// `data`.
    pub data: Option<DataField<'a>>,
    /// `shape`, as JSON.
    pub shape: Option<Value>,
    /// `start`, as JSON.
    pub start: Option<Value>,
    /// `dtype`, as JSON.
    pub dtype: Option<Value>,
    /// A key of `BODY_KEYS` the object has: it is a response body, not a sidecar.
    pub body_key: Option<&'static str>,
    /// A key of another routing object the object has (`FOREIGN_KEYS`): it is not a sidecar.
    pub foreign_key: Option<&'static str>,
    /// The first key beyond `data`, `shape`, `start` and `dtype` (at most 64 characters of it):
    /// readers read the ids and pass it by (the golden vectors give a sidecar a `note`), but a
    /// merge, which writes only those four, refuses it rather than drop it (format.md §3.6).
    pub extra_key: Option<String>,
    /// What `data` decodes to, when the reader decoded it in the same pass that found the end
    /// of its text (as `decode` and `from_response` read it): exactly the bytes
    /// decoding `data` gives, used once the fields are validated. `None`: `data` is decoded
    /// after validation.
    pub decoded: Option<AlignedBytes>,
    /// `data`'s text is base64 characters then at most two `=`, as the scan that found its end
    /// saw (`jsonscan::Scanner::base64_text`): a merge that copies
    /// it as it is need not check it again. `false`: nothing is known of it.
    pub data_base64: bool,
    /// `data` was strict base64 decoded as the body arrived (a `BodyReader`'s): its text is not
    /// kept (`data` is empty), `decoded` holds its bytes.
    pub predecoded: bool,
}

/// The keys a compact sidecar is made of, and the only ones a merge writes (format.md §3.1).
pub const SIDECAR_KEYS: [&str; 4] = ["data", "shape", "start", "dtype"];

/// A merge of a sidecar with a key it would not write back (format.md §3.6): prime-rl's
/// `weights` (PR #3523, open: its router weights, whose shape is not settled) or any key the
/// library does not know. Refused, never dropped.
pub(crate) fn extra_key_error(path: &str, key: &str) -> Error {
    let what = match key {
        "weights" => {
            "prime-rl's router weights (PR #3523, open; their shape is not settled), \
             which are not merged"
        }
        "format_version" => "prime-rl's format version (PR #3523, open, beside its weights)",
        _ => "a key the library does not know",
    };
    Error::inconsistent(format!(
        "the sidecar at {path} has a `{key}` key: {what}; a merge writes data, shape, start and \
         dtype only, and never drops a field of a sidecar"
    ))
}

/// Decode a sidecar from JSON text: every check format.md §3.1 lists happens before the payload
/// is made, with the same errors as checking first and decoding after (the data is decoded as
/// it is read).
pub fn decode(json: &[u8], max_bytes: usize) -> Result<Payload> {
    validate(parse_fields_decoding(json, max_bytes)?, max_bytes)?.into_payload()
}

/// Split JSON text into the sidecar's fields in one pass, borrowing the (large) data string.
/// A key given as `null` is kept (and reported as null); only an absent key takes the default.
pub fn parse_fields(json: &[u8]) -> Result<SidecarFields<'_>> {
    parse_with(json, None)
}

/// [`parse_fields`], decoding the data string in the same pass (up to `max_bytes`).
pub(crate) fn parse_fields_decoding(json: &[u8], max_bytes: usize) -> Result<SidecarFields<'_>> {
    parse_with(json, Some(max_bytes))
}

fn parse_with(json: &[u8], decode_up_to: Option<usize>) -> Result<SidecarFields<'_>> {
    let mut s = Scanner::new(json, "sidecar");
    match s.peek() {
        Some(b'{') => {}
        Some(c) => return Err(Error::field("sidecar", "a JSON object", json_type_name(c))),
        None => return Err(Error::field("sidecar", "a JSON object", "empty input")),
    }
    let fields = read_with(&mut s, decode_up_to)?;
    s.end()?;
    Ok(fields)
}

/// The fields of the sidecar object at the scanner's position (its `{` next), read in the same
/// pass that walks the document around it: a response body's walker reads routing values with
/// this instead of skipping them and parsing them again.
pub(crate) fn read_fields<'a>(s: &mut Scanner<'a>) -> Result<SidecarFields<'a>> {
    read_with(s, None)
}

/// [`read_fields`], decoding the data string as base64 in the same pass that finds its end, so
/// its (large) text is read once: `decoded` holds the bytes when the text is strict base64 of
/// at most `max_bytes` bytes. Text that is not (or is larger) is read as [`read_fields`] reads
/// it, and decoding it later gives the errors it always did.
pub(crate) fn read_fields_decoding<'a>(
    s: &mut Scanner<'a>,
    max_bytes: usize,
) -> Result<SidecarFields<'a>> {
    read_with(s, Some(max_bytes))
}

fn read_with<'a>(s: &mut Scanner<'a>, decode_up_to: Option<usize>) -> Result<SidecarFields<'a>> {
    let json = s.buf();
    let mut fields = SidecarFields::default();
    s.object(|s, key| {
        let duplicate = || {
            Error::malformed(format!(
                "sidecar: duplicate key `{}`",
                String::from_utf8_lossy(key)
            ))
        };
        if key == b"data" {
            if fields.data.is_some() {
                return Err(duplicate());
            }
            fields.data = Some(if let Some(bytes) = s.predecoded_string()? {
                // Decoded as the body arrived (`BodyReader`): the text is gone, its bytes are
                // strict base64's, whose length `validate` checks as it would the text's.
                (fields.decoded, fields.predecoded) = (Some(bytes), true);
                DataField::Base64(Cow::Borrowed(b""))
            } else if s.peek() == Some(b'"') {
                let st = match decode_up_to {
                    Some(max_bytes) => {
                        let (st, decoded) = read_decoding(s, max_bytes)?;
                        fields.decoded = decoded;
                        st
                    }
                    None => {
                        let st = s.base64_text()?;
                        fields.data_base64 = st.base64;
                        st
                    }
                };
                DataField::Base64(s.string_value(&st)?)
            } else {
                let r = s.value()?;
                DataField::NotAString(json_type_name(json[r.start]))
            });
            return Ok(());
        }
        let slot = match key {
            b"shape" => &mut fields.shape,
            b"start" => &mut fields.start,
            b"dtype" => &mut fields.dtype,
            _ => {
                if fields.extra_key.is_none() {
                    let shown = String::from_utf8_lossy(key);
                    fields.extra_key = Some(shown.chars().take(64).collect());
                }
                if let Some(k) = BODY_KEYS.iter().find(|k| k.as_bytes() == key) {
                    fields.body_key = Some(k);
                }
                if let Some((k, _)) = FOREIGN_KEYS.iter().find(|(k, _)| k.as_bytes() == key) {
                    fields.foreign_key = Some(k);
                }
                return s.value().map(drop); // unknown keys are ignored
            }
        };
        if slot.is_some() {
            return Err(duplicate());
        }
        let r = s.value()?;
        let v = serde_json::from_slice(&json[r])
            .map_err(|e| Error::malformed(format!("sidecar: invalid JSON: {e}")))?;
        *slot = Some(v);
        Ok(())
    })?;
    Ok(fields)
}

/// The string next in `s`, decoded as base64 while it is read (see [`read_fields_decoding`]).
fn read_decoding(s: &mut Scanner<'_>, max_bytes: usize) -> Result<(Str, Option<AlignedBytes>)> {
    // The text can be no longer than the rest of the document: 3/4 of that bounds the output
    // before anything is known of the shape (memory never touched costs nothing).
    let room = (s.buf().len() - s.pos()).div_ceil(4) * 3;
    let mut read = None;
    // SAFETY: the closure returns the count `base64_string` reports written into the slice it
    // was given (which `decode_string_content` guarantees initialised and within it), or 0.
    let bytes = unsafe {
        AlignedBytes::written_up_to(room.min(max_bytes), |out| {
            let r = s.base64_string(out);
            let n = match &r {
                Ok((_, Some(n))) => *n,
                _ => 0,
            };
            read = Some(r);
            n
        })
    };
    let (st, written) = read.expect("written_up_to calls its fill once")?;
    Ok((st, written.map(|_| bytes)))
}

/// What a JSON value starting with `first` is, for messages ("got an array"). Text that no JSON
/// value starts with is said to be so, not guessed to be a number.
pub(crate) fn json_type_name(first: u8) -> &'static str {
    match first {
        b'{' => "an object",
        b'[' => "an array",
        b'"' => "a string",
        b't' | b'f' => "a boolean",
        b'n' => "null",
        b'-' | b'0'..=b'9' => "a number",
        _ => "text that is not JSON",
    }
}

/// Keys of a response body (format.md §3.2) that a routing value never has: a sidecar reader given a
/// whole body says so, and what to call instead.
pub const BODY_KEYS: [&str; 4] = ["choices", "sglext", "meta_info", "nvext"];

/// Keys of routing objects other producers write where a sidecar goes, and what each is: refused
/// with a message that names it, not as a sidecar missing its `data`.
pub const FOREIGN_KEYS: [(&str, &str); 2] = [
    ("routed_experts_str", OMNI_NPU),
    ("routed_experts_shape", OMNI_NPU),
];

const OMNI_NPU: &str = "the omni-npu vLLM plugin's routing object (routed_experts_shape, \
     routed_experts_dtype, routed_experts_str_len, routed_experts_str), whose base64 text is \
     zlib-compressed or not by a server flag it does not state; not read: run that server with \
     --routed-experts-serialization-mode base64 and convert it, or have it write a compact sidecar";

fn body_given(key: &str) -> Error {
    Error::malformed(format!(
        "sidecar: this is a response body (it has `{key}`), not a routing value: read its \
         routing with from_response(body, choice), or merge two bodies with merge_response"
    ))
}

fn value_type_name(v: &Value) -> String {
    match v {
        Value::String(_) => "a string".into(),
        Value::Null => "null".into(),
        Value::Bool(_) => "a boolean".into(),
        other => other.to_string(),
    }
}

/// A sidecar whose fields are validated and whose base64 length matches its shape, not yet
/// decoded: what a merge needs to plan, and to splice base64 text without decoding it.
#[derive(Debug)]
pub struct SidecarText<'a> {
    /// Start, shape and dtype, validated.
    pub header: Header,
    /// The base64 text, its length checked against the shape.
    pub data: Cow<'a, [u8]>,
    /// What `data` decodes to, when it was decoded as it was read (`SidecarFields::decoded`).
    decoded: Option<AlignedBytes>,
    /// `data` is base64 characters then at most two `=` (`SidecarFields::data_base64`).
    pub(crate) data_base64: bool,
}

impl SidecarText<'_> {
    /// The payload: the bytes decoded as the text was read, or else decoding the text now.
    pub(crate) fn into_payload(mut self) -> Result<Payload> {
        match self.decoded.take() {
            Some(data) if Some(data.len()) == self.header.shape.nbytes(self.header.dtype).ok() => {
                Payload::new(
                    self.header.start,
                    self.header.shape,
                    self.header.dtype,
                    data,
                )
            }
            _ => self.decode(),
        }
    }

    /// Decode the base64 into a payload.
    pub fn decode(&self) -> Result<Payload> {
        let mut data = AlignedBytes::zeroed(self.header.shape.nbytes(self.header.dtype)?);
        b64::decode_into(&self.data, data.as_mut_bytes(), "data")?;
        Payload::new(
            self.header.start,
            self.header.shape,
            self.header.dtype,
            data,
        )
    }
}

/// Check every field, the data length against the shape and the size limit; decode nothing.
pub fn validate(mut fields: SidecarFields<'_>, max_bytes: usize) -> Result<SidecarText<'_>> {
    let decoded = fields.decoded.take();
    let data_base64 = fields.data_base64;
    if let (Some(key), None, _) | (Some(key), _, None) =
        (fields.body_key, fields.data.as_ref(), fields.shape.as_ref())
    {
        return Err(body_given(key));
    }
    if let (Some(key), None) = (fields.foreign_key, fields.data.as_ref()) {
        let what = FOREIGN_KEYS
            .iter()
            .find(|(k, _)| *k == key)
            .map_or("", |(_, w)| w);
        return Err(Error::malformed(format!(
            "sidecar: a `{key}` key and no `data`: this is {what}"
        )));
    }
    let shape = parse_shape(fields.shape.as_ref())?;
    let start = match &fields.start {
        None => 0,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| Error::field("start", "a non-negative integer", value_type_name(v)))?,
    };
    let dtype = match &fields.dtype {
        None => DType::U8,
        Some(Value::String(s)) => DType::parse(s)?,
        Some(v) => return Err(Error::field("dtype", "a dtype name", value_type_name(v))),
    };
    let data = match fields.data {
        Some(DataField::Base64(t)) => t,
        Some(DataField::NotAString(kind)) => {
            return Err(Error::field("data", "a base64 string", kind))
        }
        None => return Err(Error::field("data", "a base64 string", "no `data` key")),
    };
    limits::check_shape(shape, dtype, max_bytes)?;
    if fields.predecoded {
        // The reader reads the whole text again for any error, so this one is never shown.
        let (want, have) = (
            shape.nbytes(dtype)?,
            decoded.as_ref().map_or(0, |d| d.len()),
        );
        if want != have {
            let want = format!("{want} bytes for shape {shape} of {dtype}");
            return Err(Error::field("data", want, format!("{have} bytes")));
        }
        return Ok(SidecarText {
            header: Header::new(start, shape, dtype)?,
            data,
            decoded,
            data_base64: true,
        });
    }
    check_length(&data, shape, dtype, max_bytes, "data").map_err(|e| {
        match fields
            .dtype
            .is_none()
            .then(|| base85_of(&data, shape))
            .flatten()
        {
            Some(itemsize) => Error::new(
                ErrorKind::Unplaced,
                format!(
                    "`data`: {} characters of base85 (the length of {} values of {itemsize} bytes \
                 in base85, and only base85's letters), not base64: the {{data, shape}} form \
                 prime-rl wrote before its PR #2487 and Dynamo before its PR #10529; not read, \
                 since no dtype is stated (its readers assumed int32)",
                    data.len(),
                    shape.elems().unwrap_or(0)
                ),
            ),
            None => e,
        }
    })?;
    Ok(SidecarText {
        header: Header::new(start, shape, dtype)?,
        data,
        decoded,
        data_base64,
    })
}

/// The item size whose base85 text (4 bytes in 5 characters) has the length of `text`, when
/// every character of `text` is in Python's base85 alphabet and one of 1, 2, 4 or 8 fits.
fn base85_of(text: &[u8], shape: Shape) -> Option<usize> {
    let in_alphabet = |c: &u8| c.is_ascii_alphanumeric() || b"!#$%&()*+-;<=>?@^_`{|}~".contains(c);
    if text.is_empty() || !text.iter().all(in_alphabet) {
        return None;
    }
    let elems = shape.elems().ok()?;
    [4usize, 1, 2, 8].into_iter().find(|&size| {
        elems
            .checked_mul(size)
            .and_then(|n| n.checked_mul(5))
            .is_some_and(|n| n.div_ceil(4) == text.len())
    })
}

/// The shape must be within the limit, and the decoded length of base64 `text` exactly its size.
fn check_length(
    text: &[u8],
    shape: Shape,
    dtype: DType,
    max_bytes: usize,
    field: &str,
) -> Result<()> {
    limits::check_shape(shape, dtype, max_bytes)?;
    let want = shape.nbytes(dtype)?;
    let have = b64::decoded_len(text, field)?;
    if have != want {
        return Err(Error::field(
            field,
            format!("{want} bytes for shape {shape} of {dtype}"),
            format!("{have} bytes"),
        ));
    }
    Ok(())
}

/// Base64 of raw little-endian bytes -> payload, checking the length against the shape and the
/// size limit before allocating.
pub(crate) fn decode_base64(
    text: &[u8],
    start: u64,
    shape: Shape,
    dtype: DType,
    max_bytes: usize,
    field: &str,
) -> Result<Payload> {
    check_length(text, shape, dtype, max_bytes, field)?;
    let want = shape.nbytes(dtype)?;
    let mut data = AlignedBytes::zeroed(want);
    b64::decode_into(text, data.as_mut_bytes(), field)?;
    Payload::new(start, shape, dtype, data)
}

pub(crate) fn parse_shape(v: Option<&Value>) -> Result<Shape> {
    const WANT: &str = "three non-negative integers [num_tokens, num_layers, top_k]";
    let v = v.ok_or_else(|| Error::field("shape", WANT, "no `shape` key"))?;
    let dims = match v.as_array() {
        Some(a) if a.len() == 3 => a,
        _ => return Err(Error::field("shape", WANT, value_type_name(v))),
    };
    let mut out = [0usize; 3];
    for (o, d) in out.iter_mut().zip(dims) {
        *o = d
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| Error::field("shape", WANT, v.to_string()))?;
    }
    Ok(Shape::new(out[0], out[1], out[2]))
}

/// How the canonical encoding begins, up to the base64 text.
pub(crate) const DATA_KEY: &[u8] = b"{\"data\":\"";

/// Exact length of the canonical encoding.
pub fn encoded_len(p: &Payload) -> usize {
    DATA_KEY.len() + b64::encoded_len(p.bytes().len()) + tail(&p.header()).len()
}

/// The part after the base64 text: `","shape":[T,L,K],"start":S,"dtype":"D"}`.
pub(crate) fn tail(h: &Header) -> String {
    let s = h.shape;
    format!(
        "\",\"shape\":[{},{},{}],\"start\":{},\"dtype\":\"{}\"}}",
        s.tokens, s.layers, s.top_k, h.start, h.dtype
    )
}

/// Write the canonical encoding (key order data, shape, start, dtype; no spaces) into `out`,
/// which must be `encoded_len(p)` bytes long.
/// `out` may be uninitialised: every byte is written.
///
/// # Panics
///
/// When `out` is shorter than `encoded_len(p)`.
pub fn encode_into(p: &Payload, out: &mut [MaybeUninit<u8>]) {
    let rest = b64::write_uninit(out, DATA_KEY);
    let (body, end) = rest.split_at_mut(b64::encoded_len(p.bytes().len()));
    b64::encode_into(p.bytes(), body);
    b64::write_uninit(end, tail(&p.header()).as_bytes());
}

/// The canonical encoding of the payload `header` describes, whose bytes are `a` then `b`,
/// written without joining them first (a merge's halves, encoded where they lie: the join
/// would be one more copy of every byte).
pub(crate) fn encode_joined(header: &Header, a: &[u8], b: &[u8]) -> Vec<u8> {
    let data = b64::encoded_len(a.len() + b.len());
    let tail = tail(header);
    b64::filled_vec(DATA_KEY.len() + data + tail.len(), |out| {
        let rest = b64::write_uninit(out, DATA_KEY);
        let (body, end) = rest.split_at_mut(data);
        b64::encode_joined_into(a, b, body);
        b64::write_uninit(end, tail.as_bytes());
    })
}

/// The sidecar's `data` string: standard padded base64 of the payload's bytes.
pub fn data_base64(p: &Payload) -> Vec<u8> {
    b64::encode(p.bytes())
}

/// The canonical encoding as a vector.
pub fn encode(p: &Payload) -> Vec<u8> {
    b64::filled_vec(encoded_len(p), |out| encode_into(p, out))
}

/// The pieces of the canonical encoding of `header` around base64 text that is already
/// encoded (the splice path of a merge: no decode, no re-encode, no copy until assembly).
pub(crate) fn wrap_base64<'a, P: From<Cow<'a, [u8]>>>(header: &Header, base64: Vec<P>) -> Vec<P> {
    let mut pieces = Vec::with_capacity(base64.len() + 2);
    pieces.push(Cow::<'a, [u8]>::Borrowed(DATA_KEY).into());
    pieces.extend(base64);
    pieces.push(Cow::<'a, [u8]>::Owned(tail(header).into_bytes()).into());
    pieces
}

#[cfg(test)]
mod tests;
