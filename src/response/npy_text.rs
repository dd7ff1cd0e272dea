//! Two halves of vLLM's `.npy` text merged on their text, into `.npy` text (`keep_format`) or
//! a compact sidecar's data. The merged rows are prefill's, then decode's past prefill's, and
//! base64 maps each 3-byte group to 4 characters: wherever a half's rows fall on the same group
//! boundaries in the output as in its own file, their text is the output's text, and is copied
//! (the `.npy` output, whose header is as long as the halves'). Elsewhere (the compact sidecar,
//! whose rows start at 0 where vLLM's start 128 bytes in) the text is decoded and encoded again
//! a block at a time, so the rows pass through the cache once instead of being decoded into a
//! buffer the size of the payload and read back to be encoded.

use std::borrow::Cow;

use super::options::MergeOptions;
use super::spliced::{groups_valid, CopiedBase64, Piece, Recoded};
use super::suspects::checked_npy_header;

use crate::body::{coverage, Found};
use crate::formats::{npy, sidecar, Format, Hints, Rule};
use crate::kernels::b64;
use crate::kernels::b64_pieces::B64Out;
use crate::payload::{merge, Header, Shape};

/// One half's `.npy` text, its header read and checked as the decoding path checks it.
struct NpyText<'a> {
    /// The JSON string's content: base64 of the whole file.
    text: &'a [u8],
    /// The rows' header, with the start the caller gave (vLLM's text carries none).
    header: Header,
    /// Where the rows begin in the file.
    data_offset: usize,
    /// The walk found `text` to be base64 characters (`Found::base64`).
    base64: bool,
}

/// The merged value's pieces (a JSON string with `keep_format`, else a compact sidecar's
/// object) when both halves are vLLM's `.npy` text of one dtype that the decoding path would
/// read; `None` for anything else, and for any error found before a byte is copied: the
/// decoding path then merges or refuses the pair, with its own message. What is left to fail
/// later (a bad character inside text that is copied) fails as the decoding path does, with
/// the same message (`Piece::Base64`), and prefill's before decode's, as it decodes them.
pub(super) fn merge_npy_text<'a>(
    p: &Found<'a>,
    d: &Found<'a>,
    opts: &MergeOptions,
) -> Option<Vec<Piece<'a>>> {
    let prefill = read_side(p, opts.hints.start, opts)?;
    let decode = read_side(d, opts.decode_start.or(opts.hints.start), opts)?;
    if prefill.header.dtype != decode.header.dtype {
        return None;
    }
    let plan = merge::plan(&prefill.header, &decode.header).ok()?;
    let row_bytes = decode.header.row_bytes();
    let prefill_rows = prefill.header.shape.tokens * row_bytes;
    // Decode's rows that follow prefill's: bytes `[kept, end)` of its file.
    let end = decode.data_offset + decode.header.shape.tokens * row_bytes;
    let kept = decode.data_offset + plan.skip * row_bytes;
    if !dropped_text_valid(&decode, kept, end) {
        return None;
    }
    let header = match opts.keep_format {
        true => npy::write_header(plan.header.dtype, plan.header.shape),
        false => Vec::new(),
    };
    // The output's text is written into one buffer, never grown (a move of megabytes); or,
    // when the text encoded again is left to be written as it is sent, into small ones (a
    // buffer the size of the output would stay allocated with the piece it ends in).
    let whole_output = b64::encoded_len(header.len() + prefill_rows + (end - kept));
    let mut join = TextJoin {
        encoded: Vec::with_capacity(if opts.defer_recode { 0 } else { whole_output }),
        defer_recode: opts.defer_recode,
        ..TextJoin::default()
    };
    join.bytes(&header);
    let rows = prefill.data_offset..prefill.data_offset + prefill_rows;
    join.text_range(&prefill, rows, "prefill").ok()?;
    join.text_range(&decode, kept..end, "decode").ok()?;
    if !opts.keep_format {
        return Some(sidecar::wrap_base64(&plan.header, join.finish()));
    }
    let mut pieces = vec![Piece::Copy(Cow::Borrowed(b"\""))];
    pieces.extend(join.finish());
    pieces.push(Piece::Copy(Cow::Borrowed(b"\"")));
    Some(pieces)
}

