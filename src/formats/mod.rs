//! Every routing format in the wild (format.md §3.2), detected and decoded to one payload type, and
//! encoded back byte-compatibly with each producer.

mod declared;
mod not_routing;
pub(crate) use not_routing::describe as describe_not_routing;
pub mod npy;
mod places;
pub mod sidecar;

pub use compact::decode_compact_fields;
pub use declared::Hints;
pub(crate) use declared::Producer;
pub use places::{Place, Rule};
pub use vllm_npy::NPY_B64_PREFIX;

use std::borrow::Cow;

use crate::error::{Error, ErrorKind, Result};
use crate::kernels::jsonscan::Scanner;

use crate::payload::{Header, Payload};

/// Declares the producers: each one's module (`formats/<name>.rs`, which holds its detection,
/// decoding, encoding, the places it writes at and the rows it covers there), its `Format`
/// variant, `Format::ALL` and `PRODUCERS`, from one line each.
macro_rules! producers {
    ($($(#[$doc:meta])* $variant:ident in $module:ident,)+) => {
        $(mod $module;)+

        /// A routing format of the wild (format.md §3).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Format {
            $($(#[$doc])* $variant,)+
        }

        impl Format {
            /// Every format.
            pub const ALL: [Format; [$(Format::$variant),+].len()] = [$(Format::$variant),+];
        }

        /// Every producer, in the order of `Format::ALL`.
        pub(crate) const PRODUCERS: [&Producer; Format::ALL.len()] = [$(&$module::PRODUCER),+];
    };
}

// The producers: a new one is its file and its line here (docs/architecture.md).
producers! {
    /// `{"data": base64, "shape": [T, L, K], "start": S, "dtype": name}` (prime-rl, Dynamo).
    Compact in compact,
    /// base64 of a whole `.npy` file (vLLM); no start.
    VllmNpy in vllm_npy,
    /// base64 of flat little-endian values, int32 unless told (SGLang); no shape, no start.
    Sglang in sglang,
    /// `nrlre1:<dtype>:<T>x<L>x<K>:<base64>` (NeMo-RL); no start.
    Nemo in nemo,
    /// Nested integer lists `[[[...]]]` (lmdeploy); no start.
    Lists in lists,
}

impl Format {
    /// The format's name (`"compact"`, `"vllm_npy"`, ...).
    pub fn name(self) -> &'static str {
        producer(self).name
    }

    /// The format of a name; an unknown one is a `PayloadError`.
    pub fn parse(name: &str) -> Result<Format> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                Error::field(
                    "format",
                    format!("one of {}", Format::names()),
                    format!("{name:?}"),
                )
            })
    }

    /// Every format's name, in the order of `ALL` ("compact, vllm_npy, ...").
    fn names() -> String {
        Format::ALL.map(Format::name).join(", ")
    }
}

/// The producer of `format`.
pub(crate) fn producer(format: Format) -> &'static Producer {
    // `PRODUCERS` is in the order of the variants (one macro writes both).
    PRODUCERS[format as usize]
}

