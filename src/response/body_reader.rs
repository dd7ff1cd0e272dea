//! A response body read as it arrives (format.md §4.1, "read as it arrives"): a rollout that
//! reads a group's answer from the socket a chunk at a time holds each long base64 `data`
//! string decoded (its rows, 3/4 of its text) instead of the answer's text and then its rows.
//!
//! Only the text is changed, never the reading: the body is kept as fed, except that a JSON
//! string after a `"data":` key that grows past [`DECODE_FROM`] characters of strict base64 is
//! decoded as it arrives and left as a short placeholder. The usual walk then reads that
//! skeleton, taking each placeholder's bytes where it finds them (by offset, so no text can
//! pose as one). Anything that walk refuses is read again from the whole text, rebuilt, so the
//! reader answers exactly what [`group_from_response`] answers for the same bytes, errors
//! included.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::mem::MaybeUninit;
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3;

use crate::body::read_body_predecoded;
use crate::error::Result;
use crate::formats::Hints;
use crate::kernels::b64;
use crate::kernels::buffer::AlignedBytes;
use crate::kernels::predecoded::Predecoded;

use super::group::{group_from_response, group_of, Group};

/// A `data` string is decoded as it arrives once it is this long (shorter ones stay text: they
/// cost little, and most short strings are not routing).
pub const DECODE_FROM: usize = 4096;

/// At most this many distinct decoded strings are compared with a new one that shares their
/// length and hash.
const SAME_KEY_MAX: usize = 8;

/// The first byte of a placeholder's content: a raw control byte, which no JSON text may hold
/// in a string (RFC 8259 §7); a body that does anyway is read from its text alone.
const MARK: u8 = 0x01;

/// Where the lexer is.
#[derive(Debug)]
enum Lex {
    /// Between strings; `key`: how far a `"data":` key has been seen just before.
    Between { key: DataKey },
    /// Inside a string kept as text, whose content starts at `start` in the skeleton.
    Text {
        start: usize,
        /// It is a `data` value that may still be decoded.
        candidate: bool,
        /// A backslash began an escape whose next byte is still to come.
        escaping: bool,
        /// An escape was seen (the text is then not base64).
        escaped: bool,
    },
    /// Inside a `data` string decoded as it arrives; its placeholder will start at `start`.
    Base64 {
        start: usize,
        out: AlignedBytes,
        /// Characters not yet decoded: part of a quantum, or a quantum with padding, whose
        /// string must end next.
        tail: Vec<u8>,
        /// `out`'s hash so far, taken as each piece is decoded (while it is in the cache).
        hash: Hasher,
    },
}

/// A decoded string's hash so far (boxed: the hasher's state is half a kB).
struct Hasher(Box<Xxh3>);

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hasher(xxh3)")
    }
}

/// The `"data":` key before a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataKey {
    None,
    /// The string `"data"` just closed.
    Key,
    /// ... and a colon followed it: a string opened now is its value.
    Colon,
}

/// A response body fed a chunk at a time, then read as a group ([`BodyReader::group`]).
///
/// It holds what it was fed, or less: the body's text, each long base64 `data` string as its
/// decoded bytes instead.
#[derive(Debug)]
pub struct BodyReader {
    skeleton: Vec<u8>,
    predecoded: Predecoded,
    /// The placeholders' ids by (length, hash) of their bytes: equal strings share one
    /// placeholder, so values that are the same text stay the same text. The hash (XXH3, at
    /// memory speed where SipHash took twice the decode's time) is seeded at random, and at
    /// most [`SAME_KEY_MAX`] strings are compared under one key, so no body can make the
    /// comparisons quadratic.
    by_content: HashMap<(usize, u64), Vec<usize>>,
    seed: u64,
    /// Every hash is 0 (a test's way to make strings share keys).
    #[cfg(test)]
    colliding: bool,
    /// Each placeholder id's bytes.
    ids: Vec<Arc<AlignedBytes>>,
    lex: Lex,
    /// The skeleton is not read, the whole text is: a `data` string kept as text starts with
    /// [`MARK`], or more than [`SAME_KEY_MAX`] decoded strings share a key.
    read_as_text: bool,
    decode_from: usize,
    max_bytes: usize,
}

impl BodyReader {
    /// A reader that decodes no `data` string into more than `max_bytes` bytes (a longer one
    /// stays text, and reading it gives the limit's error as ever).
    pub fn new(max_bytes: usize) -> Self {
        Self::decoding_from(DECODE_FROM, max_bytes)
    }