/// The rows of `f`, vLLM's `.npy` text, as the pieces of a compact sidecar (a shared-prompt
/// answer's prompt, format.md §4.1), with their header: the text re-encoded on the sidecar's
/// grid a block at a time, or left to be written as it is sent (`defer_recode`). `None` for
/// anything the decoding path is left to read or refuse, as in [`merge_npy_text`].
pub(super) fn rows_as_compact<'a>(
    f: &Found<'a>,
    opts: &MergeOptions,
) -> Option<(Header, Vec<Piece<'a>>)> {
    let side = read_side(f, opts.hints.start, opts)?;
    let rows =
        side.data_offset..side.data_offset + side.header.shape.tokens * side.header.row_bytes();
    let mut join = TextJoin {
        defer_recode: opts.defer_recode,
        ..TextJoin::default()
    };
    join.text_range(&side, rows, "prefill").ok()?;
    Some((
        side.header,
        sidecar::wrap_base64(&side.header, join.finish()),
    ))
}

/// A decode value's rows after the prompt's (a shared-prompt answer's choice, format.md §4.1),
/// vLLM's `.npy` text, as the pieces of a compact sidecar: its text copied where it lies on the
/// sidecar's grid, else re-encoded a block at a time or as it is sent (`defer_recode`), never
/// held decoded. `None` for anything the decoding path is left to read or refuse (a value that
/// does not join the prompt's rows among them, with its own error there).
pub(super) fn own_rows_as_compact<'a>(
    f: &Found<'a>,
    prompt: &Header,
    opts: &MergeOptions,
) -> Option<Vec<Piece<'a>>> {
    let side = read_side(f, opts.decode_start.or(opts.hints.start), opts)?;
    merge::plan(prompt, &side.header).ok()?;
    // The plan held: decode starts at or before the prompt's end and stops at or after it.
    let skip = usize::try_from(prompt.stop().checked_sub(side.header.start)?).ok()?;
    let tokens = side.header.shape.tokens.checked_sub(skip)?;
    let shape = Shape {
        tokens,
        ..side.header.shape
    };
    let own = Header::new(prompt.stop(), shape, side.header.dtype).ok()?;
    let row = side.header.row_bytes();
    let rows = side.data_offset + skip * row..side.data_offset + side.header.shape.tokens * row;
    if !dropped_text_valid(&side, rows.start, rows.end) {
        return None;
    }
    let mut join = TextJoin {
        defer_recode: opts.defer_recode,
        ..TextJoin::default()
    };
    join.text_range(&side, rows, "decode").ok()?;
    Some(sidecar::wrap_base64(&own, join.finish()))
}

/// Whether the text of `half` that nothing copies or decodes (its file's bytes before `kept`, of
/// rows `[kept, end)` taken; all of it when none are) reads as the decoding path would read it:
/// a value is refused alike whichever path merges it.
fn dropped_text_valid(half: &NpyText, kept: usize, end: usize) -> bool {
    let dropped = if kept < end {
        &half.text[..(kept / 3 * 4).min(half.text.len())]
    } else {
        half.text
    };
    groups_valid(dropped, dropped.len() == half.text.len(), half.base64)
}

/// `f` as `.npy` text whose header, length and counts pass every check the decoding path makes
/// before it decodes the rows; `None` otherwise.
fn read_side<'a>(f: &Found<'a>, start: Option<u64>, opts: &MergeOptions) -> Option<NpyText<'a>> {
    let format = Format::VllmNpy;
    let rule = Rule::of(format, f.place);
    if f.fields.is_some() || rule == Rule::WholeWithFiller {
        return None;
    }
    let hints = Hints {
        start,
        dtype: opts.hints.dtype.or(f.dtype),
        ..opts.hints
    };
    let (text, header, data_offset) = checked_npy_header(f, &hints, opts.max_bytes)?;
    let file = data_offset.saturating_add(header.shape.nbytes(header.dtype).ok()?);
    crate::limits::check(file, opts.max_bytes.saturating_add(4096)).ok()?;
    coverage::check(rule, format, &header, &f.counts, start.is_some()).ok()?;
    Some(NpyText {
        text,
        header,
        data_offset,
        base64: f.base64,
    })
}

/// The base64 text of a byte sequence built from new bytes and ranges of other base64 texts'
/// bytes: a range whose groups fall on the output's is copied as text, except the bytes before
/// its first whole group and after its last; the rest is decoded and encoded a block at a time.
#[derive(Default)]
struct TextJoin<'a> {
    pieces: Vec<Piece<'a>>,
    /// Text encoded since the last piece.
    encoded: Vec<u8>,
    /// The encoder, which holds the `at % 3` bytes of an unfinished group.
    enc: B64Out,
    /// Bytes of the output so far, those of an unfinished group included.
    at: usize,
    /// A block of decoded rows.
    scratch: Vec<u8>,
    /// Leave text re-encoded from text on another grid to be written when sent
    /// (`MergeOptions::defer_recode`).
    defer_recode: bool,
}

