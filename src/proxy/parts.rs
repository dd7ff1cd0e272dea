//! Bodies sent as parts: a merged body is mostly slices of the two bodies it was merged from,
//! so it goes out as those slices (one vectored write) instead of being assembled first.

use std::convert::Infallible;

use bytes::Bytes;
use hyper::body::Frame;

use super::budget::Share;
use crate::response::Spliced;

/// A merged body's slices as `Bytes` sharing the buffers of `sources` (the bodies it was
/// merged from); only the parts the merge wrote are copied (they are small).
pub fn shared_slices(spliced: &Spliced<'_>, sources: &[&Bytes]) -> crate::Result<Vec<Bytes>> {
    let within = |b: &Bytes, s: &[u8]| {
        let (start, p) = (b.as_ptr() as usize, s.as_ptr() as usize);
        p >= start && p + s.len() <= start + b.len()
    };
    Ok(spliced
        .checked_slices()?
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|s| match sources.iter().find(|b| within(b, s)) {
            Some(b) => b.slice_ref(s),
            None => Bytes::copy_from_slice(s),
        })
        .collect())
}

/// A whole body sent as its parts (vectored writes), with its length known up front; it
/// holds the budget of the bodies its parts share until it is sent or dropped.
pub struct PartsBody {
    parts: std::collections::VecDeque<Bytes>,
    remaining: u64,
    _held: [Share; 2],
}

impl PartsBody {
    /// `parts` in order, holding `held` until the body is sent or dropped.
    pub fn new(parts: Vec<Bytes>, held: [Share; 2]) -> Self {
        let remaining = parts.iter().map(|b| b.len() as u64).sum();
        PartsBody {
            parts: parts.into(),
            remaining,
            _held: held,
        }
    }
}

impl hyper::body::Body for PartsBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let next = self.parts.pop_front();
        if let Some(b) = &next {
            self.remaining -= b.len() as u64;
        }
        std::task::Poll::Ready(next.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.remaining)
    }
}