    /// [`BodyReader::new`], decoding `data` strings from `decode_from` characters (tests use a
    /// few, to decode small bodies).
    pub fn decoding_from(decode_from: usize, max_bytes: usize) -> Self {
        BodyReader {
            skeleton: Vec::new(),
            predecoded: Predecoded::default(),
            by_content: HashMap::new(),
            seed: RandomState::new().hash_one(0x5eed_u64),
            #[cfg(test)]
            colliding: false,
            ids: Vec::new(),
            lex: Lex::Between { key: DataKey::None },
            read_as_text: false,
            decode_from: decode_from.max(4),
            max_bytes,
        }
    }

    /// The bytes held as text (the body less its decoded strings, and their placeholders).
    pub fn text_bytes(&self) -> usize {
        self.skeleton.len()
            + match &self.lex {
                Lex::Base64 { tail, .. } => tail.len(),
                _ => 0,
            }
    }

    /// The bytes held decoded.
    pub fn decoded_bytes(&self) -> usize {
        let open = match &self.lex {
            Lex::Base64 { out, .. } => out.len(),
            _ => 0,
        };
        self.ids.iter().map(|b| b.len()).sum::<usize>() + open
    }

    /// Take the body's next bytes.
    pub fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            chunk = match std::mem::replace(&mut self.lex, Lex::Between { key: DataKey::None }) {
                Lex::Between { key } => self.between(chunk, key),
                Lex::Text {
                    start,
                    candidate,
                    escaping,
                    escaped,
                } => self.text(chunk, start, candidate, escaping, escaped),
                Lex::Base64 {
                    start,
                    out,
                    tail,
                    hash,
                } => self.base64(chunk, start, out, tail, hash),
            };
        }
    }

    /// Structure between strings: copied, watching for `"data":`.
    fn between<'c>(&mut self, chunk: &'c [u8], mut key: DataKey) -> &'c [u8] {
        let quote = memchr::memchr(b'"', chunk);
        let upto = quote.unwrap_or(chunk.len());
        for &c in &chunk[..upto] {
            key = match (c, key) {
                (b' ' | b'\t' | b'\n' | b'\r', k) => k,
                (b':', DataKey::Key) => DataKey::Colon,
                _ => DataKey::None,
            };
        }
        self.skeleton.extend_from_slice(&chunk[..upto]);
        match quote {
            None => {
                self.lex = Lex::Between { key };
                &[]
            }
            Some(q) => {
                self.skeleton.push(b'"');
                self.lex = Lex::Text {
                    start: self.skeleton.len(),
                    candidate: key == DataKey::Colon,
                    escaping: false,
                    escaped: false,
                };
                &chunk[q + 1..]
            }
        }
    }

    /// A string kept as text: copied to its closing quote, escapes stepped over. A `data`
    /// value that reaches `decode_from` characters of plain text is decoded from then on.
    fn text<'c>(
        &mut self,
        chunk: &'c [u8],
        start: usize,
        candidate: bool,
        mut escaping: bool,
        mut escaped: bool,
    ) -> &'c [u8] {
        // A candidate is looked at no later than at `decode_from` characters, however large the
        // chunk.
        let window = match candidate && !escaped {
            true => chunk.len().min(
                (start + self.decode_from)
                    .saturating_sub(self.skeleton.len())
                    .max(1),
            ),
            false => chunk.len(),
        };
        let mut i = 0;
        let mut close = None;
        while i < window {
            if escaping {
                escaping = false;
                i += 1;
                continue;
            }
            match memchr::memchr2(b'"', b'\\', &chunk[i..window]) {
                None => i = window,
                Some(j) if chunk[i + j] == b'\\' => {
                    (escaping, escaped) = (true, true);
                    i += j + 1;
                }
                Some(j) => {
                    close = Some(i + j);
                    i = window;
                }
            }
        }
        let upto = close.unwrap_or(window);
        self.skeleton.extend_from_slice(&chunk[..upto]);
        if let Some(q) = close {
            let content = &self.skeleton[start..];
            if candidate && content.first() == Some(&MARK) {
                self.read_as_text = true;
            }
            let key = match !escaped && content == b"data" {
                true => DataKey::Key,
                false => DataKey::None,
            };
            self.skeleton.push(b'"');
            self.lex = Lex::Between { key };
            return &chunk[q + 1..];
        }
        let rest = &chunk[upto..];
        // Still a candidate while plain text (no escape, in this chunk either) short of
        // `decode_from`; at it, decoded from here or never.
        let long = self.skeleton.len() - start >= self.decode_from;
        let plain = candidate && !escaped;
        if plain && long {
            if let Some(lex) = self.begin_decoding(start) {
                self.lex = lex;
                return rest;
            }
        }
        let candidate = plain && !long;
        self.lex = Lex::Text {
            start,
            candidate,
            escaping,
            escaped,
        };
        rest
    }

    /// Decode a `data` string's text so far, when it is strict base64; `None` leaves it text.
    fn begin_decoding(&mut self, start: usize) -> Option<Lex> {
        let mut out = AlignedBytes::default();
        let mut tail = Vec::new();
        let text = &self.skeleton[start..];
        push(&mut out, &mut tail, text, false, self.max_bytes).then(|| {
            self.skeleton.truncate(start);
            let mut hash = Hasher(Box::new(Xxh3::with_seed(self.seed)));
            hash.0.update(out.as_bytes());
            Lex::Base64 {
                start,
                out,
                tail,
                hash,
            }
        })
    }

    /// A `data` string being decoded: its text up to the closing quote decoded, the quote
    /// writing its placeholder. Text that is not strict base64 turns it back into text, exactly
    /// as sent, and is read as text from where it began.
    fn base64<'c>(
        &mut self,
        chunk: &'c [u8],
        start: usize,
        mut out: AlignedBytes,
        mut tail: Vec<u8>,
        mut hash: Hasher,
    ) -> &'c [u8] {
        let quote = memchr::memchr(b'"', chunk);
        let segment = &chunk[..quote.unwrap_or(chunk.len())];
        let before = out.len();
        if !push(
            &mut out,
            &mut tail,
            segment,
            quote.is_some(),
            self.max_bytes,
        ) {
            self.back_to_text(start, &out, &tail);
            self.lex = Lex::Text {
                start,
                candidate: false,
                escaping: false,
                escaped: false,
            };
            return chunk; // read again as text, from the segment's start
        }
        hash.0.update(&out.as_bytes()[before..]);
        match quote {
            None => {
                self.lex = Lex::Base64 {
                    start,
                    out,
                    tail,
                    hash,
                };
                &[]
            }
            Some(q) => {
                let hash = self.content_hash(&hash.0);
                self.placeholder(start, out, hash);
                self.lex = Lex::Between { key: DataKey::None };
                &chunk[q + 1..]
            }
        }
    }

    /// The text of a string being decoded, from its content's `start`, back as it was sent:
    /// whole quanta without padding (all `out` holds) re-encode to the characters they came
    /// from, and `tail` is characters not yet decoded.
    fn back_to_text(&mut self, start: usize, out: &AlignedBytes, tail: &[u8]) {
        self.skeleton.truncate(start);
        self.skeleton
            .extend_from_slice(&b64::encode(out.as_bytes()));
        self.skeleton.extend_from_slice(tail);
    }

    /// Write the placeholder of a decoded string (its opening quote at `start - 1`) and close
    /// it; equal bytes share an id, so equal texts stay equal.
    fn placeholder(&mut self, start: usize, out: AlignedBytes, hash: u64) {
        let key = (out.len(), hash);
        let ids = self.by_content.entry(key).or_default();
        let same = ids
            .iter()
            .find(|&&i| self.ids[i].as_bytes() == out.as_bytes())
            .copied();
        let id = match same {
            Some(i) => i,
            None => {
                self.ids.push(Arc::new(out));
                let id = self.ids.len() - 1;
                match ids.len() < SAME_KEY_MAX {
                    true => ids.push(id),
                    // Distinct strings made to share a key: one equal to this string may now
                    // get a placeholder of its own, so the whole text is read instead.
                    false => self.read_as_text = true,
                }
                id
            }
        };
        self.predecoded.insert(start - 1, self.ids[id].clone());
        self.skeleton.push(MARK);
        self.skeleton.extend_from_slice(id.to_string().as_bytes());
        self.skeleton.push(b'"');
    }

    /// The key's hash of a decoded string's bytes, from its hasher.
    fn content_hash(&self, hash: &Xxh3) -> u64 {
        #[cfg(test)]
        if self.colliding {
            return 0;
        }
        hash.digest()
    }

    /// The body fed, read as [`group_from_response`] reads it (the same group, or the same
    /// error).
    pub fn group(mut self, hints: &Hints, max_bytes: usize) -> Result<Group> {
        if let Lex::Base64 { .. } | Lex::Text { .. } = self.lex {
            // A body that ends inside a string: the whole text says how.
            return group_from_response(&self.whole_text(), hints, max_bytes);
        }
        if !self.read_as_text {
            let skeleton = std::mem::take(&mut self.skeleton);
            let read = read_body_predecoded(&skeleton, &self.predecoded)
                .and_then(|found| group_of(found, hints, max_bytes));
            match read {
                Ok(group) => return Ok(group),
                Err(_) => self.skeleton = skeleton,
            }
        }
        group_from_response(&self.whole_text(), hints, max_bytes)
    }

    /// The body as fed: each placeholder back to the base64 text it was decoded from.
    fn whole_text(&mut self) -> Vec<u8> {
        if let Lex::Base64 {
            start, out, tail, ..
        } = std::mem::replace(&mut self.lex, Lex::Between { key: DataKey::None })
        {
            self.back_to_text(start, &out, &tail);
        }
        let at = self.predecoded.in_order();
        let mut whole = Vec::with_capacity(self.skeleton.len());
        let mut from = 0;
        for (quote, bytes) in at {
            let content = quote + 1;
            // `placeholder` closes every one it writes.
            let end = memchr::memchr(b'"', &self.skeleton[content..])
                .map_or(self.skeleton.len(), |n| content + n);
            whole.extend_from_slice(&self.skeleton[from..content]);
            whole.extend_from_slice(&b64::encode(bytes.as_bytes()));
            from = end;
        }
        whole.extend_from_slice(&self.skeleton[from..]);
        whole
    }
}

