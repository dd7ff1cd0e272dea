//! The `.npy` file format (what vLLM base64-encodes): header parsing and writing, in Rust.
//! Versions 1, 2 and 3; little-endian integer dtypes; C order; no pickled objects.

use crate::error::{Error, Result};
use crate::payload::dtype::DType;
use crate::payload::Shape;

const MAGIC: &[u8] = b"\x93NUMPY";

/// A parsed header: the array's dtype and shape, and where its data begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NpyHeader {
    /// The array's element type.
    pub dtype: DType,
    /// The array's shape (3-d).
    pub shape: Shape,
    /// Where the array's data starts in the file.
    pub data_offset: usize,
}

fn err(msg: impl std::fmt::Display) -> Error {
    Error::malformed(format!("vllm_npy: {msg}"))
}

/// Whether `bytes` starts with the `.npy` magic.
pub(crate) fn is_npy(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

/// The length of a `.npy` file's preamble and header, from its first 12 bytes (version 1.0
/// states it in 2 bytes, later versions in 4): for readers that decode only the header's
/// groups. `None` when fewer bytes are given; [`parse_header`] then checks the rest.
pub(crate) fn header_len(first: &[u8]) -> Option<usize> {
    match first.get(6..12)? {
        [1, 0, a, b, ..] => Some(10 + u16::from_le_bytes([*a, *b]) as usize),
        [_, _, a, b, c, d] => Some(12 + u32::from_le_bytes([*a, *b, *c, *d]) as usize),
        _ => None,
    }
}

/// Parse a `.npy` file's header: what `np.load` accepts of a 3-d integer array, nothing it refuses.
pub fn parse_header(file: &[u8]) -> Result<NpyHeader> {
    if !is_npy(file) {
        return Err(err("expected the .npy magic \\x93NUMPY at the start"));
    }
    let (len, at): (Option<usize>, usize) = match file.get(6..8) {
        Some([1, 0]) => (
            file.get(8..10)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize),
            10,
        ),
        Some([2 | 3, 0]) => (
            file.get(8..12)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize),
            12,
        ),
        Some(v) => {
            return Err(err(format!(
                "expected format version 1.0, 2.0 or 3.0, got {}.{}",
                v[0], v[1]
            )))
        }
        None => None.ok_or_else(|| err("file ends inside the header"))?,
    };
    let len = len.ok_or_else(|| err("file ends inside the header"))?;
    let end = at
        .checked_add(len)
        .filter(|&e| e <= file.len())
        .ok_or_else(|| {
            err(format!(
                "header says {len} bytes but the file has {}",
                file.len().saturating_sub(at)
            ))
        })?;
    let text = std::str::from_utf8(&file[at..end]).map_err(|_| err("header is not text"))?;
    let dict = HeaderDict::parse(text)?;
    let dtype = match dict.descr.as_str() {
        "|u1" | "<u1" | ">u1" | "u1" => DType::U8,
        "|i1" | "<i1" | ">i1" | "i1" => DType::I8,
        "<u2" => DType::U16,
        "<i2" => DType::I16,
        "<u4" => DType::U32,
        "<i4" => DType::I32,
        "<i8" => DType::I64,
        d if d.contains('O') => return Err(err("pickled object arrays are not accepted")),
        d if d.starts_with('>') => {
            return Err(err(format!("big-endian dtype {d:?} is not accepted")))
        }
        d => {
            return Err(err(format!(
                "expected an integer dtype (|u1 <u2 <i2 <i4 <i8), got {d:?}"
            )))
        }
    };
    if dict.fortran_order {
        return Err(err(
            "Fortran-ordered arrays are not accepted (C order only)",
        ));
    }
    let [t, l, k] = dict.shape[..] else {
        return Err(err(format!(
            "expected a 3-dimensional shape (tokens, layers, top_k), got {:?}",
            dict.shape
        )));
    };
    Ok(NpyHeader {
        dtype,
        shape: Shape::new(t, l, k),
        data_offset: end,
    })
}

