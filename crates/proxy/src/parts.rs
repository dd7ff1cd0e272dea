//! Bodies sent as parts: a merged body is mostly slices of the two bodies it was merged from,
//! so it goes out as those slices (one vectored write) instead of being assembled first. Every
//! part carries what must stay held until hyper has written it (its budget share, the
//! request's completion slot), so the budget counts bytes until they leave, not until hyper
//! takes them into its write queue.

use std::any::Any;
use std::borrow::Cow;
use std::convert::Infallible;
use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use hyper::body::Frame;

use super::budget::Share;
use std::ops::Range;

use routed_experts::response::{Part as SplicedPart, Recoded, Spliced};

/// What a request holds until the last byte of its response is written (its completion slot,
/// the budget shares of the bodies the response slices); shared by every part of it.
pub type Held = Arc<dyn Any + Send + Sync>;

/// Bytes on their way to a client. hyper drops each once it is written to the socket (its
/// vectored write queue keeps them until then), and with it what it holds: its own budget
/// share and a reference to what its request holds.
pub struct Outgoing {
    bytes: Bytes,
    _share: Option<Share>,
    _held: Option<Held>,
}

impl Outgoing {
    /// `bytes` holding `share` (the budget that counts them) and `held` until written.
    pub fn new(bytes: Bytes, share: Option<Share>, held: Option<Held>) -> Self {
        Outgoing {
            bytes,
            _share: share,
            _held: held,
        }
    }
}

impl From<Bytes> for Outgoing {
    fn from(bytes: Bytes) -> Self {
        Outgoing::new(bytes, None, None)
    }
}

impl Buf for Outgoing {
    fn remaining(&self) -> usize {
        self.bytes.len()
    }

    fn chunk(&self) -> &[u8] {
        &self.bytes
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        self.bytes.chunks_vectored(dst)
    }

    fn advance(&mut self, n: usize) {
        self.bytes.advance(n);
    }
}

/// A part as `Bytes`: moved when the merge wrote it, else a slice of the source that holds it
/// (copied only when none does).
fn shared(part: Cow<'_, [u8]>, sources: &[&Bytes]) -> Bytes {
    let within = |b: &Bytes, s: &[u8]| {
        let (start, p) = (b.as_ptr() as usize, s.as_ptr() as usize);
        p >= start && p + s.len() <= start + b.len()
    };
    match part {
        Cow::Owned(v) => Bytes::from(v),
        Cow::Borrowed(s) => match sources.iter().find(|b| within(b, s)) {
            Some(b) => b.slice_ref(s),
            None => Bytes::copy_from_slice(s),
        },
    }
}

/// A part of a merged body on its way out.
pub enum Part {
    /// Bytes sent as they are.
    Ready(Bytes),
    /// Base64 text encoded as it is sent, [`RECODE_PIECE`] bytes' worth at a time (see
    /// [`Recoded`]): bytes `bytes` of the file `text` encodes, from `at` on.
    Recoded {
        text: Bytes,
        bytes: Range<usize>,
        at: usize,
    },
}

impl Part {
    /// Its length in bytes, as sent.
    pub fn len(&self) -> usize {
        match self {
            Part::Ready(b) => b.len(),
            Part::Recoded { bytes, at, .. } => (bytes.len() - at) / 3 * 4,
        }
    }
}

/// Bytes of a recoded part encoded at a time (a multiple of 3): their text, a quarter more,
/// stays in the core's cache until hyper writes it to the socket.
const RECODE_PIECE: usize = 3 * 64 * 1024;

/// A merged body's parts, taken out of `spliced`: slices share the buffers of `sources` (the
/// bodies it was merged from), the parts the merge wrote are moved, not copied, and the text it
/// left to be encoded as it is sent (`MergeOptions::defer_recode`) is a [`Part::Recoded`]
/// sharing its source's buffer.
pub fn shared_parts(
    spliced: &mut Spliced<'_>,
    sources: &[&Bytes],
) -> routed_experts::Result<Vec<Part>> {
    Ok(spliced
        .take_checked_recoded_parts()?
        .into_iter()
        .filter_map(|part| match part {
            SplicedPart::Bytes(b) => (!b.is_empty()).then(|| Part::Ready(shared(b, sources))),
            SplicedPart::Recoded(r) => Some(Part::recoded(r, sources)),
        })
        .collect())
}

/// A whole body sent as its parts (vectored writes), with its length known up front; what
/// `held` holds (the budget of the bodies its parts share, the request's slot) stays held
/// until the last part is written or the body is dropped.
pub struct PartsBody {
    parts: std::collections::VecDeque<Part>,
    remaining: u64,
    held: Held,
}

