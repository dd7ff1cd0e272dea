//! Merging the routing of a decode server's event stream, relayed as bytes: blocks of events
//! that cannot hold routing pass through untouched (no copy); only an event that carries it is
//! merged with the prefill routing. An event past [`STREAM_ABOVE`] is merged as it passes
//! ([`EventMerge`]: O(piece) held, prefill's rows read from its body as they are sent), unless
//! the core hands it back before a byte is sent; then it is held and merged whole, as shorter
//! events are.

use std::collections::VecDeque;
use std::sync::OnceLock;

use bytes::Bytes;
use memchr::memmem;

use super::parts::{shared_parts, Part};
use routed_experts::body::{BodyRouting, Found};
use routed_experts::response::{
    merge_response_found, merge_response_pieces, merge_suspects, DataFirst, EventMerge,
    MergeOptions, PrefillRows, Recoded, Spliced, Step, StreamOptions,
};
use routed_experts::validate::Suspect;

/// Why a stream cannot be relayed to its end.
#[derive(Debug)]
pub enum StreamError {
    /// The stream ended without `data: [DONE]`.
    NoDone,
    /// A line (one event's data) passed the limit.
    LineTooLong(usize),
    /// An event's routing did not merge, or no event carried routing while prefill did.
    Merge(routed_experts::Error),
}

/// Merges the routing of server-sent events from a decode server with the prefill routing.
/// Feed it the stream's chunks as they arrive ([`feed`](Self::feed)), then call
/// [`finish`](Self::finish); what they emit is the stream to send on.
pub struct StreamMerger<'a> {
    prefill: Prefill<'a>,
    opts: MergeOptions,
    max_line: usize,
    partial: Vec<Bytes>, // the line being received, in the pieces it came in
    small: Vec<u8>,      // its latest small pieces, copied together (see `hold`)
    joined: Vec<u8>,     // a large line, copied together as it comes (see `hold`)
    partial_len: usize,
    /// Some event carried routing (and was merged).
    pub merged: bool,
    /// Bytes of merged events' data (after `data:`, through the end of each one's line).
    pub merged_bytes: usize,
    /// Rows sampled from the merged routing, prefill's and decode's (see
    /// [`merge_suspects`](routed_experts::response::merge_suspects)).
    pub suspects: (Suspect, Suspect),
    /// The choices whose routing an event carried.
    merged_choices: Vec<u64>,
    /// The stream's `data: [DONE]` line and all that came after it, held back until
    /// [`finish`](Self::finish) has checked the stream: an error found there must reach the
    /// client, and every OpenAI client stops reading at `[DONE]`.
    after_done: Option<Vec<Bytes>>,
    /// Prefill's routing as the events merged as they pass read it, found once (`None`: every
    /// event is merged whole).
    rows: Option<&'a OnceLock<PrefillRows<'a>>>,
    /// The event being merged as it passes.
    live: Option<Live<'a>>,
    /// The held line was handed back by the streaming merge: merged whole at its end.
    held_back: bool,
    /// Merged bytes made by the streaming merge, and bytes of the stream it took in, since
    /// [`take_output_excess`](Self::take_output_excess) (prefill's rows make the first far
    /// larger than the second).
    fresh_out: usize,
    live_in: usize,
    /// Leave prefill's rows in an event that streams to be written as they are sent
    /// ([`defer_rows`](Self::defer_rows)).
    defer_rows: bool,
    /// What follows prefill's rows so left, in order, until
    /// [`next_pending`](Self::next_pending) hands it over: nothing is sent before it.
    pending: VecDeque<Part>,
}

/// A `data:` line merged as it passes.
struct Live<'a> {
    merge: EventMerge<'a>,
    /// The line's text before its JSON (`data:` and white space): sent as `data: ` with the
    /// first merged bytes, or given back with the rest if the merge hands the line back.
    prefix: Vec<u8>,
    /// Bytes of the line so far, against `max_line`.
    len: usize,
    /// Merged bytes sent.
    sent: usize,
}