/// The format of a text value: JSON text, or the content of a JSON string. Text that is none of
/// them (binary, an image, plain text, an SSE capture) is a `PayloadError` that says what it
/// looks like: SGLang's flat base64 is chosen only for text that reads as base64.
pub fn detect(text: &[u8]) -> Result<Format> {
    let claims = |last_resort: bool| {
        Format::ALL.into_iter().find(move |&f| {
            let p = producer(f);
            p.last_resort == last_resort && (p.detects)(text)
        })
    };
    claims(false).or_else(|| claims(true)).ok_or_else(|| {
        Error::new(
            ErrorKind::Unplaced,
            format!(
                "not routing in any known format ({}): {}",
                Format::names(),
                not_routing::describe(text)
            ),
        )
    })
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
        Err(Error::malformed(format!(
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
    (producer(format).decode)(text, hints, max_bytes)
}

/// Decode a raw JSON value from a body: an object, a list, or a string holding any format.
pub(crate) fn decode_json_value(
    raw: &[u8],
    hints: &Hints,
    max_bytes: usize,
) -> Result<(Format, Payload)> {
    decode_text(&json_string_content(raw)?, hints, max_bytes)
}

/// The content of a JSON string value (borrowed unless it has escapes), or the raw JSON text
/// of any other value.
pub(crate) fn json_string_content(raw: &[u8]) -> Result<Cow<'_, [u8]>> {
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
    declared::check_named(format.name(), h, hints)
}

/// The value in `format`, as the text its producer emits (a compact sidecar's JSON object;
/// the content of the JSON string for the string formats; a JSON array for lists).
pub fn encode(p: &Payload, format: Format) -> Result<Vec<u8>> {
    (producer(format).encode)(p)
}

/// The value in `format` as JSON text: strings quoted (base64 and the nemo envelope need no
/// escaping), objects and arrays as they are.
pub fn encode_json(p: &Payload, format: Format) -> Result<Vec<u8>> {
    let text = encode(p, format)?;
    Ok(match producer(format).json_string {
        false => text,
        true => {
            let mut out = Vec::with_capacity(text.len() + 2);
            out.push(b'"');
            out.extend_from_slice(&text);
            out.push(b'"');
            out
        }
    })
}

// The places' methods ask the registry (format.md §3.2, §3.3); their types are in places.rs.
impl Place {
    /// Whether producers write `format` here (each producer's file lists its places). A compact
    /// sidecar is allowed everywhere: it places itself, and it is what a merge writes back by
    /// default.
    pub fn allows(self, format: Format) -> bool {
        producer(format).writes_at.contains(&self)
    }

    /// The formats written here, in the order of `Format::ALL`, for messages: "vLLM's .npy,
    /// nested lists or a compact sidecar".
    pub fn formats(self) -> String {
        let mut names: Vec<&str> = Format::ALL
            .into_iter()
            .filter(|&f| f != Format::Compact && producer(f).writes_at.contains(&self))
            .map(|f| producer(f).described)
            .collect();
        names.push(producer(Format::Compact).described);
        let last = names.pop().unwrap_or_default();
        if names.is_empty() {
            last.to_string()
        } else {
            format!("{} or {last}", names.join(", "))
        }
    }
}

impl Rule {
    /// The rule of a value in `format` found at `place`: who wrote it decides (NeMo-RL writes
    /// its filler row in either of its formats, at its own place); each producer's file says.
    pub fn of(format: Format, place: Place) -> Rule {
        (producer(format).rule)(place)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::payload::{DTypeChoice, Shape};

    fn sample() -> Payload {
        let values: Vec<i64> = (0..24).map(|v| v * 3).collect();
        Payload::from_values(&values, Shape::new(4, 3, 2), 0, DTypeChoice::Compact).unwrap()
    }

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

    #[test]
    fn every_format_has_its_producer_and_detection_asks_the_last_resort_last() {
        for (i, f) in Format::ALL.into_iter().enumerate() {
            assert_eq!(PRODUCERS[i].name, f.name());
            assert_eq!(Format::parse(f.name()).unwrap(), f);
            // No two producers claim a text, but for the last resort (SGLang's base64, which
            // also reads a `.npy`'s).
            let text = encode(&sample(), f).unwrap();
            let claims: Vec<Format> = Format::ALL
                .into_iter()
                .filter(|&g| !producer(g).last_resort && (producer(g).detects)(&text))
                .collect();
            let expected = if producer(f).last_resort {
                vec![]
            } else {
                vec![f]
            };
            assert_eq!(claims, expected, "{f:?}");
            assert_eq!(detect(&text).unwrap(), f);
        }
        let last: Vec<Format> = Format::ALL
            .into_iter()
            .filter(|&g| producer(g).last_resort)
            .collect();
        assert_eq!(last, [Format::Sglang]);
        // A compact sidecar is read wherever routing sits.
        assert!(producer(Format::Compact).writes_at.len() == 5);
        assert_eq!(
            Format::names(),
            "compact, vllm_npy, sglang, nemo, lists",
            "the names in messages"
        );
        assert_eq!(
            Place::Choice.formats(),
            "vLLM's .npy, nested lists or a compact sidecar"
        );
        assert_eq!(Place::Prompt.formats(), "nested lists or a compact sidecar");
    }
}
