//! Standard base64 (RFC 4648, `=` padding, no whitespace). Decoding and encoding run on
//! `simdutf` (the Muła-Lemire kernels, dispatched at run time: AVX-512 VBMI, AVX2, SSE, NEON,
//! scalar), which measured 1.6x faster to decode than `base64-simd` on an AVX2 machine;
//! `base64-simd` remains for the check-only pass (validating without writing), where it is the
//! faster of the two.

use crate::error::{Error, Result};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

use base64_simd::STANDARD;

/// The decoded length of `text`, from its length and padding alone (no decoding, no allocation).
pub(crate) fn decoded_len(text: &[u8], field: &str) -> Result<usize> {
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
pub(crate) fn decode_into(text: &[u8], out: &mut [u8], field: &str) -> Result<()> {
    // SAFETY: the same memory viewed as `MaybeUninit<u8>` (same layout); `decode_uninit` only
    // ever stores initialised bytes into it, so `out` stays initialised.
    let out = unsafe {
        std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<MaybeUninit<u8>>(), out.len())
    };
    if decode_uninit(text, out) {
        Ok(())
    } else {
        Err(invalid(text, field))
    }
}

/// [`decode_into`] into memory that may be uninitialised, all of which is written when it
/// succeeds (`true`); `false` when `text` is not exactly `out.len()` bytes of strict base64.
/// Large texts are split among the machine's cores at multiples of 4 characters: each part but
/// the last must decode to exactly 3/4 of its length, which refuses padding and white space
/// inside it, as the whole-text decode does.
pub(crate) fn decode_uninit(text: &[u8], out: &mut [MaybeUninit<u8>]) -> bool {
    if out.is_empty() || text.is_empty() {
        return out.is_empty() && text.is_empty();
    }
    crate::kernels::parallel::over_pairs(text, out, (4, 3), |_, t, o| {
        decode_piece(t, o) == Some(o.len())
    })
}

/// How far [`decode_string_content`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Streamed {
    /// The content ended (the closing quote is at `end`) and all of it was strict base64: it
    /// decoded to the first `written` bytes of the output, exactly what [`decode_into`] writes.
    Decoded {
        /// Offset of the closing quote in the text given.
        end: usize,
        /// Bytes written at the start of the output.
        written: usize,
    },
    /// Decoding stopped (the content is not strict base64 throughout, has an escape or a byte
    /// that is not ASCII, or the output is full): the first `plain` bytes are base64 characters
    /// (so printable ASCII, with no quote or backslash), and the caller's own string scan
    /// resumes there. Nothing written may be used.
    Stopped {
        /// Bytes known to be base64 characters, from the start of the text given.
        plain: usize,
    },
}

/// Characters decoded per step of [`decode_string_content`] (a multiple of 4), and the bytes
/// each full step writes.
/// The tests and the fuzzer take tiny steps, so that small inputs go through every branch.
#[cfg(not(any(test, fuzzing)))]
const STREAM_CHUNK: usize = 64 * 1024;
#[cfg(any(test, fuzzing))]
const STREAM_CHUNK: usize = 8;
const STREAM_OUT: usize = STREAM_CHUNK / 4 * 3;
/// Steps taken on the calling thread before others join in: most strings end within them, and
/// a thread costs more than it saves on those.
#[cfg(not(any(test, fuzzing)))]
const STREAM_ALONE: usize = 32;
#[cfg(any(test, fuzzing))]
const STREAM_ALONE: usize = 2;

/// Decode the base64 at the start of a JSON string's content (`text` starts just after the
/// opening quote and runs to the end of the document) into `out`, finding the closing quote in
/// the same pass: each step decodes a whole chunk, and only the chunk the decoder refuses (the
/// one holding the quote) is searched for it. So every byte of a large value is read once,
/// where a scan for the quote and then a decode would read it twice. Past the first few steps,
/// a long string's chunks are dealt out to the machine's cores (`parallel::threads_for`), each
/// written to its own place in `out` (a full chunk always decodes to 3/4 of its length); a
/// refusal stops every thread at that chunk, so at most a chunk per thread is decoded past the
/// string's end.
///
/// As strict as [`decode_into`]: a full chunk must decode to exactly 3/4 of its length (white
/// space, which the decoder would skip, and padding both make it shorter), and the last piece
/// must be base64 characters and padding only, decoding to [`decoded_len`] bytes.
pub(crate) fn decode_string_content(text: &[u8], out: &mut [MaybeUninit<u8>]) -> Streamed {
    let mut chunks = text
        .chunks_exact(STREAM_CHUNK)
        .zip(out.chunks_exact_mut(STREAM_OUT));
    // The first refused (or missing) full chunk: the string's last piece starts there.
    let mut stop = 0;
    for (t, o) in chunks.by_ref().take(STREAM_ALONE) {
        if decode_piece(t, o) != Some(STREAM_OUT) {
            return last_piece(text, out, stop);
        }
        stop += 1;
    }
    let rest: Vec<_> = chunks.collect();
    if !rest.is_empty() {
        stop = decode_spread(rest, stop);
    }
    last_piece(text, out, stop)
}