/// A `data:` line held this long is merged as it passes (when the merger was given prefill's
/// rows): a stream holds at most about this much of its routing event at once.
pub const STREAM_ABOVE: usize = 1 << 20;

/// Routing rows a merge samples from each value for the marks of a broken engine.
pub const SAMPLE_ROWS: usize = 64;

/// The prefill body a merger merges with: borrowed with its routing already found (the
/// proxy's case: the body is walked once), or owned (its routing found at each merge).
enum Prefill<'a> {
    Found(&'a Bytes, &'a BodyRouting<'a>),
    Owned(Bytes),
}

impl Prefill<'_> {
    fn body(&self) -> &Bytes {
        match self {
            Prefill::Found(b, _) => b,
            Prefill::Owned(b) => b,
        }
    }

    /// Rows sampled from both sides of a merge with `decode`'s values.
    fn suspects(&self, decode: &[Found], opts: &MergeOptions) -> (Suspect, Suspect) {
        match self {
            Prefill::Found(_, found) => merge_suspects(&found.values, decode, opts, SAMPLE_ROWS),
            Prefill::Owned(body) => match routed_experts::read_body(body) {
                Ok(found) => merge_suspects(&found.values, decode, opts, SAMPLE_ROWS),
                Err(_) => Default::default(),
            },
        }
    }

    fn merge<'s>(
        &'s self,
        decode: &'s [u8],
        opts: MergeOptions,
    ) -> routed_experts::Result<Spliced<'s>> {
        match self {
            Prefill::Found(body, found) => merge_response_found(body, found, decode, opts),
            Prefill::Owned(body) => merge_response_pieces(body, decode, opts),
        }
    }
}

/// Pieces of a held line shorter than this are copied together (see `hold`).
const COPY_BELOW: usize = 4096;

/// A held line this long is copied into one buffer as it comes (see `hold`). Buffers this
/// large get pages of their own from the system, given back when freed (the server fixes the
/// allocator's threshold here).
pub const OWN_PAGES_ABOVE: usize = 8 << 20;

/// Lines at least this long skip the marker scan: the merge's walk finds routing anyway.
const LONG_LINE: usize = 64 * 1024;

/// What may hold routing: the key, or any `\u` escape (the key may be spelled with one).
fn may_route(text: &[u8]) -> bool {
    memmem::find(text, b"\"routed_experts\"").is_some() || memmem::find(text, b"\\u").is_some()
}

fn is_done(line: &[u8]) -> bool {
    line.strip_prefix(b"data:")
        .is_some_and(|rest| rest.trim_ascii() == b"[DONE]")
}

impl StreamMerger<'static> {
    /// A merger that owns the prefill body (its routing is found at each merge: a stream has
    /// one routing event).
    pub fn owned(prefill: Bytes, opts: MergeOptions, max_line: usize) -> Self {
        Self::with(Prefill::Owned(prefill), opts, max_line)
    }
}

impl<'a> StreamMerger<'a> {
    /// A merger for one stream, given the prefill body and its routing (as
    /// [`read_prefill`](routed_experts::read_prefill) or [`read_body`](routed_experts::read_body) found
    /// it, so the body is not walked again); `opts` as for `merge_response` (its hints carry
    /// the prompt start); a line longer than `max_line` bytes is an error.
    pub fn new(
        prefill: &'a Bytes,
        prefill_routing: &'a BodyRouting<'a>,
        opts: MergeOptions,
        max_line: usize,
    ) -> Self {
        Self::with(Prefill::Found(prefill, prefill_routing), opts, max_line)
    }

    fn with(prefill: Prefill<'a>, opts: MergeOptions, max_line: usize) -> Self {
        StreamMerger {
            prefill,
            opts,
            max_line,
            partial: Vec::new(),
            small: Vec::new(),
            joined: Vec::new(),
            partial_len: 0,
            merged: false,
            merged_bytes: 0,
            suspects: Default::default(),
            merged_choices: Vec::new(),
            after_done: None,
            rows: None,
            live: None,
            held_back: false,
            fresh_out: 0,
            live_in: 0,
            defer_rows: false,
            pending: VecDeque::new(),
        }
    }

