//! A single-pass JSON scanner that finds values by key without building a DOM. Strings, the
//! bulk of routing payloads, are skipped with SIMD `memchr2`, so locating a 30 MB base64 value
//! costs about as much as reading it once. Small values are handed to serde_json.
//!
//! It checks the grammar of structure, numbers, literals and escapes, and that strings are UTF-8
//! with no raw control characters: the JSON `json.loads` accepts (bytes outside strings are
//! grammar, so ASCII, by construction).

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;

use super::buffer::AlignedBytes;
use super::predecoded::Predecoded;
use super::runs::Base64Runs;
use crate::error::{Error, ErrorKind, Result};
use crate::kernels::b64::Streamed;

/// Deeper nesting is refused rather than risking the stack.
const MAX_DEPTH: usize = 128;

pub(crate) struct Scanner<'a> {
    buf: &'a [u8],
    pos: usize,
    depth: usize,
    what: &'static str,
    /// Where the scanner is: one segment per enclosing object member or array item.
    path: Vec<Seg>,
    /// Keys that must not appear in any object `value` skips (see `watch`).
    watched: Option<Watch>,
    /// Long base64 runs of `buf` found as it arrived (`with_runs`), so `base64_text` need not
    /// scan them again.
    /// (A copy: a few ranges, so the walk's result borrows the body alone.)
    runs: Option<Base64Runs>,
    /// Strings of `buf` held decoded by a reader of the body as it arrived (`with_predecoded`).
    predecoded: Option<&'a Predecoded>,
}

/// Keys a caller reads only at places it walks itself: `matches` picks them out, `what` names
/// them in the error (e.g. "routing-like").
#[derive(Clone, Copy)]
pub(crate) struct Watch {
    pub(crate) matches: fn(&[u8]) -> bool,
    pub(crate) what: &'static str,
}

/// One step of a path: an object member (its key's raw content) or an array item.
#[derive(Debug, Clone)]
enum Seg {
    Key(Range<usize>),
    Index(usize),
}

/// A string value: the range of its content (without quotes) and whether it holds escapes.
#[derive(Debug, Clone)]
pub(crate) struct Str {
    pub(crate) content: Range<usize>,
    pub(crate) escaped: bool,
    /// The content is base64 characters then at most two `=` (read by
    /// [`Scanner::base64_text`]): valid base64 once its length and padding are.
    pub(crate) base64: bool,
}

