//! [`Relay`]: a decode stream relayed to its client as its events come, the one that carries
//! routing merged with prefill's ([`StreamMerger`]), a failure reported in-band as a last error
//! event. The call that opens the stream and starts the relay is `Call::stream` (`call.rs`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::body::{Frame, Incoming};
use hyper::Response;
use tokio::sync::{mpsc, oneshot};

use super::blocking::{blocking_if, BLOCKING_BYTES};
use super::budget::Share;
use super::fault::{stream_fault, Fault};
use super::metrics::Phase;
use super::parts::{Held, Outgoing};
use super::pool::{Lease, Outcome, Side};
use super::proxy::Proxy;
use super::record::Exchange;
use super::responses::Body;
use super::stream_merger::StreamMerger;
use super::upstream::CallError;

/// Pieces of a stream queued for a client that is slower than the decode server.
pub(crate) const STREAM_QUEUE: usize = 16;

/// What a stream task hands back once decode answered: the decode server, the seconds to its
/// head, the response for the client, and where to send the request's record.
pub(crate) type Head = (String, f64, Response<Body>, oneshot::Sender<Exchange>);

/// Aborts a task when dropped (the request it serves was dropped: its client left).
pub(crate) struct AbortOnDrop(pub(crate) Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// A decode stream being relayed to its client.
pub(crate) struct Relay<'a> {
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) url: String,
    pub(crate) record: Exchange,
    pub(crate) lease: Option<Lease>,
    pub(crate) merger: StreamMerger<'a>,
    pub(crate) tx: mpsc::Sender<Outgoing>,
    pub(crate) deadline: tokio::time::Instant,
    pub(crate) began: Instant,
    pub(crate) share: Share, // the bytes of the line being received; pieces sent on carry their own
    pub(crate) held: Held, // the completion slot and the prefill body's budget, until the last piece is written
    pub(crate) ended_line: bool, // whether what was sent so far ends with a newline
}

pub(crate) enum Step {
    Chunk(Option<Bytes>),
    Failed(CallError),
    Expired,
    ClientGone,
}

