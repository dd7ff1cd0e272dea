//! One event's JSON text, fed in arbitrary pieces, merged with prefill's routing as it passes.
//!
//! The text is split as it comes into what the merge rewrites (each routing value's base64
//! content: decoded, cut, re-encoded, sent on, never held; a compact sidecar out, or with
//! `keep_format` a vLLM `.npy` value as `.npy` text) and the rest (the *skeleton*: the
//! event with those contents emptied, a few hundred bytes, held). When the event ends, the
//! core's own walker reads the skeleton: every JSON check of the whole-event merge (validity,
//! duplicate keys, routing keys elsewhere, token counts, weights) is made by the same code on
//! the same text, the routing values' contents aside, which are checked here as they pass.
//!
//! Nothing is sent until the first routing value has been read far enough to know its merge
//! cannot fail for a reason known then (its header, prefill's rows, the plan); until then
//! anything unusual is [`Step::Fallback`], with every byte fed so far handed back, so the caller
//! merges the whole event as before. After that, a failure is an error and what was sent is a
//! strict prefix of the merged event that lacks at least its closing brace (the text after the
//! last routing value is held until every check has passed), so it never parses as JSON.

use std::ops::Range;

use serde_json::Value;

use super::options::MergeOptions;
use super::prefill_rows::{PrefillRows, PrefillValue};
use super::spliced::Recoded;
use crate::body::coverage;
use crate::body::{is_routing_key, read_body, split, Place, ROUTING_KEY};
use crate::error::{Error, Result};
use crate::formats::sidecar::{self, parse_shape, tail, DATA_KEY};
use crate::formats::{check_hints, npy, Format, Hints, Rule, NPY_B64_PREFIX};
use crate::kernels::b64;
use crate::kernels::b64_pieces::{B64Error, B64In, B64Out, Fed};
use crate::limits;
use crate::payload::dtype::DType;
use crate::payload::merge::{self, Plan};
use crate::payload::{Header, Shape};

/// What to do with a compact sidecar whose `data` comes before its `start` (the canonical key
/// order): decode's start, hence how many of its leading rows prefill covers, is not known
/// while its rows pass, and every row sent after prefill's depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFirst {
    /// Hold the whole event instead (the whole-event merge; no memory saved).
    Fallback,
    /// Merge as though decode's start were this (and its dtype prefill's); check both when
    /// they arrive. A sidecar that states another start or dtype is an error where the
    /// whole-event merge would have merged it: a policy the caller chooses (see the report).
    Expect(u64),
}

/// How an [`EventMerge`] works.
#[derive(Debug, Clone, Copy)]
pub struct StreamOptions {
    /// As for `merge_response`.
    pub merge: MergeOptions,
    /// Sidecars whose data comes before their start.
    pub data_first: DataFirst,
    /// Bytes of the event's text outside its routing data that may be held (before anything
    /// is sent: past it, [`Step::Fallback`]; after: an error). The proxy's `max_line` keeps the
    /// whole-event path's limit.
    pub max_held: usize,
}

/// What [`EventMerge::feed`] and [`EventMerge::finish`] say.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// The event goes on streaming (from `finish`: it was merged, and these are the choices
    /// whose routing it carried, by index).
    Streaming(Vec<u64>),
    /// Nothing was sent: merge the whole event instead. These are all the bytes fed so far;
    /// append the rest of the event and call `merge_response_found` on it.
    Fallback(Vec<u8>),
}

/// Merges one event's JSON text with prefill's routing as it streams (format.md §4): the bytes
/// it sends, concatenated, are exactly what `merge_response_found` makes of the whole text.
pub struct EventMerge<'p> {
    prefill: &'p PrefillRows<'p>,
    opts: StreamOptions,
    /// The event without the contents of the routing data it merges.
    skel: Vec<u8>,
    /// `skel[..sent]` has been sent (or replaced by merged text).
    sent: usize,
    /// Anything was sent: no fallback any more.
    emitted: bool,
    /// An error was returned: the event is over.
    failed: bool,
    stack: Vec<Frame>,
    lex: Lex,
    /// The routing value being merged, and those merged.
    cur: Option<Cur<'p>>,
    done: Vec<DoneValue>,
    /// A `.npy` value's first characters, held until its header is read.
    head: Vec<u8>,
    /// Bytes decoded from the piece at hand.
    scratch: Vec<u8>,
    /// The most bytes this value held at once (its own buffers' capacities).
    peak: usize,
    /// Prefill's rows left to be written as they are sent (`defer_recode`), and where in the
    /// caller's `out` each goes, until [`take_deferred`](EventMerge::take_deferred).
    deferred: Vec<(usize, Recoded<'p>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Top,
    Choices,
    Choice,
    /// The routing value being merged, a compact sidecar.
    Sidecar,
    Other,
}