/// Decode `segment` after `tail` into `out`: every whole quantum, except that the string's last
/// (with padding) is decoded only when `last` says the closing quote follows, and a part
/// quantum waits in `tail`. `false` (nothing changed) for text that is not strict base64 there,
/// or that would decode to more than `max_bytes`.
fn push(
    out: &mut AlignedBytes,
    tail: &mut Vec<u8>,
    segment: &[u8],
    last: bool,
    max_bytes: usize,
) -> bool {
    let (before, held) = (out.len(), tail.clone());
    let done = push_text(out, tail, segment, last, max_bytes);
    if !done {
        out.truncate(before);
        *tail = held;
    }
    done
}

fn push_text(
    out: &mut AlignedBytes,
    tail: &mut Vec<u8>,
    mut segment: &[u8],
    last: bool,
    max_bytes: usize,
) -> bool {
    if !tail.is_empty() {
        // A part quantum is completed; a whole one (padding held back) takes nothing.
        let take = match tail.len() % 4 {
            0 => 0,
            part => (4 - part).min(segment.len()),
        };
        tail.extend_from_slice(&segment[..take]);
        segment = &segment[take..];
        if tail.len() % 4 != 0 {
            return !last; // a part quantum: more text must follow
        }
        if segment.is_empty() && !last && tail.contains(&b'=') {
            return true; // padding: the closing quote must come next
        }
        let quantum = std::mem::take(tail);
        let ok = match segment.is_empty() && last {
            true => final_quantum(out, &quantum, max_bytes),
            false => whole_quanta(out, &quantum, max_bytes),
        };
        if !ok {
            return false;
        }
    }
    let whole = segment.len() / 4 * 4;
    if last {
        if whole != segment.len() {
            return false;
        }
        if whole == 0 {
            return true; // the text ended on a whole quantum without padding
        }
        return whole_quanta(out, &segment[..whole - 4], max_bytes)
            && final_quantum(out, &segment[whole - 4..], max_bytes);
    }
    // A whole last quantum with padding waits for the quote; so does a part quantum.
    let decode = match whole > 0 && segment[whole - 4..whole].contains(&b'=') {
        true => whole - 4,
        false => whole,
    };
    if !whole_quanta(out, &segment[..decode], max_bytes) {
        return false;
    }
    tail.extend_from_slice(&segment[decode..]);
    true
}