/// The numpy `descr` string that `np.save` writes for `dtype`.
fn descr(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::U16 => "<u2",
        DType::I16 => "<i2",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
    }
}

/// The header bytes `np.save` writes (version 1.0, padded with spaces so the data starts on a
/// multiple of 64 bytes).
pub fn write_header(dtype: DType, shape: Shape) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': ({}, {}, {}), }}",
        descr(dtype),
        shape.tokens,
        shape.layers,
        shape.top_k
    );
    let unpadded = MAGIC.len() + 4 + dict.len() + 1;
    let total = unpadded.div_ceil(64) * 64;
    let hlen = (total - MAGIC.len() - 4) as u16;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&hlen.to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    out
}

/// The three keys of a header, read from its Python-literal dict.
struct HeaderDict {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

impl HeaderDict {
    /// The dict `np.save` writes, with the freedom `ast.literal_eval` gives it (either quote,
    /// any key order, white space, a trailing comma), and nothing `np.load` refuses: exactly
    /// the keys `descr`, `fortran_order` and `shape`, `shape` a tuple of non-negative integers
    /// (`(3)` is an int, not a tuple; `(1,,3)` is no literal). Stricter than `np.load` in corners
    /// no writer uses: a key given twice (Python keeps the last; that is ambiguity, refused),
    /// escapes in strings, comments, `_` in numbers, booleans as dimensions.
    fn parse(text: &str) -> Result<HeaderDict> {
        let mut p = Lit {
            s: text.as_bytes(),
            at: 0,
        };
        let (mut descr, mut fortran, mut shape) = (None, None, None);
        p.expect(b'{')?;
        loop {
            if p.peek() == Some(b'}') {
                break;
            }
            let key = p.string()?;
            p.expect(b':')?;
            let twice = || err(format!("header key {key:?} given twice"));
            match key {
                "descr" => {
                    if descr.replace(p.string()?.to_string()).is_some() {
                        return Err(twice());
                    }
                }
                "fortran_order" => {
                    if fortran.replace(p.boolean()?).is_some() {
                        return Err(twice());
                    }
                }
                "shape" => {
                    if shape.replace(p.tuple()?).is_some() {
                        return Err(twice());
                    }
                }
                other => return Err(err(format!("unexpected header key {other:?}"))),
            }
            match p.peek() {
                Some(b',') => p.at += 1,
                Some(b'}') => break,
                _ => return Err(p.error("',' or '}'")),
            }
        }
        p.expect(b'}')?;
        if p.peek().is_some() {
            return Err(p.error("the end of the header"));
        }
        Ok(HeaderDict {
            descr: descr.ok_or_else(|| err("header has no 'descr'"))?,
            fortran_order: fortran.ok_or_else(|| err("header has no 'fortran_order'"))?,
            shape: shape.ok_or_else(|| err("header has no 'shape'"))?,
        })
    }
}

/// A cursor over the header's Python literal.
struct Lit<'a> {
    s: &'a [u8],
    at: usize,
}

impl<'a> Lit<'a> {
    fn error(&self, expected: &str) -> Error {
        let got = match self.s.get(self.at) {
            Some(&c) if c.is_ascii_graphic() => format!("{:?}", c as char),
            Some(&c) => format!("byte 0x{c:02x}"),
            None => "the end of the header".to_string(),
        };
        err(format!(
            "header: expected {expected} at byte {}, got {got}",
            self.at
        ))
    }

    /// The next byte after white space (Python's, inside brackets: space, tab, newlines).
    fn peek(&mut self) -> Option<u8> {
        while let Some(b' ' | b'\t' | b'\n' | b'\r' | b'\x0c') = self.s.get(self.at) {
            self.at += 1;
        }
        self.s.get(self.at).copied()
    }

    fn expect(&mut self, c: u8) -> Result<()> {
        if self.peek() != Some(c) {
            return Err(self.error(&format!("{:?}", c as char)));
        }
        self.at += 1;
        Ok(())
    }

