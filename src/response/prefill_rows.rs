//! Prefill's side of a streaming merge, built once per stream: for each routing value its
//! header, and its rows where they can be read from when the merge sends them (the base64 text
//! of a compact sidecar or a vLLM `.npy` value, decoded piece by piece then, so nothing more is
//! held; other formats decoded now), and what a merge of any decode routing with this body
//! would refuse.

use std::borrow::Cow;

use serde_json::Value;

use super::options::side_hints;
use super::options::MergeOptions;
use super::read::decode_found;
use super::spliced::Recoded;
use super::suspects::checked_npy_header;
use crate::body::{split, BodyRouting, Found};
use crate::error::{Error, Result};
use crate::formats::sidecar::{self, DataField, SidecarFields};
use crate::formats::{check_hints, Format, Hints};
use crate::kernels::b64;
use crate::kernels::b64_pieces::B64Out;
use crate::payload::dtype::DType;
use crate::payload::{Header, Payload};

/// The prefill body's routing as every event of a stream merges with it, found by choice index
/// as `merge_response` finds it. It borrows the body: `.npy` rows are read from its text.
#[derive(Debug)]
pub struct PrefillRows<'b> {
    /// (choice index, the value with the hints the merge applies, or why it does not decode).
    values: Vec<(u64, Result<PrefillValue<'b>>)>,
    /// Why any decode routing is refused whatever it is (routing weights, a sidecar key a merge
    /// would drop), as `merge_response` checks before it merges.
    refusal: Option<Error>,
    /// vLLM 0.21's split prompt rows: merged by `split`, which is not streamed.
    split: bool,
}

/// One prefill value: its header, and where its rows come from.
#[derive(Debug)]
pub(crate) struct PrefillValue<'b> {
    header: Header,
    rows: Rows<'b>,
}

#[derive(Debug)]
enum Rows<'b> {
    Decoded(Payload),
    /// Base64 text in the body (no escapes), whose rows start `skip` bytes in (a `.npy`
    /// file's header; none for a compact sidecar). `scanned`: the walk found it to be base64
    /// characters then at most two `=`.
    Base64 {
        text: &'b [u8],
        skip: usize,
        scanned: bool,
    },
}

/// Prefill's rows as a streamed merge leaves them to be written as they are sent: decoded
/// bytes pushed before and after, whole groups of text between.
struct Split<'b> {
    head: Vec<u8>,
    later: Recoded<'b>,
    tail: Vec<u8>,
}

/// Characters of base64 text decoded at a time when its rows are sent (whole groups).
const TEXT_PIECE: usize = 64 * 1024;

impl<'b> PrefillRows<'b> {
    /// Read the prefill body's routing (as `read_prefill` or `read_body` found it) once. A
    /// value that does not decode is kept as its error: the merge fails with it only if a
    /// decode value is merged with it, as `merge_response` would.
    pub fn new(routing: &BodyRouting<'b>, opts: &MergeOptions) -> PrefillRows<'b> {
        let values = routing
            .values
            .iter()
            .map(|f| {
                let hints = side_hints(f, opts.hints.start, opts);
                let value = in_text(f, &hints, opts.max_bytes)
                    .map(Ok)
                    .unwrap_or_else(|| {
                        decode_found(f, &hints, opts.max_bytes).map(|(_, p)| PrefillValue {
                            header: p.header(),
                            rows: Rows::Decoded(p),
                        })
                    })
                    .map_err(|e| e.context("prefill"));
                (f.index, value)
            })
            .collect();
        let refusal = routing
            .weights
            .as_deref()
            .map(split::weights_error)
            .or_else(|| {
                routing.values.iter().find_map(|f| {
                    let key = f.fields.as_ref()?.extra_key.as_deref()?;
                    Some(sidecar::extra_key_error(&f.path, key))
                })
            });
        PrefillRows {
            values,
            refusal,
            split: routing.prompt.is_some(),
        }
    }

    /// Whether the body carries no routing.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && !self.split
    }

    /// Bytes of decoded rows held (rows read from the body's text as they are sent: none).
    pub fn held_bytes(&self) -> usize {
        self.values
            .iter()
            .map(|(_, v)| match v {
                Ok(PrefillValue {
                    rows: Rows::Decoded(p),
                    ..
                }) => p.bytes().len(),
                _ => 0,
            })
            .sum()
    }

    pub(crate) fn refusal(&self) -> Option<&Error> {
        self.refusal.as_ref()
    }

    pub(crate) fn split(&self) -> bool {
        self.split
    }

    /// Whether every value is one choice's, so it serves every decode choice whatever its
    /// index (`one_choice` in the whole merge).
    pub(crate) fn one_choice(&self) -> bool {
        self.values
            .first()
            .is_some_and(|(i, _)| self.values.iter().all(|(j, _)| j == i))
    }

    /// The value a decode choice merges with (`None`: missing on the prefill side).
    pub(crate) fn for_choice(&self, index: u64) -> Option<&Result<PrefillValue<'b>>> {
        self.values
            .iter()
            .find(|(i, _)| *i == index)
            .or_else(|| self.one_choice().then(|| &self.values[0]))
            .map(|(_, p)| p)
    }
}

impl<'b> PrefillValue<'b> {
    pub(crate) fn header(&self) -> Header {
        self.header
    }

    pub(crate) fn dtype(&self) -> DType {
        self.header.dtype
    }