impl<'a> TextJoin<'a> {
    /// Bytes of the output: encoded, but for an unfinished last group.
    fn bytes(&mut self, b: &[u8]) {
        self.at += b.len();
        self.enc.push(b, &mut self.encoded);
    }

    /// Bytes `[from, to)` of the file base64 `text` encodes, decoded a block at a time.
    fn decoded(&mut self, text: &[u8], from: usize, to: usize) -> crate::error::Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let done = b64::decode_range_blocks(text, from, to, &mut scratch, |b| self.bytes(b));
        self.scratch = scratch;
        done
    }

    /// Bytes `[from, to)` of `half`'s file, whose groups do not fall on the output's: decoded
    /// and encoded again, now or (`defer_recode`, text the scan found to be base64 characters)
    /// as the body is sent, for all but the bytes that finish the output's unfinished group
    /// and those of the file's last group (whose padding decoding checks).
    fn recoded(&mut self, half: &NpyText<'a>, from: usize, to: usize) -> crate::error::Result<()> {
        let (head, later) = Recoded::largest_after(half.text, (from, to), self.at);
        self.decoded(half.text, from, head)?;
        let Some(later) = later.filter(|_| self.defer_recode && half.base64) else {
            return self.decoded(half.text, head, to);
        };
        // The output is at a group boundary (`at` is past `head`), so the encoder holds no
        // byte: the text written as it is sent follows what it wrote.
        self.flush();
        self.pieces.push(Piece::Recode(later));
        let done = later.bytes().end;
        self.at += done - head;
        self.decoded(half.text, done, to)
    }

    /// Bytes `range` of `half`'s file (`side` names it in an error).
    fn text_range(
        &mut self,
        half: &NpyText<'a>,
        range: std::ops::Range<usize>,
        side: &'static str,
    ) -> crate::error::Result<()> {
        let (text, from, to) = (half.text, range.start, range.end);
        if from >= to {
            return Ok(());
        }
        if self.at % 3 != from % 3 {
            return self.recoded(half, from, to);
        }
        // The range's first and last group boundaries, in its file and so in the output.
        let first = from.next_multiple_of(3).min(to);
        let last = (to / 3 * 3).max(first);
        self.decoded(text, from, first)?;
        if last > first {
            // `at` and `from` agree mod 3, so the output is now at a group boundary: no
            // unfinished group is held.
            debug_assert_eq!(self.at % 3, 0);
            self.flush();
            let (a, b) = (first / 3 * 4, last / 3 * 4);
            self.pieces.push(Piece::Base64(CopiedBase64 {
                text: text
                    .get(a..b)
                    .ok_or_else(|| b64::error_in(text, "vllm_npy"))?,
                last: b == text.len(),
                whole: text,
                field: "vllm_npy",
                context: side.to_string(),
                scanned: half.base64,
            }));
            self.at += last - first;
        }
        self.decoded(text, last, to)
    }

    /// The text encoded so far, as a piece.
    fn flush(&mut self) {
        if !self.encoded.is_empty() {
            let encoded = std::mem::take(&mut self.encoded);
            self.pieces.push(Piece::Copy(Cow::Owned(encoded)));
        }
    }

    /// The pieces of the whole text (a last partial group padded).
    fn finish(mut self) -> Vec<Piece<'a>> {
        self.enc.finish(&mut self.encoded);
        self.flush();
        self.pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::read_body;
    use crate::formats::Hints;
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::payload::dtype::DType;
    use crate::payload::{DTypeChoice, Payload, Shape};
    use crate::response::{merge_response, merge_response_pieces, MergeOptions, Part};

    /// A body as vLLM sends it: one choice, its `.npy` text, the usage counts when given.
    fn body(npy: &[u8], counts: Option<(usize, usize)>) -> Vec<u8> {
        let usage = counts.map_or(String::new(), |(p, g)| {
            format!(r#","usage":{{"prompt_tokens":{p},"completion_tokens":{g}}}"#)
        });
        let text = String::from_utf8(b64::encode(npy)).unwrap();
        format!(r#"{{"choices":[{{"index":0,"text":"x","routed_experts":"{text}"}}]{usage}}}"#)
            .into_bytes()
    }

    /// `rows` of `truth` as a `.npy` file, its header padded by `extra` more 64-byte blocks
    /// than `np.save` writes (a file `np.load` reads the same, whose rows sit elsewhere).
    fn npy_file(truth: &Payload, rows: std::ops::Range<usize>, extra: usize) -> Vec<u8> {
        let (dtype, row) = (truth.dtype(), truth.header().row_bytes());
        let shape = Shape {
            tokens: rows.len(),
            ..truth.shape()
        };
        let mut file = npy::write_header(dtype, shape);
        if extra > 0 {
            // Spaces before the header's closing newline; its length field grows with them.
            file.pop();
            file.extend(std::iter::repeat_n(b' ', 64 * extra));
            file.push(b'\n');
            let len = u16::try_from(file.len() - 10).unwrap().to_le_bytes();
            file[8..10].copy_from_slice(&len);
        }
        file.extend_from_slice(&truth.bytes()[rows.start * row..rows.end * row]);
        file
    }

    struct Case {
        prefill: Vec<u8>,
        decode: Vec<u8>,
        opts: MergeOptions,
        truth: Payload,
        want: std::ops::Range<usize>,
    }

    /// A random P/D pair as vLLM 0.32 answers it: prefill rows `[S, P)`, decode's from a start
    /// between `S` and `P` (the router's `max(S, P - 1)` among them) to `P + G - 1`.
    fn case(next: &mut impl FnMut() -> u64) -> Case {
        let dtype = DType::ALL[next() as usize % DType::ALL.len()];
        let (layers, top_k) = (1 + next() as usize % 5, 1 + next() as usize % 4);
        let prompt = 1 + next() as usize % 40;
        let generated = 1 + next() as usize % 12;
        let start = (next() % 2 == 0).then(|| next() as usize % prompt);
        let s = start.unwrap_or(0);
        let from = s + next() as usize % (prompt - s + 1);
        let stop = prompt + generated - 1;
        let values: Vec<i64> = (0..(stop * layers * top_k))
            .map(|_| (next() % 100) as i64)
            .collect();
        let truth = Payload::from_values(
            &values,
            Shape::new(stop, layers, top_k),
            0,
            DTypeChoice::Exact(dtype),
        )
        .unwrap();
        let counts = next() % 3 != 0;
        let prefill_extra = usize::from(next() % 5 == 0);
        let decode_extra = usize::from(next() % 5 == 0);
        // Decode's zero-row value (every row in prefill) needs `from == stop`: never here,
        // as `from <= P <= stop` and `stop == P` only for one generated token.
        let prefill = body(
            &npy_file(&truth, s..prompt, prefill_extra),
            counts.then_some((prompt, 1)),
        );
        let decode = body(
            &npy_file(&truth, from..stop, decode_extra),
            counts.then_some((prompt, generated)),
        );
        let opts = MergeOptions {
            hints: Hints {
                start: start.map(|s| s as u64),
                ..Hints::default()
            },
            decode_start: Some(from as u64),
            keep_format: true,
            ..MergeOptions::new(DEFAULT_MAX_BYTES)
        };
        Case {
            prefill,
            decode,
            opts,
            truth,
            want: s..stop,
        }
    }

    /// How many pieces of text the text merge copies (`None` when it passed the pair on).
    fn by_text(prefill: &[u8], decode: &[u8], opts: &MergeOptions) -> Option<usize> {
        let (p, d) = (read_body(prefill).unwrap(), read_body(decode).unwrap());
        let pieces = merge_npy_text(&p.values[0], &d.values[0], opts)?;
        Some(
            pieces
                .iter()
                .filter(|p| matches!(p, Piece::Base64(_)))
                .count(),
        )
    }

    /// The merged body as a server sends it: with `defer_recode`, its recoded text written in
    /// parts of random lengths (multiples of 3 bytes); also how many recoded parts it had.
    fn sent(
        prefill: &[u8],
        decode: &[u8],
        opts: MergeOptions,
        next: &mut impl FnMut() -> u64,
    ) -> crate::error::Result<(Vec<u8>, usize)> {
        let mut spliced = merge_response_pieces(prefill, decode, opts)?;
        let (mut out, mut recoded) = (Vec::new(), 0);
        for part in spliced.take_checked_recoded_parts()? {
            match part {
                Part::Bytes(b) => out.extend_from_slice(&b),
                Part::Recoded(r) => {
                    let before = out.len();
                    r.write_in_parts(|| 3 * (1 + next() % 6) as usize, &mut out);
                    assert_eq!(out.len() - before, r.len());
                    recoded += 1;
                }
            }
        }
        Ok((out, recoded))
    }

    /// The text merge writes what decoding, merging and encoding write, byte for byte, as
    /// `.npy` and as a compact sidecar (its re-encoded text written in the merge or as it is
    /// sent), and that is the truth's rows; it takes every sound pair of one dtype.
    #[test]
    fn the_text_merge_is_the_decoding_merge() {
        let mut next = crate::test_rng::xorshift(0x9e37_79b9_7f4a_7c15);
        let (mut copied, mut both, mut deferred) = (0, 0, 0);
        for trial in 0..1200 {
            let mut c = case(&mut next);
            // Half the pairs kept as `.npy`, half written as compact sidecars.
            c.opts.keep_format = trial % 2 == 0;
            c.opts.defer_recode = next() % 2 == 0;
            let pieces = by_text(&c.prefill, &c.decode, &c.opts).expect("taken");
            if c.opts.keep_format {
                copied += usize::from(pieces > 0);
                both += usize::from(pieces > 1);
            }
            let (fast, recoded) = sent(&c.prefill, &c.decode, c.opts, &mut next).unwrap();
            // Text is left to be written as it is sent only when asked (as `.npy`, only where a
            // half's header is longer than the output's).
            assert!(recoded == 0 || c.opts.defer_recode);
            deferred += usize::from(recoded > 0);
            let slow = MergeOptions {
                splice: false,
                ..c.opts
            };
            let slow = merge_response(&c.prefill, &c.decode, slow).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&fast),
                String::from_utf8_lossy(&slow)
            );
            let merged = crate::response::from_response(&fast, 0, &c.opts.hints, DEFAULT_MAX_BYTES)
                .unwrap()
                .unwrap();
            let row = c.truth.header().row_bytes();
            assert_eq!(
                merged.bytes(),
                &c.truth.bytes()[c.want.start * row..c.want.end * row]
            );
        }
        // Text was copied in most pairs, from both halves in some; left to be written as it
        // is sent in many.
        assert!(
            copied > 300 && both > 50 && deferred > 100,
            "{copied} {both} {deferred}"
        );
    }

    /// Text that cannot be read fails as the decoding path fails, with its message: a bad
    /// character or a cut anywhere in either half.
    #[test]
    fn bad_text_fails_as_decoding_fails() {
        let mut next = crate::test_rng::xorshift(0x0123_4567_89ab_cdef);
        let flaws: [&[u8]; 5] = [b"*", b"=", b"A", b"/", b"\\u0041"];
        let (mut failed, mut taken) = (0, 0);
        for trial in 0..3000 {
            let mut c = case(&mut next);
            c.opts.keep_format = trial % 2 == 0;
            c.opts.defer_recode = next() % 2 == 0;
            let half = if next() % 2 == 0 {
                &mut c.prefill
            } else {
                &mut c.decode
            };
            let text = half.windows(2).position(|w| w == b"\"k").unwrap() + 1;
            let len = half[text..].iter().position(|&b| b == b'"').unwrap();
            // A third of the flaws in the last groups, where a copy ends.
            let at = match next() % 3 {
                0 => text + len - 1 - next() as usize % len.min(8),
                _ => text + next() as usize % len,
            };
            let flaw = flaws[next() as usize % flaws.len()];
            half.splice(at..at + usize::from(next() % 4 != 0), flaw.iter().copied());
            let (p, d) = (read_body(&c.prefill), read_body(&c.decode));
            if p.is_ok_and(|p| {
                d.is_ok_and(|d| merge_npy_text(&p.values[0], &d.values[0], &c.opts).is_some())
            }) {
                taken += 1;
            }
            let fast = sent(&c.prefill, &c.decode, c.opts, &mut next)
                .map(|(body, _)| body)
                .map_err(|e| e.to_string());
            let slow = MergeOptions {
                splice: false,
                ..c.opts
            };
            let slow = merge_response(&c.prefill, &c.decode, slow).map_err(|e| e.to_string());
            assert_eq!(
                fast.as_ref().map(|b| String::from_utf8_lossy(b)),
                slow.as_ref().map(|b| String::from_utf8_lossy(b))
            );
            failed += usize::from(fast.is_err());
        }
        // Most flaws are found, some of them in text the merge took to copy.
        assert!(failed > 2000 && taken > 400, "{failed} {taken}");
    }
}