    /// This merger, leaving prefill's rows in an event that streams to be encoded as they are
    /// sent (`MergeOptions::defer_recode`): the bytes after them wait in order, and the caller
    /// takes them from [`next_pending`](Self::next_pending) after each call to
    /// [`feed`](Self::feed), a piece of rows at a time, instead of the merge writing all of
    /// the prompt's rows into one buffer at once (131 MB of text for a 128k-token prompt of
    /// Qwen3-235B-A22B). Without it they are written in the merge, into `feed`'s output.
    pub fn defer_rows(mut self) -> Self {
        self.defer_rows = true;
        self
    }

    /// The next bytes to send after what [`feed`](Self::feed) gave (`None`: nothing waits; it
    /// has all been handed over). Prefill's rows are encoded here, a piece at a time; an
    /// error says they could not be, which a merge's parts never hold (the stream then ends
    /// with an error event, and nothing after it is sent).
    pub fn next_pending(&mut self) -> Option<Result<Bytes, StreamError>> {
        let part = self.pending.pop_front()?;
        Some(match part.next_piece() {
            Ok((bytes, rest)) => {
                if let Some(rest) = rest {
                    self.pending.push_front(rest);
                }
                Ok(bytes)
            }
            Err(e) => {
                self.pending.clear();
                Err(StreamError::Merge(routed_experts::Error::inconsistent(
                    format!("prefill's routing could not be encoded as it was sent ({e})"),
                )))
            }
        })
    }

    /// This merger, merging events longer than `STREAM_ABOVE` (1 MiB) as they pass, with
    /// prefill's routing found into `rows` the first time one comes (the caller keeps the cell,
    /// so the events borrow it). Compact sidecars whose `data` precedes their `start` (the
    /// canonical order) are still merged whole: decode's start, which decides which of its rows
    /// follow prefill's, comes after the rows. A merger that owns its prefill body does not
    /// stream.
    pub fn streaming(mut self, rows: &'a OnceLock<PrefillRows<'a>>) -> Self {
        if matches!(self.prefill, Prefill::Found(..)) {
            self.rows = Some(rows);
        }
        self
    }

    /// Whether the stream's `data: [DONE]` was seen.
    pub fn done(&self) -> bool {
        self.after_done.is_some()
    }

    /// Bytes the merge sent beyond those it took in since the last call (prefill's rows, sent
    /// when an event that streams reaches its routing): new memory until they are written,
    /// which the caller counts beside the stream's own bytes.
    pub fn take_output_excess(&mut self) -> usize {
        let excess = self.fresh_out.saturating_sub(self.live_in);
        (self.fresh_out, self.live_in) = (0, 0);
        excess
    }

    /// Bytes held back until their line ends: an incomplete line, or what the merge of an
    /// event that streams holds (its text outside the routing data), and prefill's rows if a
    /// format that is not read from the body's text had them decoded; and merged bytes waiting
    /// behind prefill's rows (see [`defer_rows`](Self::defer_rows)).
    pub fn buffered(&self) -> usize {
        let live = self
            .live
            .as_ref()
            .map_or(0, |l| l.merge.held() + l.prefix.len());
        let rows = self
            .rows
            .and_then(OnceLock::get)
            .map_or(0, PrefillRows::held_bytes);
        let waiting: usize = self
            .pending
            .iter()
            .map(|p| match p {
                Part::Ready(b) => b.len(),
                Part::Recoded { .. } => 0, // prefill's body, counted with it
            })
            .sum();
        self.partial_len + live + rows + waiting
    }