    /// [`push_rows`](Self::push_rows), but for the rows whose text can be written as it is
    /// sent (whole groups of text the walk found to be base64, short of its last group): those
    /// are handed back as a [`Recoded`] part, with where in `out` it goes (the bytes pushed
    /// before and after it are in `out`). `None`: the rows were all pushed (values decoded as
    /// they were read, text not scanned, too short, or not what its header says, whose error
    /// is the one `push_rows` gives).
    pub(crate) fn push_rows_deferred(
        &self,
        enc: &mut B64Out,
        out: &mut Vec<u8>,
    ) -> Result<Option<(usize, Recoded<'b>)>> {
        match self.defer(enc.held())? {
            None => self.push_rows(enc, out).map(|()| None),
            Some(Split { head, later, tail }) => {
                enc.push(&head, out);
                debug_assert_eq!(enc.held(), 0, "the later text starts on an output group");
                let at = out.len();
                enc.push(&tail, out);
                Ok(Some((at, later)))
            }
        }
    }

    /// The rows split for [`push_rows_deferred`](Self::push_rows_deferred): the bytes that
    /// finish the output's unfinished group (`held` bytes of it taken), the whole groups left
    /// to be written as they are sent, and the bytes after them (the text's last group, whose
    /// padding decoding checks, among them). `None` when nothing can be left.
    fn defer(&self, held: usize) -> Result<Option<Split<'b>>> {
        let Rows::Base64 {
            text,
            skip,
            scanned: true,
        } = self.rows
        else {
            return Ok(None);
        };
        let want = self.header.shape.nbytes(self.header.dtype)?;
        // Text that does not hold exactly its header's bytes goes the eager way, for its error.
        match b64::decoded_len(text, "data") {
            Ok(total) if total.checked_sub(skip) == Some(want) => {}
            _ => return Ok(None),
        }
        let (from, to) = (skip, skip + want);
        let (head, Some(later)) = Recoded::largest_after(text, (from, to), held) else {
            return Ok(None);
        };
        match (
            b64::decode_range(text, from, head),
            b64::decode_range(text, later.bytes().end, to),
        ) {
            (Ok(head), Ok(tail)) => Ok(Some(Split { head, later, tail })),
            _ => Ok(None),
        }
    }

    /// Encode the rows after what `enc` took. Text that turns out not to be strict base64 is
    /// an error here (the whole merge refuses it too).
    pub(crate) fn push_rows(&self, enc: &mut B64Out, out: &mut Vec<u8>) -> Result<()> {
        let (text, mut skip) = match &self.rows {
            Rows::Decoded(p) => {
                enc.push(p.bytes(), out);
                return Ok(());
            }
            Rows::Base64 { text, skip, .. } => (*text, *skip),
        };
        let mut piece = Vec::with_capacity(TEXT_PIECE / 4 * 3);
        let mut sent = 0usize;
        for groups in text.chunks(TEXT_PIECE) {
            piece.clear();
            let whole = groups.len() / 4 * 3;
            let n = b64::decode_piece(groups, piece.spare_capacity_mut())
                .filter(|&n| n <= whole && (n == whole || groups.len() < TEXT_PIECE))
                .ok_or_else(|| b64::error_in(text, "data").context("prefill"))?;
            // SAFETY: `decode_piece` initialised the first `n` bytes of the spare capacity.
            unsafe { piece.set_len(n) };
            let from = skip.min(n);
            skip -= from;
            enc.push(&piece[from..], out);
            sent += n - from;
        }
        let want = self.header.shape.nbytes(self.header.dtype)?;
        if sent != want {
            return Err(Error::malformed(format!(
                "expected {want} data bytes for shape {} of {}, got {sent}",
                self.header.shape, self.header.dtype
            ))
            .context("prefill"));
        }
        Ok(())
    }
}

/// A value whose rows can be read from the body's text when they are sent (a compact sidecar,
/// or vLLM's `.npy`), its header checked as the whole decode checks it (`None`: decoded now
/// instead, for its errors).
fn in_text<'b>(f: &Found<'b>, hints: &Hints, max_bytes: usize) -> Option<PrefillValue<'b>> {
    if f.dtype.is_some() {
        return None; // SGLang's dtype key: decoded now
    }
    if let Some(fields) = &f.fields {
        let Some(DataField::Base64(Cow::Borrowed(text))) = fields.data else {
            return None;
        };
        let scanned = fields.data_base64;
        // The fields without any bytes decoded as they were read (those are not copied).
        let fields = SidecarFields {
            data: Some(DataField::Base64(Cow::Borrowed(text))),
            shape: fields.shape.clone(),
            start: fields
                .start
                .clone()
                .or_else(|| hints.start.map(Value::from)),
            dtype: fields.dtype.clone(),
            body_key: fields.body_key,
            foreign_key: fields.foreign_key,
            extra_key: fields.extra_key.clone(),
            decoded: None,
            data_base64: fields.data_base64,
            predecoded: false,
        };
        let header = sidecar::validate(fields, max_bytes).ok()?.header;
        check_hints(Format::Compact, &header, hints).ok()?;
        return Some(PrefillValue {
            header,
            rows: Rows::Base64 {
                text,
                skip: 0,
                scanned,
            },
        });
    }
    let (text, header, skip) = checked_npy_header(f, hints, max_bytes)?;
    Some(PrefillValue {
        header,
        rows: Rows::Base64 {
            text,
            skip,
            scanned: f.base64,
        },
    })
}