/// A full chunk of text, its number and its place in the output.
type Numbered<'t, 'o> = (usize, &'t [u8], &'o mut [MaybeUninit<u8>]);

/// Decode the full chunks `chunks` (numbered from `first`) on as many threads as they are worth;
/// return the number of the first one refused, or the one after the last.
fn decode_spread(chunks: Vec<(&[u8], &mut [MaybeUninit<u8>])>, first: usize) -> usize {
    let end = first + chunks.len();
    let threads = crate::kernels::parallel::threads_for(chunks.len() * STREAM_CHUNK);
    let mut dealt: Vec<Vec<Numbered>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, (t, o)) in chunks.into_iter().enumerate() {
        dealt[i % threads].push((first + i, t, o));
    }
    let refused = AtomicUsize::new(end);
    crate::kernels::parallel::each(dealt, |mine| {
        for (n, t, o) in mine {
            if n >= refused.load(Ordering::Relaxed) {
                break;
            }
            if decode_piece(t, o) != Some(STREAM_OUT) {
                refused.fetch_min(n, Ordering::Relaxed);
                break;
            }
        }
    });
    // Every chunk before the first refused one was decoded: each thread takes its chunks in
    // order and stops only at or past a refused one. (The threads have been joined.)
    refused.into_inner()
}

/// The end of the string, in the chunk numbered `n` (every one before it decoded in full).
fn last_piece(text: &[u8], out: &mut [MaybeUninit<u8>], n: usize) -> Streamed {
    let plain = n * STREAM_CHUNK;
    // One byte past the chunk too: a chunk that ends in padding is refused (it decodes short)
    // though its string ends just after it.
    let chunk = &text[plain..text.len().min(plain + STREAM_CHUNK + 1)];
    let from = (n * STREAM_OUT).min(out.len());
    let room = &mut out[from..];
    let Some(i) = crate::kernels::strscan::find_special(chunk) else {
        return Streamed::Stopped { plain };
    };
    let last = &chunk[..i];
    let in_alphabet = last.iter().all(|&c| is_alphabet(c) || c == b'=');
    if chunk[i] != b'"' || !in_alphabet {
        return Streamed::Stopped { plain };
    }
    let want = match decoded_len(last, "data") {
        Ok(n) if n <= room.len() => n,
        _ => return Streamed::Stopped { plain },
    };
    match decode_piece(last, room) {
        Some(written) if written == want => Streamed::Decoded {
            end: plain + i,
            written: n * STREAM_OUT + written,
        },
        _ => Streamed::Stopped { plain },
    }
}

/// Decode `text` into the start of `out` (strict, as [`decode_into`]): the count written, or
/// `None` when the decoder refuses the text or `out` could be overrun. Padding or white space
/// inside `text` only shows in the count, which the caller checks.
pub(crate) fn decode_piece(text: &[u8], out: &mut [MaybeUninit<u8>]) -> Option<usize> {
    if text.is_empty() {
        return Some(0);
    }
    // SAFETY: `text` is valid for reads of its length.
    let room = unsafe { simdutf::maximal_binary_length_from_base64(text.as_ptr(), text.len()) };
    if room > out.len() {
        return None;
    }
    // SAFETY: `text` is valid for reads of its length; `out` is valid for writes of at least
    // the maximal length the decoder may write (checked just above); they do not overlap (one
    // is borrowed shared, the other exclusively). Writing initialises the bytes written.
    let r = unsafe {
        simdutf::base64_to_binary(
            text.as_ptr(),
            text.len(),
            out.as_mut_ptr().cast::<u8>(),
            simdutf::Base64Options::Default,
            simdutf::LastChunkHandlingOptions::Strict,
        )
    };
    (r.error == simdutf::ErrorCode::Success).then_some(r.count)
}

/// Check that `text` would decode, without decoding it (for splicing base64 text as is).
pub(crate) fn check(text: &[u8], field: &str) -> Result<()> {
    decoded_len(text, field)?;
    STANDARD.check(text).map_err(|_| invalid(text, field))
}

/// Whether `text` (whole 4-character groups) is valid base64 on its own, without decoding it.
/// Padding is allowed only where the text ends its value (`last`): a chunk cut from the middle
/// must not end in `=`, which would otherwise pass as that chunk's padding.
pub(crate) fn groups_valid(text: &[u8], last: bool) -> bool {
    text.len() % 4 == 0 && (last || text.last() != Some(&b'=')) && STANDARD.check(text).is_ok()
}