#[derive(Debug)]
struct Frame {
    obj: bool,
    role: Role,
    /// An object's current member key (unescaped), once read.
    key: Option<Vec<u8>>,
    /// An array's element position, or a choice's position in `choices`.
    pos: u64,
    /// A choice's `index`, once read.
    index: Option<u64>,
    /// A sidecar's members (key, value text in `skel`); `data`'s is its emptied string.
    members: Vec<(Vec<u8>, Range<usize>)>,
    /// Where the current member's value starts in `skel`.
    value_at: usize,
}

impl Frame {
    fn new(obj: bool, role: Role, pos: u64) -> Frame {
        Frame {
            obj,
            role,
            key: None,
            pos,
            index: None,
            members: Vec::new(),
            value_at: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lex {
    /// Between tokens.
    Ws,
    /// In a string the skeleton keeps (its opening quote at `start`); `esc`: after a backslash.
    Str { start: usize, key: bool, esc: bool },
    /// In a number or literal starting at `start`.
    Lit { start: usize },
    /// A `.npy` value's first characters (held in `head`, not in the skeleton).
    NpyHead,
    /// A routing value's base64 content (merged, not held).
    Data,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Npy,
    Sidecar,
}

/// The routing value being merged.
struct Cur<'p> {
    kind: Kind,
    /// Its first byte in the skeleton (what the walker's span starts at).
    at: usize,
    index: u64,
    /// `index` is the choice's `index` key (else its position, prefill having one choice).
    by_index: bool,
    prefill: &'p PrefillValue<'p>,
    dec: B64In,
    enc: B64Out,
    /// Decoded bytes of the value not sent: the `.npy` header, rows prefill covers.
    drop: u64,
    /// Decoded bytes the value must hold, when known before its data.
    total: Option<u64>,
    /// `.npy`: decode's header and the plan, known before the data.
    npy: Option<(Header, Plan)>,
    /// Sidecar: the start and dtype merged under (stated before the data, or expected).
    start: u64,
    dtype: DType,
    data_done: bool,
}

/// A value merged, for the checks at the end.
struct DoneValue {
    at: usize,
    index: u64,
    by_index: bool,
    /// `.npy`: decode's header, held against the body's counts at the end.
    npy_header: Option<Header>,
}

/// Why the event cannot be merged as it streams: a fallback before anything was sent, an error
/// after.
enum Stop {
    Fallback,
    Error(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Error(e)
    }
}

type Flow<T = ()> = std::result::Result<T, Stop>;

/// A `.npy` header longer than this is not streamed (vLLM writes 128 bytes).
const MAX_NPY_HEAD: usize = 64 * 1024;

impl<'p> EventMerge<'p> {
    /// A merge of one event with `prefill`'s routing.
    pub fn new(prefill: &'p PrefillRows<'p>, opts: StreamOptions) -> Self {
        EventMerge {
            prefill,
            opts,
            skel: Vec::new(),
            sent: 0,
            emitted: false,
            failed: false,
            stack: Vec::new(),
            lex: Lex::Ws,
            cur: None,
            done: Vec::new(),
            head: Vec::new(),
            scratch: Vec::new(),
            peak: 0,
            deferred: Vec::new(),
        }
    }

    /// Prefill's rows that the last calls left to be written as they are sent, when the
    /// options' `merge.defer_recode` is on (whole base64 groups of prefill's text, read when
    /// written: nothing the size of prompt's rows is made at once): each with its position in
    /// the `out` its call appended to. The bytes sent are `out` with each part's text
    /// ([`Recoded::write_part`]) put in at its position, the same bytes as without the option.
    pub fn take_deferred(&mut self) -> Vec<(usize, Recoded<'p>)> {
        std::mem::take(&mut self.deferred)
    }

    /// Whether any byte was sent (a failure from here on leaves a partial line to end).
    pub fn emitted(&self) -> bool {
        self.emitted
    }

    /// Bytes held now: the skeleton, a `.npy` head, the decode scratch (capacities).
    pub fn held(&self) -> usize {
        self.skel.capacity() + self.head.capacity() + self.scratch.capacity()
    }

    /// The most bytes held at once so far (see [`held`](Self::held)).
    pub fn peak_held(&self) -> usize {
        self.peak.max(self.held())
    }

    /// Feed the next piece of the event's text; what may be sent is appended to `out`.
    pub fn feed(&mut self, piece: &[u8], out: &mut Vec<u8>) -> Result<Step> {
        if self.failed {
            return Err(Error::inconsistent("the streaming merge already failed"));
        }
        let mark = out.len();
        match self.run(piece, out) {
            Ok(()) => {
                self.peak = self.peak.max(self.held());
                if self.skel.len() + self.head.len() > self.opts.max_held {
                    return self.stop(Stop::Fallback, &[], mark, out);
                }
                Ok(Step::Streaming(Vec::new()))
            }
            Err((stop, at)) => self.stop(stop, &piece[at..], mark, out),
        }
    }

    /// The event ended (after its newline, if the caller feeds it): the checks that need the
    /// whole event, then the rest of the merged text.
    pub fn finish(mut self, out: &mut Vec<u8>) -> Result<Step> {
        if self.failed {
            return Err(Error::inconsistent("the streaming merge already failed"));
        }
        if !self.emitted {
            return Ok(Step::Fallback(self.take_held(&[])));
        }
        let choices = self.check_whole()?;
        out.extend_from_slice(&self.skel[self.sent..]);
        Ok(Step::Streaming(choices))
    }

    /// A fallback becomes an error once something was sent.
    fn stop(&mut self, stop: Stop, rest: &[u8], mark: usize, out: &mut Vec<u8>) -> Result<Step> {
        match stop {
            Stop::Fallback if !self.emitted => {
                out.truncate(mark);
                self.failed = true;
                Ok(Step::Fallback(self.take_held(rest)))
            }
            Stop::Fallback => {
                self.failed = true;
                self.deferred.clear();
                Err(Error::inconsistent(
                    "the event cannot be merged as it streams (unusual text after its routing \
                     was sent; see docs): the stream ends here",
                ))
            }
            Stop::Error(e) => {
                self.failed = true;
                self.deferred.clear();
                Err(e)
            }
        }
    }

    /// Everything fed so far, for the whole-event merge (nothing was sent).
    fn take_held(&mut self, rest: &[u8]) -> Vec<u8> {
        let mut all = std::mem::take(&mut self.skel);
        all.extend_from_slice(&self.head);
        all.extend_from_slice(rest);
        all
    }

    /// Lex the piece; on a stop, where in the piece the unread bytes start.
    fn run(&mut self, piece: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), (Stop, usize)> {
        let mut i = 0;
        while i < piece.len() {
            let kept = self.skel.len();
            i = self.lex_from(piece, i, out).map_err(|s| {
                // The step's bytes are handed back from `i` on: the skeleton keeps those before.
                if matches!(s, Stop::Fallback) {
                    self.skel.truncate(kept);
                }
                (s, i)
            })?;
        }
        Ok(())
    }

    /// Consume from `piece[i..]`; return where to go on.
    fn lex_from(&mut self, piece: &[u8], i: usize, out: &mut Vec<u8>) -> Flow<usize> {
        match self.lex {
            Lex::Data => self.routing_data(piece, i, out),
            Lex::NpyHead => self.npy_head(piece, i, out),
            Lex::Str { start, key, esc } => {
                let rest = &piece[i..];
                if esc {
                    self.skel.push(rest[0]);
                    self.lex = Lex::Str {
                        start,
                        key,
                        esc: false,
                    };
                    return Ok(i + 1);
                }
                match memchr::memchr2(b'"', b'\\', rest) {
                    None => {
                        self.skel.extend_from_slice(rest);
                        Ok(piece.len())
                    }
                    Some(j) => {
                        self.skel.extend_from_slice(&rest[..=j]);
                        if rest[j] == b'\\' {
                            self.lex = Lex::Str {
                                start,
                                key,
                                esc: true,
                            };
                        } else {
                            self.lex = Lex::Ws;
                            if key {
                                self.key_read(start)?;
                            } else {
                                self.value_read(start)?;
                            }
                        }
                        Ok(i + j + 1)
                    }
                }
            }
            Lex::Lit { start } => {
                let c = piece[i];
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r' | b'"') {
                    self.lex = Lex::Ws;
                    self.value_read(start)?;
                    return Ok(i); // the delimiter is read as a token
                }
                self.skel.push(c);
                Ok(i + 1)
            }
            Lex::Ws => {
                let c = piece[i];
                match c {
                    b' ' | b'\t' | b'\n' | b'\r' | b':' => self.skel.push(c),
                    b',' => {
                        self.skel.push(c);
                        if let Some(f) = self.stack.last_mut() {
                            if !f.obj {
                                f.pos += 1;
                            }
                        }
                    }
                    b'}' | b']' => self.close(c, out)?,
                    b'"' if self.expects_key() => {
                        self.lex = Lex::Str {
                            start: self.skel.len(),
                            key: true,
                            esc: false,
                        };
                        self.skel.push(c);
                    }
                    _ => self.value_start(c, out)?,
                }
                Ok(i + 1)
            }
        }
    }

    fn expects_key(&self) -> bool {
        self.stack.last().is_some_and(|f| f.obj && f.key.is_none())
    }

    /// A key was read (its quoted text at `skel[start..]`).
    fn key_read(&mut self, start: usize) -> Flow {
        let raw = &self.skel[start + 1..self.skel.len() - 1];
        let key = if raw.contains(&b'\\') {
            if !self.emitted {
                return Err(Stop::Fallback); // keys with escapes: left to the whole merge
            }
            // Compared unescaped, as the walker compares them.
            serde_json::from_slice::<String>(&self.skel[start..])
                .map(String::into_bytes)
                .unwrap_or_else(|_| raw.to_vec())
        } else {
            raw.to_vec()
        };
        let Some(f) = self.stack.last_mut() else {
            return Ok(());
        };
        // Routing-like keys anywhere but where values are merged: the whole merge decides.
        let ours = (f.role == Role::Choice && key == ROUTING_KEY) || f.role == Role::Sidecar;
        if !ours && is_routing_key(&key) && !self.emitted {
            return Err(Stop::Fallback);
        }
        f.key = Some(key);
        Ok(())
    }

    /// A value begins with `c` (not a key, not white space).
    fn value_start(&mut self, c: u8, out: &mut Vec<u8>) -> Flow {
        let at = self.skel.len();
        let (parent_role, key) = match self.stack.last_mut() {
            Some(f) => {
                f.value_at = at;
                (Some(f.role), f.key.clone().unwrap_or_default())
            }
            None => (None, Vec::new()),
        };
        let is_routing = key == ROUTING_KEY;
        let is_data = key == b"data";
        let is_choices = key == b"choices";
        self.skel.push(c);
        match (parent_role, c) {
            (None, b'[') => return Err(Stop::Fallback), // SGLang's batch list
            (None, _) if !self.skel[..at].iter().all(u8::is_ascii_whitespace) => {
                return Err(Stop::Fallback); // a second top-level value: the walker refuses it
            }
            (Some(Role::Choice), b'"') if is_routing => return self.open_value(Kind::Npy, at),
            (Some(Role::Choice), b'{') if is_routing => {
                self.open_value(Kind::Sidecar, at)?;
                self.stack.push(Frame::new(true, Role::Sidecar, 0));
                return Ok(());
            }
            (Some(Role::Choice), b'[') if is_routing => return Err(Stop::Fallback), // lists
            (Some(Role::Sidecar), b'"') if is_data && self.cur_data_pending() => {
                return self.sidecar_data(out)
            }
            _ => {}
        }
        match c {
            b'{' | b'[' => {
                let role = match (parent_role, c) {
                    (None, b'{') => Role::Top,
                    (Some(Role::Top), b'[') if is_choices => Role::Choices,
                    (Some(Role::Choices), b'{') => Role::Choice,
                    _ => Role::Other,
                };
                let pos = match (role, self.stack.last()) {
                    (Role::Choice, Some(parent)) => parent.pos,
                    _ => 0,
                };
                self.stack.push(Frame::new(c == b'{', role, pos));
            }
            b'"' => {
                self.lex = Lex::Str {
                    start: at,
                    key: false,
                    esc: false,
                }
            }
            _ => self.lex = Lex::Lit { start: at },
        }
        Ok(())
    }

    fn cur_data_pending(&self) -> bool {
        self.cur
            .as_ref()
            .is_some_and(|c| c.kind == Kind::Sidecar && !c.data_done && c.dec.chars == 0)
            && self.stack.last().is_some_and(|f| {
                f.role == Role::Sidecar && !f.members.iter().any(|(k, _)| k == b"data")
            })
    }

    /// A string or literal value ended at the end of `skel`.
    fn value_read(&mut self, start: usize) -> Flow {
        let end = self.skel.len();
        let Some(f) = self.stack.last_mut() else {
            return Ok(());
        };
        if f.obj {
            let key = f.key.take().unwrap_or_default();
            match f.role {
                Role::Choice if key == b"index" => {
                    f.index = serde_json::from_slice::<u64>(&self.skel[start..end]).ok();
                }
                Role::Sidecar => f.members.push((key, start..end)),
                _ => {}
            }
        }
        Ok(())
    }

    /// `}` or `]`.
    fn close(&mut self, c: u8, out: &mut Vec<u8>) -> Flow {
        self.skel.push(c);
        let Some(f) = self.stack.pop() else {
            return Ok(()); // unbalanced: the walker refuses the skeleton
        };
        if f.role == Role::Sidecar {
            self.sidecar_end(f, out)?;
        }
        // The container was its parent's member value.
        if let Some(p) = self.stack.last_mut() {
            if p.obj {
                let at = p.value_at;
                if p.role == Role::Sidecar {
                    let key = p.key.take().unwrap_or_default();
                    p.members.push((key, at..self.skel.len()));
                } else {
                    p.key = None;
                }
            }
        }
        Ok(())
    }

    /// A routing value starts at `skel[at]` in the choice at the top of the stack.
    fn open_value(&mut self, kind: Kind, at: usize) -> Flow {
        let o = &self.opts.merge;
        let h = &o.hints;
        // Kept in the engine's format, a `.npy` value streams as `.npy` text; a sidecar is left
        // to the whole merge (its canonical text is not rebuilt here).
        if self.prefill.refusal().is_some()
            || self.prefill.split()
            || (o.keep_format && kind == Kind::Sidecar)
            || h.num_layers.is_some()
            || h.top_k.is_some()
            || h.dtype.is_some()
            || self.cur.is_some()
        {
            return Err(Stop::Fallback); // the whole merge's paths (and errors) for these
        }
        let choice = self.stack.last().expect("a choice frame");
        let (index, by_index) = match choice.index {
            Some(i) => (i, true),
            // The index key may still come: only a prefill of one choice is the same for all.
            None if self.prefill.one_choice() => (choice.pos, false),
            None => return Err(Stop::Fallback),
        };
        let prefill = match self.prefill.for_choice(index) {
            Some(Ok(p)) => p,
            _ => return Err(Stop::Fallback), // missing or bad on the prefill side
        };
        self.cur = Some(Cur {
            kind,
            at,
            index,
            by_index,
            prefill,
            dec: B64In::default(),
            enc: B64Out::default(),
            drop: 0,
            total: None,
            npy: None,
            start: 0,
            dtype: prefill.dtype(),
            data_done: false,
        });
        if kind == Kind::Npy {
            self.lex = Lex::NpyHead;
            self.head.clear();
        }
        Ok(())
    }

    /// Send the held text before the value and the merged value's head: prefill's rows
    /// (after the merged `.npy` header, when the value is kept as `.npy` text).
    fn send_head(&mut self, out: &mut Vec<u8>) -> Flow {
        let keep = self.opts.merge.keep_format;
        let cur = self.cur.as_mut().expect("a value");
        out.extend_from_slice(&self.skel[self.sent..cur.at]);
        match (keep, &cur.npy) {
            (true, Some((_, plan))) => {
                out.push(b'"');
                let header = npy::write_header(plan.header.dtype, plan.header.shape);
                cur.enc.push(&header, out);
            }
            _ => out.extend_from_slice(DATA_KEY),
        }
        self.emitted = true;
        if self.opts.merge.defer_recode {
            if let Some(later) = cur.prefill.push_rows_deferred(&mut cur.enc, out)? {
                self.deferred.push(later);
            }
        } else {
            cur.prefill.push_rows(&mut cur.enc, out)?;
        }
        Ok(())
    }

    /// A `.npy` value's first characters: held until its header is read, then merged.
    fn npy_head(&mut self, piece: &[u8], i: usize, out: &mut Vec<u8>) -> Flow<usize> {
        let before = self.head.len();
        let r = self.npy_head_in(piece, i, out);
        if matches!(r, Err(Stop::Fallback)) {
            // The piece's bytes are handed back from `i` on: the head holds those before.
            self.head.truncate(before);
        }
        r
    }

    fn npy_head_in(&mut self, piece: &[u8], i: usize, out: &mut Vec<u8>) -> Flow<usize> {
        // A quote or escape in the head: a tiny or escaped value, left to the whole merge.
        let rest = &piece[i..];
        let stop = memchr::memchr2(b'"', b'\\', rest);
        let take = stop
            .unwrap_or(rest.len())
            .min(MAX_NPY_HEAD - self.head.len());
        self.head.extend_from_slice(&rest[..take]);
        let Some(need) = self.npy_need()? else {
            if stop.is_some() || self.head.len() >= MAX_NPY_HEAD {
                return Err(Stop::Fallback);
            }
            return Ok(i + take);
        };
        // The header is known: merge from the value's first character on.
        let (header, data_offset) = self.npy_header(&self.head[..need])?;
        self.npy_plan(header, data_offset)?;
        self.lex = Lex::Data;
        self.send_head(out)?;
        let head = std::mem::take(&mut self.head);
        let fed = self.decode_data(&head, out)?;
        debug_assert_eq!(fed, Fed::More);
        Ok(i + take)
    }

    /// Characters of the head needed for the `.npy` header, once enough are held to say.
    fn npy_need(&self) -> Flow<Option<usize>> {
        let h = &self.head;
        if h.len() >= 8 && !h.starts_with(NPY_B64_PREFIX) {
            return Err(Stop::Fallback); // not vLLM's .npy: the whole merge reads it
        }
        if h.len() < 16 {
            return Ok(None);
        }
        let fixed = decode_groups(&h[..16]).ok_or(Stop::Fallback)?;
        let len = npy::header_len(&fixed).ok_or(Stop::Fallback)?;
        let need = len.div_ceil(3) * 4;
        if need > MAX_NPY_HEAD {
            return Err(Stop::Fallback);
        }
        Ok((h.len() >= need).then_some(need))
    }

    /// The header from its groups: decode's header (start as the merge gives it) and where the
    /// data starts. Anything wrong: the whole merge says what.
    fn npy_header(&self, groups: &[u8]) -> Flow<(Header, usize)> {
        let bytes = decode_groups(groups).ok_or(Stop::Fallback)?;
        let h = npy::parse_header(&bytes).map_err(|_| Stop::Fallback)?;
        let o = &self.opts.merge;
        limits::check_shape(h.shape, h.dtype, o.max_bytes).map_err(|_| Stop::Fallback)?;
        let hints = Hints {
            start: o.decode_start.or(o.hints.start),
            ..o.hints
        };
        let header =
            Header::new(hints.start.unwrap_or(0), h.shape, h.dtype).map_err(|_| Stop::Fallback)?;
        check_hints(Format::VllmNpy, &header, &hints).map_err(|_| Stop::Fallback)?;
        Ok((header, h.data_offset))
    }

    fn npy_plan(&mut self, header: Header, data_offset: usize) -> Flow {
        let cur = self.cur.as_mut().expect("a value");
        if header.dtype != cur.prefill.dtype() {
            return Err(Stop::Fallback); // promotion: not streamed
        }
        let plan = merge::plan(&cur.prefill.header(), &header).map_err(|_| Stop::Fallback)?;
        let data = header
            .shape
            .nbytes(header.dtype)
            .map_err(|_| Stop::Fallback)?;
        cur.drop = (data_offset + plan.skip * header.row_bytes()) as u64;
        cur.total = Some((data_offset + data) as u64);
        cur.npy = Some((header, plan));
        Ok(())
    }

    /// A sidecar's `data` string begins: what its members so far say, and the plan under them.
    fn sidecar_data(&mut self, out: &mut Vec<u8>) -> Flow {
        let members = &self.stack.last().expect("the sidecar").members;
        let mut seen = Vec::new();
        let (mut shape, mut start, mut dtype) = (None, None, None);
        for (key, r) in members {
            if seen.contains(&key) {
                return Err(Stop::Fallback);
            }
            seen.push(key);
            let v: Value =
                serde_json::from_slice(&self.skel[r.clone()]).map_err(|_| Stop::Fallback)?;
            match key.as_slice() {
                b"shape" => shape = Some(parse_shape(Some(&v)).map_err(|_| Stop::Fallback)?),
                b"start" => start = Some(v.as_u64().ok_or(Stop::Fallback)?),
                b"dtype" => {
                    let name = v.as_str().ok_or(Stop::Fallback)?;
                    dtype = Some(DType::parse(name).map_err(|_| Stop::Fallback)?);
                }
                _ => return Err(Stop::Fallback), // a key a merge refuses, or a body's
            }
        }
        let start = match (start, self.opts.data_first) {
            (Some(s), _) => s,
            (None, DataFirst::Expect(s)) => s,
            (None, DataFirst::Fallback) => return Err(Stop::Fallback),
        };
        let cur = self.cur.as_mut().expect("a value");
        let p = cur.prefill.header();
        let dtype = dtype.unwrap_or(p.dtype);
        if dtype != p.dtype {
            return Err(Stop::Fallback); // promotion: not streamed
        }
        // The plan as far as it is known: layers and top_k (prefill's when not yet stated),
        // and where decode starts; the rows decode holds are checked at its end.
        let stated = shape.is_some();
        let shape = shape.unwrap_or(Shape {
            tokens: 0,
            ..p.shape
        });
        if (shape.layers, shape.top_k) != (p.shape.layers, p.shape.top_k) || start > p.stop() {
            return Err(Stop::Fallback);
        }
        if stated {
            let h = Header::new(start, shape, dtype).map_err(|_| Stop::Fallback)?;
            limits::check_shape(shape, dtype, self.opts.merge.max_bytes)
                .map_err(|_| Stop::Fallback)?;
            merge::plan(&p, &h).map_err(|_| Stop::Fallback)?;
            cur.total = Some(shape.nbytes(dtype).map_err(|_| Stop::Fallback)? as u64);
        }
        let skip = p.stop() - start;
        cur.drop = skip.saturating_mul(p.row_bytes() as u64);
        cur.start = start;
        cur.dtype = dtype;
        self.lex = Lex::Data;
        self.send_head(out)?;
        Ok(())
    }

    /// Base64 content: decoded, prefill's rows cut off, encoded after what was sent.
    fn routing_data(&mut self, piece: &[u8], i: usize, out: &mut Vec<u8>) -> Flow<usize> {
        match self.decode_data(&piece[i..], out)? {
            Fed::More => Ok(piece.len()),
            Fed::End(j) => {
                self.skel.push(b'"');
                self.lex = Lex::Ws;
                self.data_end(out)?;
                Ok(i + j + 1)
            }
        }
    }

    fn decode_data(&mut self, text: &[u8], out: &mut Vec<u8>) -> Flow<Fed> {
        let cur = self.cur.as_mut().expect("a value");
        self.scratch.clear();
        let before = cur.dec.decoded;
        let fed = cur.dec.feed(text, &mut self.scratch).map_err(|e| {
            let what = match e {
                B64Error::Character => "base64 characters A-Z a-z 0-9 + / (canonical padding)",
                B64Error::Length => "padded base64 (a length that is a multiple of 4)",
                B64Error::Json => "a JSON string",
            };
            Error::field("data", what, "other text").context("decode")
        })?;
        let keep_from = cur
            .drop
            .saturating_sub(before)
            .min(self.scratch.len() as u64) as usize;
        cur.enc.push(&self.scratch[keep_from..], out);
        if let Some(total) = cur.total {
            if cur.dec.decoded > total {
                return Err(Error::field("data", format!("{total} bytes"), "more")
                    .context("decode")
                    .into());
            }
        }
        self.peak = self.peak.max(self.held());
        Ok(fed)
    }

    /// The base64 string ended.
    fn data_end(&mut self, out: &mut Vec<u8>) -> Flow {
        let cur = self.cur.as_mut().expect("a value");
        cur.data_done = true;
        match cur.kind {
            Kind::Sidecar => self.value_read(self.skel.len() - 2), // the emptied `""`
            Kind::Npy => {
                let (header, plan) = cur.npy.expect("a .npy header");
                if Some(cur.dec.decoded) != cur.total {
                    let e = format!(
                        "vllm_npy: expected {} data bytes for shape {} of {}, got {}",
                        cur.total.unwrap_or(0),
                        header.shape,
                        header.dtype,
                        cur.dec.decoded
                    );
                    return Err(Error::malformed(e).context("decode").into());
                }
                self.end_value(&plan, Some(header), out);
                self.value_read(self.skel.len() - 2)
            }
        }
    }

    /// The merged value's last bytes; the value joins those merged.
    fn end_value(&mut self, plan: &Plan, npy_header: Option<Header>, out: &mut Vec<u8>) {
        let mut cur = self.cur.take().expect("a value");
        cur.enc.finish(out);
        if self.opts.merge.keep_format && npy_header.is_some() {
            out.push(b'"'); // the `.npy` text's closing quote
        } else {
            out.extend_from_slice(tail(&plan.header).as_bytes());
        }
        self.sent = self.skel.len();
        self.done.push(DoneValue {
            at: cur.at,
            index: cur.index,
            by_index: cur.by_index,
            npy_header,
        });
    }

    /// The merged sidecar's `}`: every check `sidecar::validate` and `merge::plan` make.
    fn sidecar_end(&mut self, f: Frame, out: &mut Vec<u8>) -> Flow {
        let Some(cur) = self.cur.as_ref() else {
            return Ok(());
        };
        if !cur.data_done {
            return Err(Stop::Fallback); // no `data` string: the whole merge says what
        }
        let mut fields: [Option<Value>; 3] = Default::default();
        for (key, r) in &f.members {
            let slot = match key.as_slice() {
                b"data" => continue,
                b"shape" => &mut fields[0],
                b"start" => &mut fields[1],
                b"dtype" => &mut fields[2],
                other => {
                    let key = String::from_utf8_lossy(other);
                    return Err(sidecar::extra_key_error("decode", &key).into());
                }
            };
            if slot.is_some() {
                return Err(Error::malformed("sidecar: duplicate key").into());
            }
            let v = serde_json::from_slice(&self.skel[r.clone()])
                .map_err(|e| Error::malformed(format!("sidecar: invalid JSON: {e}")))?;
            *slot = Some(v);
        }
        if f.members.iter().filter(|(k, _)| k == b"data").count() > 1 {
            return Err(Error::malformed("sidecar: duplicate key `data`").into());
        }
        let [shape, start, dtype] = fields;
        let shape = parse_shape(shape.as_ref())?;
        let start = match start {
            None => 0,
            Some(v) => v
                .as_u64()
                .ok_or_else(|| Error::field("start", "a non-negative integer", v.to_string()))?,
        };
        let dtype = match dtype {
            None => DType::U8,
            Some(Value::String(s)) => DType::parse(&s)?,
            Some(v) => return Err(Error::field("dtype", "a dtype name", v.to_string()).into()),
        };
        limits::check_shape(shape, dtype, self.opts.merge.max_bytes)?;
        let want = shape.nbytes(dtype)?;
        if cur.dec.decoded != want as u64 {
            return Err(Error::field(
                "data",
                format!("{want} bytes for shape {shape} of {dtype}"),
                format!("{} bytes", cur.dec.decoded),
            )
            .context("decode")
            .into());
        }
        let header = Header::new(start, shape, dtype)?;
        let p = cur.prefill.header();
        merge::check_same_rows(p.shape, shape, "prefill", "decode")?;
        let plan = merge::plan(&p, &header)?;
        if start != cur.start || dtype != cur.dtype {
            return Err(Error::inconsistent(format!(
                "decode's sidecar states start {start} and dtype {dtype}, but its data came first \
                 and was merged as from start {} in {} (the start the stream expected): not \
                 merged as it streams",
                cur.start, cur.dtype
            ))
            .into());
        }
        self.end_value(&plan, None, out);
        Ok(())
    }

    /// The checks that need the whole event, made by the core's walker on the skeleton.
    fn check_whole(&mut self) -> Result<Vec<u64>> {
        self.failed = true; // whatever happens, the event is over
        if self.lex != Lex::Ws || self.cur.is_some() {
            return Err(Error::malformed("the event ended inside its routing value"));
        }
        let body = read_body(&self.skel)?;
        if let Some(at) = &body.weights {
            return Err(split::weights_error(at));
        }
        if let Some(p) = &body.prompt {
            return Err(Error::malformed(format!(
                "{}: split routing is not streamed",
                p.path
            )));
        }
        if body.values.len() != self.done.len()
            || body
                .values
                .iter()
                .zip(&self.done)
                .any(|(f, d)| f.span.start != d.at)
        {
            let at = body
                .values
                .iter()
                .find(|f| !self.done.iter().any(|d| d.at == f.span.start));
            return Err(Error::inconsistent(format!(
                "routing at {} beside the routing that streamed: not merged as it streams",
                at.map_or("?", |f| &f.path)
            )));
        }
        let o = &self.opts.merge;
        let start_given = o.decode_start.or(o.hints.start).is_some();
        for (f, d) in body.values.iter().zip(&self.done) {
            if d.by_index && f.index != d.index {
                return Err(Error::inconsistent(
                    "a choice's index changed after its routing",
                ));
            }
            if let Some(h) = &d.npy_header {
                let rule = Rule::of(Format::VllmNpy, f.place);
                debug_assert_eq!(f.place, Place::Choice);
                coverage::check(rule, Format::VllmNpy, h, &f.counts, start_given)
                    .map_err(|e| e.context("decode").context(format!("choice {}", f.index)))?;
            }
        }
        self.failed = false;
        Ok(body.values.iter().map(|f| f.index).collect())
    }
}

/// Whole groups without padding, strictly decoded.
fn decode_groups(text: &[u8]) -> Option<Vec<u8>> {
    if text.len() % 4 != 0 || text.contains(&b'=') {
        return None;
    }
    b64::decode_range(text, 0, text.len() / 4 * 3).ok()
}