    /// A quoted string without escapes.
    fn string(&mut self) -> Result<&'a str> {
        let q = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(self.error("a quoted string")),
        };
        let start = self.at + 1;
        let len = self.s[start..]
            .iter()
            .position(|&c| c == q || c == b'\\' || c == b'\n')
            .ok_or_else(|| self.error("a closing quote"))?;
        self.at = start + len;
        if self.s[self.at] != q {
            return Err(self.error("a string without escapes"));
        }
        self.at += 1;
        std::str::from_utf8(&self.s[start..start + len]).map_err(|_| err("header is not text"))
    }

    fn word(&mut self, w: &[u8]) -> bool {
        let hit = self.s[self.at..].starts_with(w)
            && !self
                .s
                .get(self.at + w.len())
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_');
        if hit {
            self.at += w.len();
        }
        hit
    }

    fn boolean(&mut self) -> Result<bool> {
        self.peek();
        if self.word(b"True") {
            Ok(true)
        } else if self.word(b"False") {
            Ok(false)
        } else {
            Err(self.error("True or False for 'fortran_order'"))
        }
    }

    /// A non-negative decimal integer as Python writes it (no sign, no `_`, no leading zeros
    /// but in `0`, `00`, ...), within `usize`.
    fn dim(&mut self) -> Result<usize> {
        self.peek();
        let digits = self.s[self.at..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        let text = &self.s[self.at..self.at + digits];
        let leading_zero = text.len() > 1 && text[0] == b'0' && text.iter().any(|&c| c != b'0');
        if digits == 0 || leading_zero {
            return Err(self.error("a non-negative integer dimension"));
        }
        if self
            .s
            .get(self.at + digits)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'.')
        {
            self.at += digits;
            return Err(self.error("',' or ')' after a dimension"));
        }
        let n = std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.parse::<usize>().ok())
            .ok_or_else(|| self.error("a dimension below 2**64"))?;
        self.at += digits;
        Ok(n)
    }

    /// A tuple of dimensions: `()`, `(n,)`, `(n, m)`, `(n, m,)`, ...
    fn tuple(&mut self) -> Result<Vec<usize>> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        let mut comma = false;
        loop {
            if self.peek() == Some(b')') {
                break;
            }
            dims.push(self.dim()?);
            comma = match self.peek() {
                Some(b',') => {
                    self.at += 1;
                    true
                }
                Some(b')') => false,
                _ => return Err(self.error("',' or ')' in 'shape'")),
            };
        }
        self.at += 1;
        if dims.len() == 1 && !comma {
            return Err(err(
                "'shape' is a parenthesised int, not a tuple (a 1-tuple needs a comma)",
            ));
        }
        Ok(dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejections() {
        for d in DType::ALL {
            let h = write_header(d, Shape::new(5, 3, 2));
            assert_eq!(h.len() % 64, 0);
            let parsed = parse_header(&h).unwrap();
            assert_eq!(
                (parsed.dtype, parsed.shape, parsed.data_offset),
                (d, Shape::new(5, 3, 2), h.len())
            );
        }
        let bad = |dict: &str| {
            let mut f = b"\x93NUMPY\x01\x00".to_vec();
            f.extend_from_slice(&(dict.len() as u16).to_le_bytes());
            f.extend_from_slice(dict.as_bytes());
            parse_header(&f).unwrap_err().to_string()
        };
        assert!(
            bad("{'descr': '|O', 'fortran_order': False, 'shape': (1, 1, 1), }")
                .contains("pickled")
        );
        assert!(
            bad("{'descr': '>u2', 'fortran_order': False, 'shape': (1, 1, 1), }")
                .contains("big-endian")
        );
        assert!(
            bad("{'descr': '<u2', 'fortran_order': True, 'shape': (1, 1, 1), }")
                .contains("Fortran")
        );
        assert!(
            bad("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1), }")
                .contains("integer dtype")
        );
        assert!(
            bad("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1), }")
                .contains("3-dimensional")
        );
        assert!(parse_header(b"\x93NUMPY\x01\x00\xff\x00{")
            .unwrap_err()
            .to_string()
            .contains("header says 255"));
    }
}