/// [`groups_valid`] for text cut from a value whose whole content a scan found to be base64
/// characters then at most two `=` (`jsonscan::Str::base64`): only the length, and the last
/// group where the text ends in padding, are left to check.
pub(crate) fn groups_valid_scanned(text: &[u8], last: bool) -> bool {
    if text.len() % 4 != 0 {
        return false;
    }
    match text.len().checked_sub(4) {
        Some(group) if text[text.len() - 1] == b'=' => {
            last && STANDARD.check(&text[group..]).is_ok()
        }
        _ => true,
    }
}

/// Copy base64 `text` (whole groups, cut from a value the scan found to be base64 characters:
/// [`groups_valid_scanned`]) into `out`, of the same length, split among the machine's cores as
/// [`copy_checked`] is: only its length and padding are checked. `false`: not valid there, and
/// nothing is written.
pub(crate) fn copy_scanned(text: &[u8], out: &mut [MaybeUninit<u8>], last: bool) -> bool {
    assert_eq!(text.len(), out.len(), "copy_scanned: unequal lengths");
    if !groups_valid_scanned(text, last) {
        return false;
    }
    crate::kernels::parallel::over_pairs(text, out, (CHECK_CHUNK, CHECK_CHUNK), |_, t, o| {
        write_uninit(o, t);
        true
    })
}

/// Base64 is checked this many characters at a time as it is copied (a multiple of 4, small
/// enough to stay in L1 between the check and the copy).
const CHECK_CHUNK: usize = 16 * 1024;

/// Copy base64 `text` (whole groups) into `out`, of the same length, checking it as it is
/// copied (chunk by chunk, so the text is read once); padding is allowed only at its end, when
/// it ends its value (`last`, as [`groups_valid`]). Large texts are split among the machine's
/// cores. `false`: the text is not valid base64 there, and `out` is partly written.
pub(crate) fn copy_checked(text: &[u8], out: &mut [MaybeUninit<u8>], last: bool) -> bool {
    assert_eq!(text.len(), out.len(), "copy_checked: unequal lengths");
    let unit = (CHECK_CHUNK, CHECK_CHUNK);
    crate::kernels::parallel::over_pairs(text, out, unit, |last_part, t, o| {
        let chunks = t.len().div_ceil(CHECK_CHUNK);
        t.chunks(CHECK_CHUNK)
            .zip(o.chunks_mut(CHECK_CHUNK))
            .enumerate()
            .all(|(j, (chunk, o))| {
                let valid = groups_valid(chunk, last && last_part && j + 1 == chunks);
                if valid {
                    write_uninit(o, chunk);
                }
                valid
            })
    })
}

/// The error the decoding path reports for `text`, for a part of it found invalid on its own:
/// `check`'s verdict on the whole text (the first bad character, bad padding), else `invalid`'s.
pub(crate) fn error_in(text: &[u8], field: &str) -> Error {
    check(text, field)
        .err()
        .unwrap_or_else(|| invalid(text, field))
}

/// A vector of `len` bytes written by `fill`, which must write all of them unless it fails
/// (then nothing is returned and nothing uninitialised is ever read).
pub(crate) fn try_filled_vec(
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
pub(crate) fn decode_range(text: &[u8], start: usize, end: usize) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    decode_range_into(text, start, end, &mut out)?;
    Ok(out)
}

/// [`decode_range`] appended to `out` (for a caller that decodes block after block into one
/// buffer); on an error, `out` is as it was.
pub(crate) fn decode_range_into(
    text: &[u8],
    start: usize,
    end: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    if start >= end {
        return Ok(());
    }
    let (first, last) = (start / 3 * 4, (end.div_ceil(3) * 4).min(text.len()));
    let groups = text
        .get(first..last)
        .ok_or_else(|| error_in(text, "data"))?;
    let n = decoded_len(groups, "data")?;
    if last < text.len() && n != groups.len() / 4 * 3 {
        return Err(error_in(text, "data"));
    }
    let offset = start - first / 4 * 3;
    if offset + (end - start) > n {
        return Err(error_in(text, "data"));
    }
    let len = out.len();
    out.reserve(n);
    if !decode_uninit(groups, &mut out.spare_capacity_mut()[..n]) {
        return Err(error_in(text, "data"));
    }
    // SAFETY: `decode_uninit` returned true, so it wrote all `n` bytes after the first `len`,
    // within the capacity reserved above.
    unsafe { out.set_len(len + n) };
    // Keep only `[start, end)`: drop the group's bytes before it and after it.
    out.truncate(len + offset + (end - start));
    out.drain(len..len + offset);
    Ok(())
}

