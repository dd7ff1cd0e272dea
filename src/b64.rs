//! Standard base64 (RFC 4648, `=` padding, no whitespace). Decoding and encoding run on
//! `simdutf` (the Muła-Lemire kernels, dispatched at run time: AVX-512 VBMI, AVX2, SSE, NEON,
//! scalar), which measured 1.6x faster to decode than `base64-simd` on an AVX2 machine;
//! `base64-simd` remains for the check-only pass (validating without writing), where it is the
//! faster of the two.

use crate::error::{Error, Result};
use std::mem::MaybeUninit;

use base64_simd::STANDARD;

/// The decoded length of `text`, from its length and padding alone (no decoding, no allocation).
pub fn decoded_len(text: &[u8], field: &str) -> Result<usize> {
    if text.len() % 4 != 0 {
        return Err(Error::field(
            field,
            "padded base64 (a length that is a multiple of 4)",
            format!("{} characters", text.len()),
        ));
    }
    let pad = text
        .iter()
        .rev()
        .take(2)
        .take_while(|&&c| c == b'=')
        .count();
    Ok(text.len() / 4 * 3 - pad)
}

/// Decode `text` into `out`, whose length must be `decoded_len(text)`.
///
/// simdutf's decoder forgives ASCII white space; this one must not. White space makes the
/// decoded length differ from `decoded_len` (fewer characters carry data, and a partial or
/// mis-padded last chunk is refused in strict mode), so "exactly `out.len()` bytes written"
/// is the whole check. Strict mode also refuses non-zero padding bits.
pub fn decode_into(text: &[u8], out: &mut [u8], field: &str) -> Result<()> {
    let want = out.len();
    if want == 0 {
        return if text.is_empty() {
            Ok(())
        } else {
            Err(invalid(text, field))
        };
    }
    // SAFETY: `text` is valid for reads of its length.
    let room = unsafe { simdutf::maximal_binary_length_from_base64(text.as_ptr(), text.len()) };
    if room > want {
        // Writing would overrun `out`: the text is not `want` bytes of base64.
        return Err(invalid(text, field));
    }
    // SAFETY: `text` is valid for reads of its length; `out` is valid for writes of `want` bytes,
    // at least the maximal length the decoder may write (checked just above); the two do not
    // overlap (one is borrowed shared, the other exclusively).
    let r = unsafe {
        simdutf::base64_to_binary(
            text.as_ptr(),
            text.len(),
            out.as_mut_ptr(),
            simdutf::Base64Options::Default,
            simdutf::LastChunkHandlingOptions::Strict,
        )
    };
    if r.error == simdutf::ErrorCode::Success && r.count == want {
        Ok(())
    } else {
        Err(invalid(text, field))
    }
}

/// Check that `text` would decode, without decoding it (for splicing base64 text as is).
pub fn check(text: &[u8], field: &str) -> Result<()> {
    decoded_len(text, field)?;
    STANDARD.check(text).map_err(|_| invalid(text, field))
}

/// Whether `text` (whole 4-character groups) is valid base64 on its own, without decoding it.
/// Padding is allowed only where the text ends its value (`last`): a chunk cut from the middle
/// must not end in `=`, which would otherwise pass as that chunk's padding.
pub fn groups_valid(text: &[u8], last: bool) -> bool {
    text.len() % 4 == 0 && (last || text.last() != Some(&b'=')) && STANDARD.check(text).is_ok()
}

/// The error the decoding path reports for `text`, for a part of it found invalid on its own:
/// `check`'s verdict on the whole text (the first bad character, bad padding), else `invalid`'s.
pub fn error_in(text: &[u8], field: &str) -> Error {
    check(text, field)
        .err()
        .unwrap_or_else(|| invalid(text, field))
}

/// A vector of `len` bytes written by `fill`, which must write all of them unless it fails
/// (then nothing is returned and nothing uninitialised is ever read).
pub fn try_filled_vec(
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<()>,
) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len])?;
    // SAFETY: `fill` succeeded, and its contract is then to have initialised all `len` bytes.
    unsafe { out.set_len(len) };
    Ok(out)
}