    /// Push onto `out` the pieces to send for the lines this chunk completes.
    pub fn feed(&mut self, mut chunk: Bytes, out: &mut Vec<Bytes>) -> Result<(), StreamError> {
        if self.live.is_some() {
            match self.feed_live(&chunk, out)? {
                Some(rest) if rest < chunk.len() => chunk = chunk.slice(rest..),
                _ => return Ok(()),
            }
        }
        let mut pos = 0;
        if self.partial_len > 0 {
            let Some(nl) = memchr::memchr(b'\n', &chunk) else {
                self.hold(chunk)?;
                return self.begin_streaming(out);
            };
            pos = nl + 1;
            self.hold(chunk.slice(..pos))?;
            let line = self.take_line();
            self.line(line, out)?;
        }
        let cut = memchr::memrchr(b'\n', &chunk).map_or(0, |i| i + 1);
        if cut > pos {
            self.block(chunk.slice(pos..cut), out)?;
            pos = cut;
        }
        if pos < chunk.len() {
            self.hold(chunk.slice(pos..))?;
            self.begin_streaming(out)?;
        }
        Ok(())
    }

    /// Merge the held line as it passes from here on, once it is a long `data:` line and the
    /// merger was given a cell for prefill's rows; else keep holding it.
    fn begin_streaming(&mut self, out: &mut Vec<Bytes>) -> Result<(), StreamError> {
        let (Some(cell), Prefill::Found(_, routing)) = (self.rows, &self.prefill) else {
            return Ok(());
        };
        let routing: &'a BodyRouting<'a> = routing;
        if self.held_back || self.partial_len < STREAM_ABOVE {
            return Ok(());
        }
        // The held line, in order: one buffer past OWN_PAGES_ABOVE, else its pieces.
        self.flush_small();
        let (joined, partial) = (
            std::mem::take(&mut self.joined),
            std::mem::take(&mut self.partial),
        );
        let pieces: Vec<&[u8]> = if joined.is_empty() {
            partial.iter().map(|p| &p[..]).collect()
        } else {
            vec![&joined[..]]
        };
        let first = pieces.first().copied().unwrap_or_default();
        let json_at = first
            .strip_prefix(b"data:")
            .map(|rest| first.len() - rest.trim_ascii_start().len())
            .filter(|&at| at < first.len());
        let rows = cell.get_or_init(|| PrefillRows::new(routing, &self.opts));
        // Not an event whose JSON starts in its first piece, or prefill has no routing: held
        // and merged whole (the whole merge says what is wrong, if anything is).
        let Some(json_at) = json_at.filter(|_| !rows.is_empty()) else {
            (self.joined, self.partial, self.held_back) = (joined, partial, true);
            return Ok(());
        };
        let opts = StreamOptions {
            merge: MergeOptions {
                defer_recode: self.defer_rows,
                ..self.opts
            },
            data_first: DataFirst::Fallback,
            max_held: self.max_line,
        };
        let mut live = Live {
            merge: EventMerge::new(rows, opts),
            prefix: first[..json_at].to_vec(),
            len: self.partial_len,
            sent: 0,
        };
        let (mut merged, mut later) = (Vec::new(), Vec::new());
        for (i, piece) in pieces.iter().enumerate() {
            let text = if i == 0 { &piece[json_at..] } else { piece };
            let fed = live.merge.feed(text, &mut merged);
            later.extend(live.merge.take_deferred());
            match fed {
                Ok(Step::Streaming(_)) => {}
                Ok(Step::Fallback(_)) => {
                    // Nothing was sent: the line is held as it was, and merged whole.
                    drop(pieces);
                    (self.joined, self.partial, self.held_back) = (joined, partial, true);
                    return Ok(());
                }
                Err(e) => return Err(StreamError::Merge(e)),
            }
        }
        self.live_in += std::mem::take(&mut self.partial_len);
        self.send_live(&mut live.sent, merged, later, out);
        self.live = Some(live);
        Ok(())
    }