/// Bytes decoded at a time by [`decode_range_blocks`]: a multiple of 3, small enough that a
/// block and what the caller makes of it stay in the core's cache.
#[cfg(not(any(test, fuzzing)))]
const RANGE_BLOCK: usize = 3 * 16 * 1024;
/// The tests and the fuzzer take small blocks, so that small values cross block boundaries.
#[cfg(any(test, fuzzing))]
const RANGE_BLOCK: usize = 9;

/// [`decode_range`] handed to `each` a block at a time, each decoded into `scratch` (reused)
/// from the start of its first group, the group's bytes before the block skipped rather than
/// removed (a move of the whole block). Every block but the last is a multiple of 3 bytes.
pub(crate) fn decode_range_blocks(
    text: &[u8],
    from: usize,
    to: usize,
    scratch: &mut Vec<u8>,
    mut each: impl FnMut(&[u8]),
) -> Result<()> {
    let mut at = from;
    while at < to {
        let end = to.min(at.saturating_add(RANGE_BLOCK));
        let group = at / 3 * 3;
        scratch.clear();
        decode_range_into(text, group, end, scratch)?;
        each(&scratch[at - group..]);
        at = end;
    }
    Ok(())
}

/// A character of the standard base64 alphabet (padding `=` aside).
pub(crate) fn is_alphabet(c: u8) -> bool {
    crate::kernels::strscan::is_base64(c)
}

/// Standard padded base64 of `bytes`.
pub(crate) fn encode(bytes: &[u8]) -> Vec<u8> {
    filled_vec(encoded_len(bytes.len()), |out| encode_into(bytes, out))
}

/// A vector of `len` bytes written by `fill`, which must write all of them; nothing is zeroed
/// first (for tens of MB, zeroing is a second pass over every page).
pub(crate) fn filled_vec(len: usize, fill: impl FnOnce(&mut [MaybeUninit<u8>])) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill`'s contract is to initialise all `len` bytes.
    unsafe { out.set_len(len) };
    out
}

/// Copy `src` into the start of `dst` (uninitialised memory); return the rest of `dst`.
pub(crate) fn write_uninit<'a>(
    dst: &'a mut [MaybeUninit<u8>],
    src: &[u8],
) -> &'a mut [MaybeUninit<u8>] {
    let (head, rest) = dst.split_at_mut(src.len());
    // SAFETY: `head` is exactly `src.len()` writable bytes that do not overlap `src`.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), head.as_mut_ptr().cast::<u8>(), src.len())
    };
    rest
}

pub(crate) fn encoded_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// Encode `bytes` into `out` (which may be uninitialised), whose length must be
/// `encoded_len(bytes.len())`. Large inputs are split among the machine's cores at multiples
/// of 3 bytes, where the text splits at multiples of 4 characters with no padding between.
pub(crate) fn encode_into(bytes: &[u8], out: &mut [MaybeUninit<u8>]) {
    assert_eq!(
        out.len(),
        encoded_len(bytes.len()),
        "base64 output of the wrong length"
    );
    let split = crate::kernels::parallel::over_pairs(bytes, out, (3, 4), |_, b, o| {
        encode_part(b, o);
        true
    });
    debug_assert!(split, "encoded_len splits as the bytes do");
}

/// [`encode_into`] of `a` then `b` joined, without joining them: `a`'s whole 3-byte groups,
/// the group that straddles the two, then the rest of `b` (whose groups then line up with the
/// output's). `out` must be `encoded_len(a.len() + b.len())` long.
pub(crate) fn encode_joined_into(a: &[u8], b: &[u8], out: &mut [MaybeUninit<u8>]) {
    let whole = a.len() / 3 * 3;
    let left = a.len() - whole;
    let fill = ((3 - left) % 3).min(b.len());
    let mut straddle = [0u8; 3];
    straddle[..left].copy_from_slice(&a[whole..]);
    straddle[left..left + fill].copy_from_slice(&b[..fill]);
    let (head, rest) = out.split_at_mut(encoded_len(whole));
    let (middle, tail) = rest.split_at_mut(encoded_len(left + fill));
    encode_into(&a[..whole], head);
    // The straddling group is short only when `b` ends inside it: then `tail` is empty, and
    // its padding is the text's end, as in the joined encoding.
    encode_into(&straddle[..left + fill], middle);
    encode_into(&b[fill..], tail);
}

/// [`encode_into`] on this thread.
pub(crate) fn encode_part(bytes: &[u8], out: &mut [MaybeUninit<u8>]) {
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
mod tests;