impl PartsBody {
    /// `parts` in order, each holding `held` until it is written.
    pub fn new(parts: Vec<Part>, held: Held) -> Self {
        let remaining = parts.iter().map(|p| p.len() as u64).sum();
        PartsBody {
            parts: parts.into(),
            remaining,
            held,
        }
    }

    /// The next bytes to send: a ready part, or the next piece of a recoded one (the rest put
    /// back first). `None` at the end, and where text cannot be encoded: the merge made it of
    /// text found to be base64, so that is a defect, and the body then ends short of its
    /// length, which the client sees as a broken response (never as a whole one).
    fn next_bytes(&mut self) -> Option<Bytes> {
        match self.parts.pop_front()?.next_piece() {
            Ok((bytes, rest)) => {
                if let Some(rest) = rest {
                    self.parts.push_front(rest);
                }
                Some(bytes)
            }
            Err(e) => {
                log::error!(target: "routed_experts::proxy",
                    "a merged body's routing text could not be encoded as it was sent \
                     ({e}); the response is cut short");
                self.parts.clear();
                None
            }
        }
    }
}

impl Part {
    /// Its next bytes to send (the whole of a ready part, the next [`RECODE_PIECE`] bytes'
    /// worth of a recoded one, encoded now), and what is left of it. An error where the text
    /// cannot be encoded, which a merge's parts never hold.
    pub fn next_piece(self) -> Result<(Bytes, Option<Part>), String> {
        match self {
            Part::Ready(b) => Ok((b, None)),
            Part::Recoded { text, bytes, at } => {
                let n = RECODE_PIECE.min(bytes.len().saturating_sub(at));
                let mut out = Vec::with_capacity(n / 3 * 4);
                Recoded::new(&text, bytes.clone())
                    .ok_or_else(|| "not whole groups before the text's last".to_string())
                    .and_then(|r| r.write_part(at, n, &mut out).map_err(|e| e.to_string()))?;
                let rest = (at + n < bytes.len()).then(|| Part::Recoded {
                    text,
                    bytes,
                    at: at + n,
                });
                Ok((Bytes::from(out), rest))
            }
        }
    }

    /// A recoded part from a merge's, sharing its text with the body in `sources` that holds
    /// it (copied only when none does).
    pub fn recoded(r: Recoded<'_>, sources: &[&Bytes]) -> Part {
        Part::Recoded {
            text: shared(Cow::Borrowed(r.text()), sources),
            bytes: r.bytes(),
            at: 0,
        }
    }
}