    /// The next piece of the event that streams: where the rest of `chunk` starts once its
    /// line ended (`None`: all of it was the event's).
    fn feed_live(
        &mut self,
        chunk: &Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<Option<usize>, StreamError> {
        let Some(mut live) = self.live.take() else {
            return Ok(Some(0));
        };
        let nl = memchr::memchr(b'\n', chunk);
        let end = nl.map_or(chunk.len(), |i| i + 1);
        live.len += end;
        self.live_in += end;
        if live.len > self.max_line {
            return Err(StreamError::LineTooLong(self.max_line));
        }
        let mut merged = Vec::new();
        let fed = live.merge.feed(&chunk[..end], &mut merged);
        let later = live.merge.take_deferred();
        match fed.map_err(StreamError::Merge)? {
            Step::Fallback(held) => {
                // Handed back before a byte was sent: held, and merged whole at its end.
                self.joined = [&live.prefix[..], &held].concat();
                self.partial_len = self.joined.len();
                self.held_back = true;
                if nl.is_some() {
                    let line = self.take_line();
                    self.line(line, out)?;
                }
                return Ok(Some(end));
            }
            Step::Streaming(_) => self.send_live(&mut live.sent, merged, later, out),
        }
        if nl.is_none() {
            self.live = Some(live);
            return Ok(None);
        }
        let mut merged = Vec::new();
        match live.merge.finish(&mut merged).map_err(StreamError::Merge)? {
            Step::Fallback(held) => {
                let line = Bytes::from([&live.prefix[..], &held].concat());
                self.line(line, out)?;
            }
            Step::Streaming(choices) => {
                // Checked before the event's last bytes go: without them it is not JSON.
                if let Some(c) = choices.iter().find(|c| self.merged_choices.contains(c)) {
                    return Err(StreamError::Merge(routed_experts::Error::inconsistent(
                        format!(
                            "a second routing event for choice {c}: a stream carries each \
                         choice's routing once"
                        ),
                    )));
                }
                self.merged_choices.extend(choices);
                self.merged = true;
                self.send_live(&mut live.sent, merged, Vec::new(), out);
                self.merged_bytes += live.sent;
            }
        }
        Ok(Some(end))
    }

    /// Merged bytes of the event that streams, after `data: ` if they are its first, with the
    /// rows the merge left to be written as they are sent put in at their places.
    fn send_live(
        &mut self,
        sent: &mut usize,
        merged: Vec<u8>,
        later: Vec<(usize, Recoded<'_>)>,
        out: &mut Vec<Bytes>,
    ) {
        if merged.is_empty() && later.is_empty() {
            return;
        }
        if *sent == 0 {
            self.emit(Bytes::from_static(b"data: "), out);
        }
        *sent += merged.len() + later.iter().map(|(_, r)| r.len()).sum::<usize>();
        self.fresh_out += merged.len();
        let merged = Bytes::from(merged);
        let mut copied = 0;
        for (at, rows) in later {
            self.emit(merged.slice(copied..at), out);
            copied = at;
            let part = Part::recoded(rows, &[self.prefill.body()]);
            self.emit_part(part, out);
        }
        self.emit(merged.slice(copied..), out);
    }

    /// The rest of the stream (a last line without a newline); then the checks: the stream
    /// ended with `data: [DONE]`, and carried routing if the prefill body did. Only when they
    /// pass is the held `data: [DONE]` line pushed: a failed stream ends with the caller's
    /// error event and no `[DONE]` before it.
    pub fn finish(&mut self, out: &mut Vec<Bytes>) -> Result<(), StreamError> {
        // What waits behind prefill's rows goes first (a caller that takes it after each
        // `feed` leaves nothing here).
        while let Some(piece) = self.next_pending() {
            out.push(piece?);
        }
        if let Some(live) = self.live.take() {
            // Cut off inside an event that streams: whole only if nothing was sent yet (then it
            // is held as a line, as below); the stream has no `[DONE]` after it either way.
            if let Step::Fallback(held) = live
                .merge
                .finish(&mut Vec::new())
                .map_err(StreamError::Merge)?
            {
                self.joined = [&live.prefix[..], &held].concat();
                self.partial_len = self.joined.len();
            } else {
                return Err(StreamError::NoDone);
            }
        }
        if self.partial_len > 0 {
            let line = self.take_line();
            // An unterminated last line is sent on only when the stream is whole with it (SSE
            // clients drop an event cut off by the end of the stream anyway); otherwise the
            // error event that ends the stream starts where the last whole line ended.
            if self.done() || is_done(&line) {
                self.line(line, out)?;
            }
        }
        let Some(held) = self.after_done.clone() else {
            return Err(StreamError::NoDone);
        };
        if !self.merged {
            let opts = MergeOptions {
                require_routing: true,
                ..self.opts
            };
            self.prefill
                .merge(b"{}", opts)
                .map_err(|e| StreamError::Merge(with_stream_advice(e)))?;
        }
        out.extend(held);
        Ok(())
    }

    /// Keep a piece of an unfinished line (no copy).
    fn hold(&mut self, piece: Bytes) -> Result<(), StreamError> {
        if self.partial_len + piece.len() > self.max_line {
            return Err(StreamError::LineTooLong(self.max_line));
        }
        self.partial_len += piece.len();
        // A large line (a long-context routing event) is copied into one buffer as it comes,
        // which grows without copying (its pages are its own); its pieces go back to the heap
        // at once instead of waiting, every one, for the line's end.
        if !self.joined.is_empty() {
            self.joined.extend_from_slice(&piece);
            return Ok(());
        }
        if self.partial_len >= OWN_PAGES_ABOVE {
            self.flush_small();
            let mut joined = Vec::with_capacity(self.partial_len.saturating_mul(2));
            for p in std::mem::take(&mut self.partial) {
                joined.extend_from_slice(&p);
            }
            joined.extend_from_slice(&piece);
            self.joined = joined;
            return Ok(());
        }
        // Small pieces are copied together: a slice would keep alive the whole read buffer it
        // points into, so an event split into tiny chunks would cost many times its size (and
        // a piece each). Large pieces are kept as they came (no copy).
        if piece.len() < COPY_BELOW {
            self.small.extend_from_slice(&piece);
            if self.small.len() >= COPY_BELOW * 16 {
                self.flush_small();
            }
            return Ok(());
        }
        self.flush_small();
        self.partial.push(piece);
        Ok(())
    }

    /// The held line, now complete, joined once (a line that came in one piece is not copied).
    /// The small pieces copied so far, as one piece of the held line.
    fn flush_small(&mut self) {
        if !self.small.is_empty() {
            let small = std::mem::take(&mut self.small);
            self.partial.push(Bytes::from(small));
        }
    }

    fn take_line(&mut self) -> Bytes {
        self.held_back = false;
        let len = std::mem::take(&mut self.partial_len);
        if !self.joined.is_empty() {
            return Bytes::from(std::mem::take(&mut self.joined));
        }
        self.flush_small();
        let pieces = std::mem::take(&mut self.partial);
        if pieces.len() == 1 {
            return pieces.into_iter().next().unwrap_or_default();
        }
        // Each piece is let go once copied: the line and its pieces are never both whole in
        // memory (a piece shares at most one upstream read buffer, 256 KiB).
        let mut line = Vec::with_capacity(len);
        for p in pieces {
            line.extend_from_slice(&p);
        }
        Bytes::from(line)
    }

    /// Whole lines: passed on as one piece unless one may hold routing or the stream's end.
    fn block(&mut self, block: Bytes, out: &mut Vec<Bytes>) -> Result<(), StreamError> {
        let look_closer = may_route(&block) || memmem::find(&block, b"[DONE]").is_some();
        if !look_closer && block.len() <= self.max_line {
            self.emit(block, out);
            return Ok(());
        }
        let mut start = 0;
        for nl in memchr::memchr_iter(b'\n', &block) {
            self.line(block.slice(start..nl + 1), out)?;
            start = nl + 1;
        }
        Ok(())
    }

    /// One whole line (it need not end with a newline): merged if it is a `data:` event that
    /// carries routing, else as it came.
    pub fn line(&mut self, line: Bytes, out: &mut Vec<Bytes>) -> Result<(), StreamError> {
        if line.len() > self.max_line {
            return Err(StreamError::LineTooLong(self.max_line));
        }
        if is_done(&line) && !self.done() {
            self.after_done = Some(Vec::new());
        }
        let Some(rest) = line.strip_prefix(b"data:") else {
            self.emit(line, out);
            return Ok(());
        };
        // A short event is looked at closer only if it may hold routing; a long one (the
        // routing event is the long one) goes straight to the merge, whose walk decides.
        if rest.len() < LONG_LINE && !may_route(rest) {
            self.emit(line, out);
            return Ok(());
        }
        let payload = line.slice_ref(rest.trim_ascii_start());
        // Prefill's rows encoded again (vLLM's `.npy` as a compact sidecar) are written as
        // they are sent, as in an event that streams; after `[DONE]`, whose lines are held
        // as bytes for `finish`, they are written now.
        let opts = MergeOptions {
            defer_recode: self.defer_rows && self.after_done.is_none(),
            ..self.opts
        };
        let mut spliced = match self.prefill.merge(&payload, opts) {
            Ok(s) => s,
            // A long event that is not JSON, and holds no routing marker, passes as it came
            // (as a short one does without being parsed).
            Err(_) if !may_route(rest) => {
                self.emit(line, out);
                return Ok(());
            }
            Err(e) => return Err(StreamError::Merge(e)),
        };
        let merged_len = spliced.len();
        let parts = shared_parts(&mut spliced, &[self.prefill.body(), &payload])
            .map_err(StreamError::Merge)?;
        if spliced.merged_values() > 0 {
            // A choice's routing comes once; a second event for it would merge it twice.
            for f in spliced.decode_values() {
                if self.merged_choices.contains(&f.index) {
                    return Err(StreamError::Merge(routed_experts::Error::inconsistent(
                        format!(
                            "a second routing event for choice {} (at {}): a stream carries each \
                         choice's routing once",
                            f.index, f.path
                        ),
                    )));
                }
            }
            self.merged_choices
                .extend(spliced.decode_values().iter().map(|f| f.index));
            self.merged = true;
            self.merged_bytes += merged_len;
            let seen = self.prefill.suspects(spliced.decode_values(), &self.opts);
            self.suspects.0.merge(seen.0);
            self.suspects.1.merge(seen.1);
        }
        self.emit(Bytes::from_static(b"data: "), out);
        for p in parts {
            self.emit_part(p, out);
        }
        Ok(())
    }

    /// A merged part to send: bytes as [`emit`](Self::emit) sends them; text to encode as it
    /// is sent waits its turn with what follows (never after `[DONE]`: not left so there).
    fn emit_part(&mut self, part: Part, out: &mut Vec<Bytes>) {
        match part {
            Part::Ready(b) => self.emit(b, out),
            recoded => {
                debug_assert!(self.after_done.is_none(), "text left after [DONE]");
                self.pending.push_back(recoded)
            }
        }
    }

    /// A piece to send: onto `out`, or, from `data: [DONE]` on, held for `finish`.
    fn emit(&mut self, piece: Bytes, out: &mut Vec<Bytes>) {
        if piece.is_empty() {
            return;
        }
        match &mut self.after_done {
            Some(held) => held.push(piece),
            // Behind prefill's rows left to be written as they are sent.
            None if !self.pending.is_empty() => self.pending.push_back(Part::Ready(piece)),
            None => out.push(piece),
        }
    }
}

/// A decode stream that ended without routing where prefill had some: what the client can do
/// instead, said in the error it reads (vLLM, through 0.33, sends routing on no
/// `/v1/completions` or `/v1/chat/completions` stream).
fn with_stream_advice(e: routed_experts::Error) -> routed_experts::Error {
    use routed_experts::{ErrorKind, Half};
    if *e.kind() != ErrorKind::MissingRouting(Half::Decode) {
        return e;
    }
    let message = format!(
        "{}; the decode stream ended without routing (vLLM sends none on /v1/completions and \
         /v1/chat/completions streams): run the proxy with --stream-routing buffered (the \
         default; `stream_routing`), which asks decode plainly and ends the stream with the \
         routing, ask without \"stream\", or stream /inference/v1/generate, whose finishing \
         event carries it",
        e.message()
    );
    routed_experts::Error::new(e.kind().clone(), message)
}

#[cfg(test)]
mod tests;
