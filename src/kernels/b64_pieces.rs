//! Base64 in pieces: a strict decoder of a JSON string's content fed in arbitrary pieces (it
//! finds the closing quote itself, so an escaped quote never ends the string), and an encoder
//! that carries the 0-2 bytes of an unfinished group from one piece to the next.
//! Used by the streaming merge (`response::streaming`), whose events pass in pieces.

use super::b64;

/// Why a string's content is not strict, canonical base64 (the caller adds where).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum B64Error {
    /// A character outside `A-Z a-z 0-9 + /` (after JSON unescaping), or padding in the middle.
    Character,
    /// A length that is not whole 4-character groups.
    Length,
    /// An escape that is not JSON, or a raw control character.
    Json,
}

/// What [`B64In::feed`] did with a piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fed {
    /// All of the piece was content; the string goes on.
    More,
    /// The closing quote is at this offset of the piece (the rest is after the string).
    End(usize),
}

/// A partial JSON escape (`\` seen, or `\u` and some hex digits).
#[derive(Debug, Clone, Copy, Default)]
struct Escape {
    active: bool,
    /// The bytes after the backslash so far (`u` and up to 4 hex digits).
    seq: [u8; 5],
    len: usize,
}

/// Strict base64 decoding of a JSON string's content, piece by piece: the same verdict as
/// unescaping the whole string and decoding it strictly (standard alphabet, `=` only in the
/// last group, zero padding bits, no white space).
#[derive(Debug, Default)]
pub(crate) struct B64In {
    /// Characters of a group not yet complete.
    group: [u8; 4],
    n: usize,
    /// A padded group was decoded: only the closing quote may follow.
    padded: bool,
    escape: Escape,
    /// Bytes decoded so far.
    pub(crate) decoded: u64,
    /// Characters of content so far (after unescaping).
    pub(crate) chars: u64,
}

impl B64In {
    /// Decode the content in `piece` onto `out`, up to the closing quote if it is in the piece.
    pub(crate) fn feed(&mut self, piece: &[u8], out: &mut Vec<u8>) -> Result<Fed, B64Error> {
        let mut i = 0;
        while i < piece.len() {
            if self.escape.active {
                self.escape_byte(piece[i], out)?;
                i += 1;
                continue;
            }
            let run_end = memchr2(b'"', b'\\', &piece[i..]).map_or(piece.len(), |j| i + j);
            self.run(&piece[i..run_end], out)?;
            i = run_end;
            match piece.get(i) {
                Some(b'"') => {
                    self.end()?;
                    return Ok(Fed::End(i));
                }
                Some(_) => {
                    self.escape = Escape {
                        active: true,
                        ..Escape::default()
                    };
                    i += 1;
                }
                None => {}
            }
        }
        Ok(Fed::More)
    }

    /// The string ended: what is left must be nothing (whole groups).
    fn end(&mut self) -> Result<(), B64Error> {
        if self.n != 0 {
            return Err(B64Error::Length);
        }
        Ok(())
    }

    /// Characters without quotes or backslashes.
    fn run(&mut self, mut run: &[u8], out: &mut Vec<u8>) -> Result<(), B64Error> {
        if run.is_empty() {
            return Ok(());
        }
        if self.padded {
            return Err(B64Error::Character);
        }
        self.chars += run.len() as u64;
        // Complete the partial group first.
        if self.n > 0 {
            let take = (4 - self.n).min(run.len());
            self.group[self.n..self.n + take].copy_from_slice(&run[..take]);
            self.n += take;
            run = &run[take..];
            if self.n < 4 {
                return Ok(());
            }
            self.n = 0;
            let g = self.group;
            self.groups(&g, out)?;
        }
        let whole = run.len() / 4 * 4;
        self.groups(&run[..whole], out)?;
        let rest = &run[whole..];
        self.group[..rest.len()].copy_from_slice(rest);
        self.n = rest.len();
        Ok(())
    }

    /// Whole groups. A group with `=` must be the string's last: it may be followed by nothing.
    fn groups(&mut self, text: &[u8], out: &mut Vec<u8>) -> Result<(), B64Error> {
        if text.is_empty() {
            return Ok(());
        }
        if self.padded {
            return Err(B64Error::Character);
        }
        let (bulk, last) = match memchr::memchr(b'=', text) {
            None => (text, &[][..]),
            Some(p) => {
                let g = p / 4 * 4;
                if g + 4 != text.len() {
                    return Err(B64Error::Character); // padding before the last group
                }
                (&text[..g], &text[g..])
            }
        };
        let want = bulk.len() / 4 * 3;
        if decode_strict(bulk, out)? != want {
            return Err(B64Error::Character); // white space, which simdutf would skip
        }
        self.decoded += want as u64;
        if !last.is_empty() {
            // `xx==` or `xxx=`: every character checked here, as simdutf forgives white space.
            let pad = last.iter().rev().take_while(|&&c| c == b'=').count();
            if pad > 2 || !last[..4 - pad].iter().all(|&c| is_alphabet(c)) {
                return Err(B64Error::Character);
            }
            if decode_strict(last, out)? != 3 - pad {
                return Err(B64Error::Character);
            }
            self.decoded += (3 - pad) as u64;
            self.padded = true;
        }
        Ok(())
    }