impl hyper::body::Body for PartsBody {
    type Data = Outgoing;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Outgoing>, Infallible>>> {
        let next = self.next_bytes();
        if let Some(b) = &next {
            self.remaining -= b.len() as u64;
        }
        let held = &self.held;
        let frame = next.map(|b| Ok(Frame::data(Outgoing::new(b, None, Some(Arc::clone(held))))));
        std::task::Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::body::Body as _;
    use routed_experts::response::merge_response_pieces;
    use routed_experts::{MergeOptions, DEFAULT_MAX_BYTES};

    const PREFILL: &[u8] = br#"{"choices":[{"index":0,"routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}}]}"#;
    const DECODE: &[u8] = br#"{"choices":[{"index":0,"text":"hi","routed_experts":{"data":"Hh8oKQ==","shape":[2,1,2],"start":2,"dtype":"uint8"}}]}"#;

    #[test]
    fn a_merged_body_goes_out_as_slices_of_its_sources_in_order() {
        let (p, d) = (Bytes::from_static(PREFILL), Bytes::from_static(DECODE));
        let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
        let mut spliced = merge_response_pieces(&p, &d, opts).unwrap();
        let want = spliced.to_vec().unwrap();
        let parts: Vec<Bytes> = shared_parts(&mut spliced, &[&p, &d])
            .unwrap()
            .into_iter()
            .map(|part| match part {
                Part::Ready(b) => b,
                Part::Recoded { .. } => panic!("nothing was left to encode"),
            })
            .collect();
        assert_eq!(parts.concat(), want);
        // The decode body's text before its routing is a slice of it, not a copy.
        let first = &parts[0];
        let within = |b: &Bytes| {
            let (s, f) = (b.as_ptr() as usize, first.as_ptr() as usize);
            f >= s && f + first.len() <= s + b.len()
        };
        assert!(within(&d), "the first part was copied");
        // As a body: the exact size up front, then the parts in order.
        let body = PartsBody::new(parts.into_iter().map(Part::Ready).collect(), Arc::new(()));
        assert_eq!(body.size_hint().exact(), Some(want.len() as u64));
    }

    /// All frames of a body, and its size hint before the first.
    fn frames(mut body: PartsBody) -> (Option<u64>, Vec<Bytes>) {
        let hint = body.size_hint().exact();
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut out = Vec::new();
        while let std::task::Poll::Ready(Some(frame)) =
            std::pin::Pin::new(&mut body).poll_frame(&mut cx)
        {
            let mut data = frame.unwrap().into_data().ok().unwrap();
            out.push(data.copy_to_bytes(data.remaining()));
        }
        assert!(body.is_end_stream());
        (hint, out)
    }

    /// vLLM's `.npy` halves merged into a compact sidecar: the rows' text, on another grid
    /// than prefill's, is left to be encoded as the body is sent, in pieces of at most
    /// RECODE_PIECE bytes' worth, and the body is the merge's to the byte.
    #[test]
    fn recoded_text_is_encoded_in_pieces_as_the_body_is_sent() {
        use routed_experts::{formats, DType, DTypeChoice, Format, Payload, Shape};
        let (layers, top_k, prompt) = (4usize, 2usize, 50_000usize);
        // vLLM's value for rows `rows`: `.npy` text, its rows 128 bytes into the file.
        let npy = |rows: std::ops::Range<usize>| {
            let values: Vec<u8> = (rows.start * layers * top_k..rows.end * layers * top_k)
                .map(|i| (i % 97) as u8)
                .collect();
            let shape = Shape::new(rows.len(), layers, top_k);
            let p = Payload::from_values(&values, shape, 0, DTypeChoice::Exact(DType::U8));
            let json = formats::encode_json(&p.unwrap(), Format::VllmNpy).unwrap();
            String::from_utf8(json).unwrap()
        };
        let body = |text: String, generated: usize| {
            Bytes::from(format!(
                r#"{{"choices":[{{"index":0,"text":"x","routed_experts":{text}}}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{generated}}}}}"#
            ))
        };
        let (p, d) = (
            body(npy(0..prompt), 1),
            body(npy(prompt - 1..prompt + 9), 10),
        );
        let opts = MergeOptions {
            decode_start: Some(prompt as u64 - 1),
            ..MergeOptions::new(DEFAULT_MAX_BYTES)
        };
        let want = merge_response_pieces(&p, &d, opts)
            .unwrap()
            .to_vec()
            .unwrap();
        let deferred = MergeOptions {
            defer_recode: true,
            ..opts
        };
        let mut spliced = merge_response_pieces(&p, &d, deferred).unwrap();
        let parts = shared_parts(&mut spliced, &[&p, &d]).unwrap();
        let recoded = parts
            .iter()
            .filter_map(|part| match part {
                Part::Recoded { text, bytes, .. } => Some((text.clone(), bytes.len())),
                Part::Ready(_) => None,
            })
            .collect::<Vec<_>>();
        // One recoded part, the prefill rows, its text a slice of the prefill body.
        assert_eq!(recoded.len(), 1);
        assert!(recoded[0].1 > 2 * RECODE_PIECE);
        assert!(p.as_ptr_range().contains(&recoded[0].0.as_ptr()));
        let (hint, sent) = frames(PartsBody::new(parts, Arc::new(())));
        assert_eq!(hint, Some(want.len() as u64));
        assert!(sent.iter().all(|b| b.len() <= RECODE_PIECE / 3 * 4));
        assert_eq!(sent.concat(), want);
    }

    /// Text that is not base64 (never a merge's: it finds its text to be) ends the body short
    /// of its length, which the client sees as a broken response.
    #[test]
    fn text_that_cannot_be_encoded_cuts_the_body_short() {
        let text = Bytes::from_static(b"AAAA*AAAAAAAAAAA");
        let parts = vec![
            Part::Ready(Bytes::from_static(b"[")),
            Part::Recoded {
                text,
                bytes: 0..9,
                at: 0,
            },
            Part::Ready(Bytes::from_static(b"]")),
        ];
        let (hint, sent) = frames(PartsBody::new(parts, Arc::new(())));
        assert_eq!((hint, sent.concat()), (Some(14), b"[".to_vec()));
    }

    #[test]
    fn outgoing_bytes_are_read_and_advanced_as_a_buf() {
        let mut o = Outgoing::from(Bytes::from_static(b"abcdef"));
        assert_eq!((o.remaining(), o.chunk()), (6, &b"abcdef"[..]));
        o.advance(4);
        assert_eq!(o.chunk(), b"ef");
    }
}
