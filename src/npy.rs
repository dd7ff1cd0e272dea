//! The `.npy` file format (what vLLM base64-encodes): header parsing and writing, in Rust.
//! Versions 1, 2 and 3; little-endian integer dtypes; C order; no pickled objects.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::payload::Shape;

const MAGIC: &[u8] = b"\x93NUMPY";

/// A parsed header: the array's dtype and shape, and where its data begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NpyHeader {
    pub dtype: DType,
    pub shape: Shape,
    pub data_offset: usize,
}

fn err(msg: impl std::fmt::Display) -> Error {
    Error::payload(format!("vllm_npy: {msg}"))
}

pub fn is_npy(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

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
    fn parse(text: &str) -> Result<HeaderDict> {
        let body = text
            .trim()
            .strip_prefix('{')
            .and_then(|t| t.trim_end().strip_suffix('}'));
        let body = body.ok_or_else(|| err(format!("expected a header dict, got {text:?}")))?;
        let (mut descr, mut fortran, mut shape) = (None, None, None);
        let mut rest = body.trim();
        while !rest.is_empty() {
            let (key, after) =
                quoted(rest).ok_or_else(|| err(format!("bad header key near {rest:?}")))?;
            let after = after
                .trim_start()
                .strip_prefix(':')
                .ok_or_else(|| err("expected ':' after a header key"))?;
            let after = after.trim_start();
            rest = match key {
                "descr" => {
                    let (v, r) = quoted(after).ok_or_else(|| err("expected a quoted 'descr'"))?;
                    descr = Some(v.to_string());
                    r
                }
                "fortran_order" => {
                    let (v, r) = if let Some(r) = after.strip_prefix("False") {
                        (false, r)
                    } else if let Some(r) = after.strip_prefix("True") {
                        (true, r)
                    } else {
                        return Err(err("expected True or False for 'fortran_order'"));
                    };
                    fortran = Some(v);
                    r
                }
                "shape" => {
                    let inner = after
                        .strip_prefix('(')
                        .ok_or_else(|| err("expected a tuple for 'shape'"))?;
                    let close = inner
                        .find(')')
                        .ok_or_else(|| err("unclosed 'shape' tuple"))?;
                    let dims: Result<Vec<usize>> = inner[..close]
                        .split(',')
                        .map(str::trim)
                        .filter(|d| !d.is_empty())
                        .map(|d| {
                            d.parse()
                                .map_err(|_| err(format!("bad dimension {d:?} in 'shape'")))
                        })
                        .collect();
                    shape = Some(dims?);
                    &inner[close + 1..]
                }
                other => return Err(err(format!("unexpected header key {other:?}"))),
            };
            rest = rest.trim_start();
            rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
        }
        Ok(HeaderDict {
            descr: descr.ok_or_else(|| err("header has no 'descr'"))?,
            fortran_order: fortran.ok_or_else(|| err("header has no 'fortran_order'"))?,
            shape: shape.ok_or_else(|| err("header has no 'shape'"))?,
        })
    }
}

/// A single- or double-quoted string at the start of `s`, and what follows it.
fn quoted(s: &str) -> Option<(&str, &str)> {
    let q = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let end = s[1..].find(q)? + 1;
    Some((&s[1..end], &s[end + 1..]))
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