impl<'a> Scanner<'a> {
    /// `what` names the document in error messages ("response body", "sidecar").
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Scanner {
            buf,
            pos: 0,
            depth: 0,
            what,
            path: Vec::new(),
            watched: None,
            runs: None,
            predecoded: None,
        }
    }

    /// Take the strings a [`BodyReader`](crate::response::BodyReader) decoded as the body
    /// arrived: [`Scanner::predecoded_string`] hands them out where their placeholders are.
    pub(crate) fn with_predecoded(mut self, predecoded: Option<&'a Predecoded>) -> Self {
        self.predecoded = predecoded;
        self
    }

    /// The bytes of the decoded string whose placeholder is next, read past it; `None` (nothing
    /// read) where the next value is not one.
    pub(crate) fn predecoded_string(&mut self) -> Result<Option<AlignedBytes>> {
        let Some(predecoded) = self.predecoded else {
            return Ok(None);
        };
        self.ws(); // the quote a placeholder is found by comes after any white space
        let Some(bytes) = predecoded.at(self.pos) else {
            return Ok(None);
        };
        // A placeholder is a quote, a raw control byte (so no JSON text can be one), digits
        // and a quote: stepped over, not read as JSON.
        let close = memchr::memchr(b'"', &self.buf[self.pos + 1..])
            .ok_or_else(|| self.error("a placeholder's closing quote"))?;
        self.pos += close + 2;
        Ok(Some(bytes))
    }

    /// Take the base64 runs found in `buf` as it arrived: `base64_text` ends a string whose run
    /// is known there without scanning it. Ignored unless `runs` scanned all of `buf` (and
    /// nothing more).
    pub(crate) fn with_runs(mut self, runs: Option<&Base64Runs>) -> Self {
        self.runs = runs.filter(|r| r.scanned() == self.buf.len()).cloned();
        self
    }

    /// Make the keys `watch` matches an error wherever `value` (or `skip_member`) skips them:
    /// for keys whose every legitimate place the caller walks itself, so that one anywhere else
    /// is never ignored.
    pub(crate) fn watch(mut self, watch: Watch) -> Self {
        self.watched = Some(watch);
        self
    }

    /// Whether `key` is watched.
    pub(crate) fn is_watched(&self, key: &[u8]) -> bool {
        self.watched.is_some_and(|w| (w.matches)(key))
    }

    /// Skip the value of the member `key` that the caller does not read: a watched key is an
    /// error naming its path.
    pub(crate) fn skip_member(&mut self, key: &[u8]) -> Result<()> {
        if self.is_watched(key) {
            return Err(self.unexpected_watched(key));
        }
        self.value().map(drop)
    }

    /// The current path, e.g. `$.choices[0].logprobs`.
    pub(crate) fn path(&self) -> String {
        self.format_path(&self.path)
    }

    fn format_path(&self, segs: &[Seg]) -> String {
        let mut out = String::from("$");
        for seg in segs {
            match seg {
                Seg::Index(i) => out.push_str(&format!("[{i}]")),
                Seg::Key(r) => {
                    let raw = Str {
                        content: r.clone(),
                        escaped: self.buf[r.clone()].contains(&b'\\'),
                        base64: false,
                    };
                    let key = self
                        .string_value(&raw)
                        .unwrap_or(Cow::Borrowed(&self.buf[r.clone()]));
                    out.push('.');
                    out.push_str(&String::from_utf8_lossy(&key));
                }
            }
        }
        out
    }

    /// `key` (the member being read) appears a second time in one object.
    pub(crate) fn duplicate(&self, key: &[u8]) -> Error {
        let at = self.format_path(&self.path[..self.path.len().saturating_sub(1)]);
        let kind = ErrorKind::Json {
            at: self.pos,
            expected: "each key once in an object".to_string(),
        };
        Error::new(
            kind,
            format!(
                "{}: duplicate key `{}` in the object at {at} (JSON readers disagree on which \
             to keep, so neither is taken)",
                self.what,
                String::from_utf8_lossy(key)
            ),
        )
    }

    pub(crate) fn buf(&self) -> &'a [u8] {
        self.buf
    }

    /// The byte offset the scanner has reached.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn error(&self, expected: &str) -> Error {
        let found = match self.buf.get(self.pos) {
            None => "the end of the input".to_string(),
            Some(c) if c.is_ascii_graphic() => format!("{:?}", *c as char),
            Some(c) => format!("byte 0x{c:02x}"),
        };
        let kind = ErrorKind::Json {
            at: self.pos,
            expected: expected.to_string(),
        };
        Error::new(
            kind,
            format!(
                "{}: invalid JSON at byte {}: expected {expected}, got {found}",
                self.what, self.pos
            ),
        )
    }

    pub(crate) fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.buf.get(self.pos) {
            self.pos += 1;
        }
    }

    /// The next non-space byte, not consumed.
    pub(crate) fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.buf.get(self.pos).copied()
    }

    fn eat(&mut self, c: u8, expected: &str) -> Result<()> {
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(expected))
        }
    }

    /// Only white space may follow the document.
    pub(crate) fn end(&mut self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.error("the end of the document")),
        }
    }

    /// A string (the opening quote is next). Its content must be UTF-8 with no raw control
    /// characters (what `json.loads` accepts): the search for the closing quote stops at any
    /// byte that is not printable ASCII too (`strscan`), so the check costs no second pass.
    pub(crate) fn string(&mut self) -> Result<Str> {
        self.eat(b'"', "a string")?;
        self.string_from(self.pos)
    }

    /// A string (the opening quote is next) expected to hold base64 text, read as `string`
    /// reads it, by a scan that checks the base64 alphabet as it looks for the end
    /// (`strscan::base64_run`): when the content is base64 characters then at most two `=`,
    /// [`Str::base64`] says so, and that text needs no second pass to be checked.
    pub(crate) fn base64_text(&mut self) -> Result<Str> {
        self.eat(b'"', "a string")?;
        let start = self.pos;
        let run = match self.runs.as_ref().and_then(|r| r.run_from(start)) {
            Some(end) => end,
            None => start + crate::kernels::strscan::base64_run(&self.buf[start..]),
        };
        let mut end = run;
        while end - run < 2 && self.buf.get(end) == Some(&b'=') {
            end += 1;
        }
        if self.buf.get(end) == Some(&b'"') {
            self.pos = end + 1;
            return Ok(Str {
                content: start..end,
                escaped: false,
                base64: true,
            });
        }
        // Base64 characters are printable ASCII, neither quotes nor escapes: `string_from`
        // goes on from the end of the run.
        self.pos = run;
        self.string_from(start)
    }

    /// A string (the opening quote is next) whose content is decoded as base64 into `out` in
    /// the same pass that finds its end (`b64::decode_string_content`): the string as `string`
    /// reads it, with the count of bytes written when all of its content was strict base64 and
    /// fit. Otherwise (`None`), nothing in `out` may be used, and the string is still read and
    /// checked exactly as `string` does, from where decoding stopped.
    pub(crate) fn base64_string(
        &mut self,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<(Str, Option<usize>)> {
        self.eat(b'"', "a string")?;
        let start = self.pos;
        match crate::kernels::b64::decode_string_content(&self.buf[start..], out) {
            Streamed::Decoded { end, written } => {
                self.pos = start + end + 1;
                let content = start..start + end;
                Ok((
                    Str {
                        content,
                        escaped: false,
                        base64: false,
                    },
                    Some(written),
                ))
            }
            Streamed::Stopped { plain } => {
                // The first `plain` bytes are base64 characters: no quote, escape or byte that
                // needs the full check among them.
                self.pos = start + plain;
                Ok((self.string_from(start)?, None))
            }
        }
    }

    /// The rest of a string whose content starts at `start`, read up to `self.pos` already
    /// (printable ASCII without quotes or escapes up to there).
    fn string_from(&mut self, start: usize) -> Result<Str> {
        let mut escaped = false;
        let mut plain = true; // every byte so far printable ASCII
        loop {
            let rest = &self.buf[self.pos..];
            // Once the content needs the full check anyway, only quotes and escapes matter.
            let next = if plain {
                crate::kernels::strscan::find_special(rest)
            } else {
                memchr::memchr2(b'"', b'\\', rest)
            };
            let Some(i) = next else {
                self.pos = self.buf.len();
                return Err(self.error("the end of a string"));
            };
            self.pos += i;
            match self.buf[self.pos] {
                b'"' => {
                    self.pos += 1;
                    let content = start..self.pos - 1;
                    if !plain {
                        self.check_text(content.clone())?;
                    }
                    return Ok(Str {
                        content,
                        escaped,
                        base64: false,
                    });
                }
                b'\\' => {}
                _ => {
                    // Not printable ASCII: checked as a whole once the string ends.
                    plain = false;
                    self.pos += 1;
                    continue;
                }
            }
            escaped = true;
            self.pos += 1;
            match self.buf.get(self.pos) {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.pos += 1,
                Some(b'u')
                    if self
                        .buf
                        .get(self.pos + 1..self.pos + 5)
                        .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) =>
                {
                    self.pos += 5
                }
                _ => return Err(self.error("a valid escape")),
            }
        }
    }

    /// The slow path of `string`, for content that is not all printable ASCII: name the first
    /// raw control character or the first byte that is not UTF-8.
    fn check_text(&mut self, content: Range<usize>) -> Result<()> {
        let text = &self.buf[content.clone()];
        if let Some(i) = text.iter().position(|&c| c < 0x20) {
            self.pos = content.start + i;
            return Err(self.error("a control character escaped (raw ones are not JSON)"));
        }
        if let Err(e) = std::str::from_utf8(text) {
            self.pos = content.start + e.valid_up_to();
            return Err(self.error("UTF-8 text"));
        }
        Ok(())
    }

    /// A string's value: borrowed when it has no escapes.
    pub(crate) fn string_value(&self, s: &Str) -> Result<Cow<'a, [u8]>> {
        let raw = &self.buf[s.content.clone()];
        if !s.escaped {
            return Ok(Cow::Borrowed(raw));
        }
        let quoted = &self.buf[s.content.start - 1..s.content.end + 1];
        let text: String = serde_json::from_slice(quoted)
            .map_err(|e| Error::malformed(format!("{}: invalid JSON string: {e}", self.what)))?;
        Ok(Cow::Owned(text.into_bytes()))
    }

    /// Skip any value; return its byte range.
    pub(crate) fn value(&mut self) -> Result<Range<usize>> {
        let start = match self.peek() {
            Some(_) => self.pos,
            None => return Err(self.error("a value")),
        };
        match self.buf[self.pos] {
            b'"' => {
                self.string()?;
            }
            b'{' => self.object(|s, key| s.skip_member(key))?,
            b'[' => self.array(|s, _| s.value().map(drop))?,
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            b'-' | b'0'..=b'9' => self.number()?,
            _ => return Err(self.error("a value")),
        }
        Ok(start..self.pos)
    }

    /// A watched key (the member being read) at a place the caller does not read it from.
    pub(crate) fn unexpected_watched(&self, key: &[u8]) -> Error {
        let what = self.watched.map_or("watched", |w| w.what);
        Error::new(
            ErrorKind::Unplaced,
            format!(
            "{}: a {what} key `{}` at {}, a place where it is not read (never ignored: routing \
             that is not found must not pass as none)",
            self.what,
            String::from_utf8_lossy(key),
            self.path()
        ),
        )
    }

    fn literal(&mut self, word: &[u8]) -> Result<()> {
        if self.buf[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error(std::str::from_utf8(word).unwrap_or("a literal")))
        }
    }

    fn digits(&mut self) -> usize {
        let n = self.buf[self.pos..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        self.pos += n;
        n
    }

    fn number(&mut self) -> Result<()> {
        if self.buf[self.pos] == b'-' {
            self.pos += 1;
        }
        match self.buf.get(self.pos) {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.error("a digit")),
        }
        if self.buf.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.error("a digit after '.'"));
            }
        }
        if let Some(b'e' | b'E') = self.buf.get(self.pos) {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.buf.get(self.pos) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("a digit in the exponent"));
            }
        }
        Ok(())
    }

    fn enter(&mut self) -> Result<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            let kind = ErrorKind::Json {
                at: self.pos,
                expected: format!("nesting of at most {MAX_DEPTH} levels"),
            };
            return Err(Error::new(
                kind,
                format!("{}: JSON nested deeper than {MAX_DEPTH} levels", self.what),
            ));
        }
        Ok(())
    }

    /// Walk an object; `on_key` gets each key (unescaped) and must consume its value.
    pub(crate) fn object(
        &mut self,
        mut on_key: impl FnMut(&mut Self, &[u8]) -> Result<()>,
    ) -> Result<()> {
        self.eat(b'{', "an object")?;
        self.enter()?;
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(());
        }
        loop {
            let key = self.string()?;
            let raw = key.content.clone();
            let key = self.string_value(&key)?;
            self.eat(b':', "':' after a key")?;
            self.path.push(Seg::Key(raw));
            on_key(self, &key)?;
            self.path.pop();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    self.depth -= 1;
                    return Ok(());
                }
                _ => return Err(self.error("',' or '}'")),
            }
        }
    }

    /// Walk an array; `on_item` gets each index and must consume the item.
    pub(crate) fn array(
        &mut self,
        mut on_item: impl FnMut(&mut Self, usize) -> Result<()>,
    ) -> Result<()> {
        self.eat(b'[', "an array")?;
        self.enter()?;
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(());
        }
        let mut i = 0;
        loop {
            self.path.push(Seg::Index(i));
            on_item(self, i)?;
            self.path.pop();
            i += 1;
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    self.depth -= 1;
                    return Ok(());
                }
                _ => return Err(self.error("',' or ']'")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(text: &str) -> bool {
        let mut s = Scanner::new(text.as_bytes(), "test");
        s.value().and_then(|_| s.end()).is_ok()
    }

    #[test]
    fn agrees_with_serde_on_grammar() {
        let cases = [
            r#"{"a":[1,-2.5e3,true,false,null,"x\"\\\/\u00e9"],"b":{}}"#,
            "[]",
            " 0 ",
            r#"{"a":1,}"#,
            "[1,]",
            "01",
            "1.",
            "-",
            r#""\x""#,
            r#"{"a" 1}"#,
            "[1 2]",
            "tru",
            r#""\u12G4""#,
            "{}}",
        ];
        for c in cases {
            let serde_ok = serde_json::from_str::<serde_json::Value>(c).is_ok();
            assert_eq!(valid(c), serde_ok, "{c}");
        }
        assert!(!valid(&"[".repeat(200)));
    }

    #[test]
    fn finds_keys_and_string_spans() {
        let text = br#"{"x":[{"k":"v"}],"data":"QUJD","esc":"a\/b"}"#;
        let mut s = Scanner::new(text, "test");
        let mut seen = Vec::new();
        s.object(|s, key| {
            if key == b"data" || key == b"esc" {
                let st = s.string()?;
                seen.push(s.string_value(&st)?.into_owned());
                Ok(())
            } else {
                s.value().map(drop)
            }
        })
        .unwrap();
        assert_eq!(seen, vec![b"QUJD".to_vec(), b"a/b".to_vec()]);
    }
}