/// Decode whole quanta without padding (every character of the alphabet, else `false`).
fn whole_quanta(out: &mut AlignedBytes, text: &[u8], max_bytes: usize) -> bool {
    let n = text.len() / 4 * 3;
    if out
        .len()
        .checked_add(n)
        .is_none_or(|total| total > max_bytes)
    {
        return false;
    }
    // The decoder skips white space and stops at padding: a count short of 3 per 4 characters
    // says the text was not all alphabet (`push` then takes back what was kept).
    // SAFETY: `decode_piece` returns the count it wrote (at most the room's length), having
    // initialised exactly those bytes; nothing is kept when it refuses the text.
    let written =
        unsafe { out.append_written(n, |room| b64::decode_piece(text, room).unwrap_or(0)) };
    written == n
}

/// Decode a string's last quantum, padding allowed, when it is canonical (it re-encodes to
/// itself, so the bytes give back the text).
fn final_quantum(out: &mut AlignedBytes, quantum: &[u8], max_bytes: usize) -> bool {
    let pads = quantum.iter().rev().take_while(|&&c| c == b'=').count();
    if quantum.len() != 4 || pads > 2 {
        return false;
    }
    let mut bytes = [MaybeUninit::<u8>::uninit(); 3];
    let n = 3 - pads;
    if b64::decode_piece(quantum, &mut bytes) != Some(n) {
        return false;
    }
    // SAFETY: the decoder initialised the first `n` bytes (its count).
    let bytes: Vec<u8> = bytes[..n]
        .iter()
        .map(|b| unsafe { b.assume_init() })
        .collect();
    if b64::encode(&bytes) != quantum || out.len() + n > max_bytes {
        return false;
    }
    out.extend_from_slice(&bytes);
    true
}

#[cfg(test)]
mod tests;