/// Name the first offending character, so the message says what was wrong.
fn invalid(text: &[u8], field: &str) -> Error {
    let body = text.len()
        - text
            .iter()
            .rev()
            .take(2)
            .take_while(|&&c| c == b'=')
            .count();
    let bad = text[..body]
        .iter()
        .position(|c| !(c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/'));
    match bad {
        Some(i) => Error::field(
            field,
            "base64 characters A-Z a-z 0-9 + /",
            format!("{:?} at offset {i}", text[i] as char),
        ),
        None => Error::field(field, "canonical base64", "non-zero padding bits"),
    }
}

/// Bytes `[start, end)` of what base64 `text` decodes to, decoding only the groups that hold
/// them. The groups are validated as they are decoded, with padding allowed only at the end of
/// the text (a group from the middle ending in `=` decodes on its own, to fewer bytes): text
/// that is not valid there is the decoding path's error, never a short or wrong slice.
pub fn decode_range(text: &[u8], start: usize, end: usize) -> Result<Vec<u8>> {
    if start >= end {
        return Ok(Vec::new());
    }
    let (first, last) = (start / 3 * 4, (end.div_ceil(3) * 4).min(text.len()));
    let groups = text
        .get(first..last)
        .ok_or_else(|| error_in(text, "data"))?;
    let n = decoded_len(groups, "data")?;
    if last < text.len() && n != groups.len() / 4 * 3 {
        return Err(error_in(text, "data"));
    }
    let mut out = vec![0u8; n];
    decode_into(groups, &mut out, "data").map_err(|_| error_in(text, "data"))?;
    let offset = start - first / 4 * 3;
    out.get(offset..offset + (end - start))
        .map(<[u8]>::to_vec)
        .ok_or_else(|| error_in(text, "data"))
}

/// A character of the standard base64 alphabet (padding `=` aside).
pub fn is_alphabet(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'+' || c == b'/'
}

/// Standard padded base64 of `bytes`.
pub fn encode(bytes: &[u8]) -> Vec<u8> {
    filled_vec(encoded_len(bytes.len()), |out| encode_into(bytes, out))
}

/// A vector of `len` bytes written by `fill`, which must write all of them; nothing is zeroed
/// first (for tens of MB, zeroing is a second pass over every page).
pub fn filled_vec(len: usize, fill: impl FnOnce(&mut [MaybeUninit<u8>])) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill`'s contract is to initialise all `len` bytes.
    unsafe { out.set_len(len) };
    out
}

/// Copy `src` into the start of `dst` (uninitialised memory); return the rest of `dst`.
pub fn write_uninit<'a>(dst: &'a mut [MaybeUninit<u8>], src: &[u8]) -> &'a mut [MaybeUninit<u8>] {
    let (head, rest) = dst.split_at_mut(src.len());
    // SAFETY: `head` is exactly `src.len()` writable bytes that do not overlap `src`.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), head.as_mut_ptr().cast::<u8>(), src.len())
    };
    rest
}

pub fn encoded_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// Encode `bytes` into `out` (which may be uninitialised), whose length must be
/// `encoded_len(bytes.len())`.
pub fn encode_into(bytes: &[u8], out: &mut [MaybeUninit<u8>]) {
    assert_eq!(
        out.len(),
        encoded_len(bytes.len()),
        "base64 output of the wrong length"
    );
    // SAFETY: `bytes` is valid for reads of its length; `out` is exactly the encoded length
    // (asserted above), which is all the encoder writes; they do not overlap (one shared, one
    // exclusive borrow). Writing through the pointer initialises the bytes.
    let written = unsafe {
        simdutf::binary_to_base64(
            bytes.as_ptr(),
            bytes.len(),
            out.as_mut_ptr().cast::<u8>(),
            simdutf::Base64Options::Default,
        )
    };
    debug_assert_eq!(written, out.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        for n in 0..20 {
            let bytes: Vec<u8> = (0..n as u8).map(|b| b.wrapping_mul(37)).collect();
            let text = encode(&bytes);
            let mut back = vec![0; decoded_len(&text, "data").unwrap()];
            decode_into(&text, &mut back, "data").unwrap();
            assert_eq!(back, bytes);
        }
        assert!(decoded_len(b"abc", "data").is_err());
        let text = encode(b"abcdefghij");
        for start in 0..10 {
            for end in start..=10 {
                assert_eq!(
                    decode_range(&text, start, end).unwrap(),
                    b"abcdefghij"[start..end].to_vec()
                );
            }
        }
        // Padding inside the text is refused, not decoded to a short group (and never sliced).
        for (start, end) in [(0, 1), (1, 2), (2, 3), (0, 3)] {
            assert!(decode_range(b"AA==BA==", start, end).is_err());
        }
        assert_eq!(decode_range(b"AAADBA==", 2, 4).unwrap(), vec![3, 4]);
        let mut out = [0u8; 3];
        let e = decode_into(b"ab*d", &mut out, "data")
            .unwrap_err()
            .to_string();
        assert!(e.contains("'*' at offset 2"), "{e}");
    }
}
