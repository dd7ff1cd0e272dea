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
use routed_experts::response::Spliced;

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

/// A merged body's parts as `Bytes`, taken out of `spliced`: slices share the buffers of
/// `sources` (the bodies it was merged from), and the parts the merge wrote are moved, not
/// copied (a re-encoded routing value can be most of the body).
pub fn shared_slices(
    spliced: &mut Spliced<'_>,
    sources: &[&Bytes],
) -> routed_experts::Result<Vec<Bytes>> {
    let within = |b: &Bytes, s: &[u8]| {
        let (start, p) = (b.as_ptr() as usize, s.as_ptr() as usize);
        p >= start && p + s.len() <= start + b.len()
    };
    Ok(spliced
        .take_checked_parts()?
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|s| match s {
            Cow::Owned(v) => Bytes::from(v),
            Cow::Borrowed(s) => match sources.iter().find(|b| within(b, s)) {
                Some(b) => b.slice_ref(s),
                None => Bytes::copy_from_slice(s),
            },
        })
        .collect())
}

/// A whole body sent as its parts (vectored writes), with its length known up front; what
/// `held` holds (the budget of the bodies its parts share, the request's slot) stays held
/// until the last part is written or the body is dropped.
pub struct PartsBody {
    parts: std::collections::VecDeque<Bytes>,
    remaining: u64,
    held: Held,
}

impl PartsBody {
    /// `parts` in order, each holding `held` until it is written.
    pub fn new(parts: Vec<Bytes>, held: Held) -> Self {
        let remaining = parts.iter().map(|b| b.len() as u64).sum();
        PartsBody {
            parts: parts.into(),
            remaining,
            held,
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
        let next = self.parts.pop_front();
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
        let parts = shared_slices(&mut spliced, &[&p, &d]).unwrap();
        assert_eq!(parts.concat(), want);
        // The decode body's text before its routing is a slice of it, not a copy.
        let first = &parts[0];
        let within = |b: &Bytes| {
            let (s, f) = (b.as_ptr() as usize, first.as_ptr() as usize);
            f >= s && f + first.len() <= s + b.len()
        };
        assert!(within(&d), "the first part was copied");
        // As a body: the exact size up front, then the parts in order.
        let body = PartsBody::new(parts, Arc::new(()));
        assert_eq!(body.size_hint().exact(), Some(want.len() as u64));
    }

    #[test]
    fn outgoing_bytes_are_read_and_advanced_as_a_buf() {
        let mut o = Outgoing::from(Bytes::from_static(b"abcdef"));
        assert_eq!((o.remaining(), o.chunk()), (6, &b"abcdef"[..]));
        o.advance(4);
        assert_eq!(o.chunk(), b"ef");
    }
}