    /// One byte of an escape sequence.
    fn escape_byte(&mut self, c: u8, out: &mut Vec<u8>) -> Result<(), B64Error> {
        let e = &mut self.escape;
        e.seq[e.len] = c;
        e.len += 1;
        let decoded = match e.seq[0] {
            b'/' => b'/',
            // Every other short escape decodes to a character that is not base64.
            b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't' => return Err(B64Error::Character),
            b'u' if e.len < 5 => {
                if e.len > 1 && !c.is_ascii_hexdigit() {
                    return Err(B64Error::Json);
                }
                return Ok(());
            }
            b'u' => {
                if !c.is_ascii_hexdigit() {
                    return Err(B64Error::Json);
                }
                let hex = std::str::from_utf8(&e.seq[1..5]).map_err(|_| B64Error::Json)?;
                let cp = u32::from_str_radix(hex, 16).map_err(|_| B64Error::Json)?;
                // Non-ASCII (or a surrogate) is never base64; JSON validity aside, the value
                // is refused either way.
                match u8::try_from(cp) {
                    Ok(b) if is_alphabet(b) || b == b'=' => b,
                    _ => return Err(B64Error::Character),
                }
            }
            _ => return Err(B64Error::Json),
        };
        self.escape = Escape::default();
        self.run(&[decoded], out)
    }
}

/// Strict base64 decode of whole groups onto `out`; the count written.
fn decode_strict(text: &[u8], out: &mut Vec<u8>) -> Result<usize, B64Error> {
    out.reserve(text.len() / 4 * 3 + 3);
    let n = b64::decode_piece(text, out.spare_capacity_mut()).ok_or(B64Error::Character)?;
    if n > text.len() / 4 * 3 {
        return Err(B64Error::Character);
    }
    // SAFETY: `decode_piece` initialised the first `n` bytes of the spare capacity.
    unsafe { out.set_len(out.len() + n) };
    Ok(n)
}

use super::b64::is_alphabet;

fn memchr2(a: u8, b: u8, s: &[u8]) -> Option<usize> {
    memchr::memchr2(a, b, s)
}

/// Standard padded base64, written as bytes arrive: whole 3-byte groups at once, the 0-2
/// bytes of an unfinished group carried to the next call.
#[derive(Debug, Default)]
pub(crate) struct B64Out {
    carry: [u8; 3],
    n: usize,
}

impl B64Out {
    /// Encode `bytes` after those taken before, onto `out`.
    pub(crate) fn push(&mut self, mut bytes: &[u8], out: &mut Vec<u8>) {
        if self.n > 0 {
            let take = (3 - self.n).min(bytes.len());
            self.carry[self.n..self.n + take].copy_from_slice(&bytes[..take]);
            self.n += take;
            bytes = &bytes[take..];
            if self.n < 3 {
                return;
            }
            let c = self.carry;
            encode(&c, out);
            self.n = 0;
        }
        let whole = bytes.len() / 3 * 3;
        encode(&bytes[..whole], out);
        let rest = &bytes[whole..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.n = rest.len();
    }

    /// Bytes of an unfinished group it holds (0-2).
    pub(crate) fn held(&self) -> usize {
        self.n
    }

    /// The last, padded group.
    pub(crate) fn finish(&mut self, out: &mut Vec<u8>) {
        let c = self.carry;
        encode(&c[..self.n], out);
        self.n = 0;
    }
}

/// Append the base64 of `bytes` (padded) to `out`.
pub(crate) fn encode(bytes: &[u8], out: &mut Vec<u8>) {
    let len = b64::encoded_len(bytes.len());
    out.reserve(len);
    b64::encode_part(bytes, &mut out.spare_capacity_mut()[..len]);
    // SAFETY: `encode_part` wrote all `len` bytes of the spare capacity (it asserts the
    // length it is given is the encoded length, which it fills).
    unsafe { out.set_len(out.len() + len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &[u8], cut: usize) -> Result<Vec<u8>, B64Error> {
        let mut d = B64In::default();
        let mut out = Vec::new();
        let mut t = text.to_vec();
        t.push(b'"');
        let (a, b) = t.split_at(cut.min(text.len()));
        assert_eq!(d.feed(a, &mut out)?, Fed::More);
        assert_eq!(d.feed(b, &mut out)?, Fed::End(b.len() - 1));
        assert_eq!(d.decoded, out.len() as u64);
        Ok(out)
    }

    #[test]
    fn decodes_as_the_whole_text_does() {
        for (text, want) in [
            (&b"CgsUFR4f"[..], Ok(vec![10, 11, 20, 21, 30, 31])),
            (b"AAAAAAAAKCk=", Ok(vec![0, 0, 0, 0, 0, 0, 40, 41])),
            (b"LAEHAA==", Ok(vec![44, 1, 7, 0])),
            (b"Cgs\\/FA==", Ok(vec![10, 11, 63, 20])),
            (b"Cgs\\u002fFA==", Ok(vec![10, 11, 63, 20])),
            (b"", Ok(vec![])),
            (b"LAEHAA=", Err(B64Error::Length)),
            (b"LAEHAB==", Err(B64Error::Character)), // non-zero padding bits
            (b"LA==LAEH", Err(B64Error::Character)),
            (b"LA E", Err(B64Error::Character)),
            (b"LA\\nE", Err(B64Error::Character)),
            (b"LA-E", Err(B64Error::Character)),
        ] {
            for cut in 0..=text.len() {
                assert_eq!(
                    whole(text, cut),
                    want,
                    "{:?} cut {cut}",
                    String::from_utf8_lossy(text)
                );
            }
        }
    }

    #[test]
    fn encodes_as_one_call_does() {
        let bytes: Vec<u8> = (0..50u8).map(|i| i.wrapping_mul(77)).collect();
        let mut want = Vec::new();
        encode(&bytes, &mut want);
        for a in 0..bytes.len() {
            for b in a..bytes.len() {
                let (mut e, mut out) = (B64Out::default(), Vec::new());
                e.push(&bytes[..a], &mut out);
                e.push(&bytes[a..b], &mut out);
                e.push(&bytes[b..], &mut out);
                e.finish(&mut out);
                assert_eq!(out, want);
            }
        }
    }
}