impl Relay<'_> {
    pub(crate) async fn run(mut self, mut body: Incoming) {
        let proxy = Arc::clone(&self.proxy);
        let (outcome, tail) = loop {
            let step = tokio::select! {
                r = proxy.upstreams.next_chunk(&mut body) => match r {
                    Ok(c) => Step::Chunk(c),
                    Err(e) => Step::Failed(e),
                },
                _ = tokio::time::sleep_until(self.deadline) => Step::Expired,
                _ = self.tx.closed() => Step::ClientGone,
            };
            let mut out = Vec::new();
            let fed = match step {
                Step::Chunk(Some(chunk)) => {
                    let (limit, wait) = (proxy.budget.limit(), proxy.wait_deadline(self.deadline));
                    // The wait for room watches the client too: one that leaves frees its bytes.
                    let grown = tokio::select! {
                        ok = self.share.grow_wait(chunk.len(), limit, wait) => ok,
                        _ = self.tx.closed() => {
                            self.record.finished = false; // recorded as 499
                            break (Outcome::Unknown, None);
                        }
                    };
                    if !grown {
                        let fault = proxy.call_fault(Side::Decode, &self.url, CallError::Budget);
                        break (Outcome::Ok, Some(fault));
                    }
                    let big = self.merger.buffered() + chunk.len() >= BLOCKING_BYTES;
                    blocking_if(big, || self.merger.feed(chunk, &mut out))
                }
                Step::Chunk(None) => match self.merger.finish(&mut out) {
                    Ok(()) => {
                        let sent = self.share.split_beyond(0);
                        self.send_all(out, Some(sent)).await;
                        break (Outcome::Ok, None);
                    }
                    Err(e) => Err(e),
                },
                Step::Failed(e) => {
                    break (
                        Outcome::Failed,
                        Some(proxy.call_fault(Side::Decode, &self.url, e)),
                    );
                }
                Step::Expired => break (Outcome::Ok, Some(proxy.request_timeout_fault())),
                Step::ClientGone => {
                    self.record.finished = false; // recorded as 499
                    break (Outcome::Unknown, None);
                }
            };
            match fed {
                Ok(()) => {
                    // What the merge holds beyond the chunks it was given (prefill's rows
                    // decoded for an event that streams), and what it sends beyond them
                    // (prefill's rows, encoded), are counted too: the reserve prefill's reply
                    // set aside is grown into first.
                    let keep = self.merger.buffered();
                    let more =
                        keep.saturating_sub(self.share.held()) + self.merger.take_output_excess();
                    if more > 0 {
                        let wait = proxy.wait_deadline(self.deadline);
                        if !self.share.grow_wait(more, proxy.budget.limit(), wait).await {
                            let fault =
                                proxy.call_fault(Side::Decode, &self.url, CallError::Budget);
                            break (Outcome::Ok, Some(fault));
                        }
                    }
                    // The bytes sent on stay counted, with the pieces, until they are written;
                    // what stays with the relay is the line held back.
                    let sent = self.share.split_beyond(keep);
                    if !self.send_all(out, Some(sent)).await {
                        self.record.finished = false;
                        break (Outcome::Unknown, None);
                    }
                    match self.send_pending(&proxy).await {
                        Ok(()) => {}
                        Err(None) => {
                            self.record.finished = false;
                            break (Outcome::Unknown, None);
                        }
                        Err(Some(fault)) => break (Outcome::Ok, Some(fault)),
                    }
                }
                Err(e) => {
                    let sent = self.share.split_beyond(0);
                    self.send_all(out, Some(sent)).await;
                    break (Outcome::Ok, Some(stream_fault(e)));
                }
            }
        };
        drop(body); // closes the upstream connection if the stream did not end
        self.proxy.metrics.merged(self.merger.merged_bytes);
        let (prefill_seen, decode_seen) = self.merger.suspects;
        let metrics = &self.proxy.metrics;
        metrics.routing_rows(Side::Prefill, &self.record.prefill, prefill_seen);
        metrics.routing_rows(Side::Decode, &self.url, decode_seen);
        if let Some(fault) = tail {
            log::warn!(target: "routed_experts::proxy", "{} {} stream {}: {}",
                self.record.request_id, self.record.endpoint, fault.side,
                fault.message.escape_debug());
            self.record.side = Some(fault.side);
            // The error event starts on a line of its own, whatever the last piece ended with.
            let mut event = fault.event();
            if !self.ended_line {
                event.splice(0..0, *b"\n\n");
            }
            self.send_all(vec![Bytes::from(event)], None).await;
        }
        if let Some(lease) = self.lease.take() {
            self.proxy.release(Side::Decode, lease, outcome);
        }
        self.record.seconds[Phase::Decode as usize] = self.began.elapsed().as_secs_f64();
    }

    /// What the merger left to be written as it is sent (prefill's rows in an event that
    /// streams, and the bytes behind them), a piece at a time, each counted against the budget
    /// until it is written: the stream holds a piece of them at once, not all. `Err(None)`:
    /// the client left; `Err(Some(_))`: the fault that ends the stream.
    async fn send_pending(&mut self, proxy: &Proxy) -> Result<(), Option<Fault>> {
        while let Some(piece) = self.merger.next_pending() {
            let piece = piece.map_err(|e| Some(stream_fault(e)))?;
            let keep = self.merger.buffered();
            let more = (keep + piece.len()).saturating_sub(self.share.held());
            if more > 0 {
                let wait = proxy.wait_deadline(self.deadline);
                if !self.share.grow_wait(more, proxy.budget.limit(), wait).await {
                    return Err(Some(proxy.call_fault(
                        Side::Decode,
                        &self.url,
                        CallError::Budget,
                    )));
                }
            }
            let sent = self.share.split_beyond(keep);
            if !self.send_all(vec![piece], Some(sent)).await {
                return Err(None);
            }
        }
        Ok(())
    }

    /// Send pieces to the client, the last holding `share` (the bytes they came from) until
    /// it is written; `false` when the client is gone.
    pub(crate) async fn send_all(&mut self, pieces: Vec<Bytes>, mut share: Option<Share>) -> bool {
        let last = pieces.len().saturating_sub(1);
        for (i, piece) in pieces.into_iter().enumerate() {
            let n = piece.len();
            if let Some(&end) = piece.last() {
                self.ended_line = end == b'\n';
            }
            let own = if i == last { share.take() } else { None };
            let piece = Outgoing::new(piece, own, Some(Arc::clone(&self.held)));
            if self.tx.send(piece).await.is_err() {
                return false;
            }
            self.record.bytes_out += n;
        }
        true
    }
}

/// A response body fed by a channel: the stream relay's pieces, in order.
pub(crate) struct ChannelBody(pub(crate) mpsc::Receiver<Outgoing>);

impl hyper::body::Body for ChannelBody {
    type Data = Outgoing;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Outgoing>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|piece| piece.map(|b| Ok(Frame::data(b))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::body::Body as _;

    #[tokio::test]
    async fn a_channel_body_yields_the_pieces_in_order_then_ends() {
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let mut body = ChannelBody(rx);
        for piece in ["data: 1\n\n", "data: [DONE]\n\n"] {
            tx.send(Outgoing::from(Bytes::from_static(piece.as_bytes())))
                .await
                .unwrap();
        }
        drop(tx);
        let mut got = Vec::new();
        while let Some(frame) =
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
        {
            let mut data = frame.unwrap().into_data().ok().unwrap();
            use bytes::Buf;
            got.extend_from_slice(&data.copy_to_bytes(data.remaining()));
        }
        assert_eq!(got, b"data: 1\n\ndata: [DONE]\n\n");
    }

    #[tokio::test]
    async fn dropping_the_guard_aborts_the_stream_task() {
        let task = tokio::spawn(std::future::pending::<()>());
        let guard = AbortOnDrop(Some(task.abort_handle()));
        drop(guard); // the request was dropped: its client left
        assert!(task.await.unwrap_err().is_cancelled());
    }
}
