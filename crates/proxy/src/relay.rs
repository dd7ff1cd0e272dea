//! A stream request: decode's events relayed to the client as they come, the one that
//! carries routing merged with prefill's, a failure reported in-band as a last error event.

use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::Response;
use tokio::sync::{mpsc, oneshot};

use super::budget::Share;
use super::fault::Fault;
use super::metrics::Phase;
use super::parts::{Held, Outgoing};
use super::pool::{Lease, Outcome, Side};
use super::request::ClientBody;
use super::stream::StreamMerger;
use super::upstream::CallError;

use super::call::{blocking_if, encoding, is_mime, Call, LeaseGuard, Reply};
use super::fault::{encoded_fault, status_fault, stream_fault, Blame};
use super::record::Exchange;
use super::responses::Body;
use super::shared::{Proxy, Slot, BLOCKING_BYTES};

/// Pieces of a stream queued for a client that is slower than the decode server.
pub(crate) const STREAM_QUEUE: usize = 16;

impl Call {
    /// A stream request from the prefill reply on. The rest runs as a task of its own that
    /// owns the prefill body and what was read from it (so the routing event merges without
    /// walking that body again): it calls decode and hands back the response head once decode
    /// answers with a stream, then relays the events, merged where they carry routing, with
    /// any failure reported in-band as a last error event. Until the head is back, this
    /// request still owns its record, and dropping it (the client left) stops the task.
    pub(crate) async fn stream(
        self,
        ex: &mut Exchange,
        body: ClientBody,
        lease: LeaseGuard,
        prefill: (Reply, Share),
        slot: Slot,
    ) -> Result<Response<Body>, Fault> {
        let (head_tx, head_rx) = oneshot::channel();
        // Named in the log line whether decode answers or not (as a plain request's is).
        if let Some(l) = &lease.lease {
            ex.decode = l.upstream.url.clone();
        }
        let began = Instant::now();
        let task = tokio::spawn(self.stream_task(body, lease, prefill, slot, head_tx));
        let mut abort = AbortOnDrop(Some(task.abort_handle()));
        let head = head_rx.await.map_err(|_| {
            Fault::new(
                Blame::Proxy,
                500,
                "the stream ended before its response head",
            )
        });
        ex.seconds[Phase::Decode as usize] = began.elapsed().as_secs_f64();
        let (decode_url, decode_seconds, mut response, record_tx) = head??;
        abort.0 = None; // the task owns the stream from here on (its handle dropped, not aborted)
        ex.decode = decode_url;
        ex.seconds[Phase::Decode as usize] = decode_seconds;
        ex.status(200, None);
        ex.tag(&mut response);
        // The record goes to the task, which logs it when the stream ends.
        let proxy = Arc::clone(&ex.proxy);
        let mut record = Exchange::new(proxy, ex.request_id.clone(), ex.endpoint);
        std::mem::swap(&mut record, ex);
        ex.handed_off = true;
        let _ = record_tx.send(record);
        Ok(response)
    }

    pub(crate) async fn stream_task(
        self,
        body: ClientBody,
        mut lease: LeaseGuard,
        (prefill, mut prefill_share): (Reply, Share),
        slot: Slot,
        head_tx: oneshot::Sender<Result<Head, Fault>>,
    ) {
        let proxy = Arc::clone(&self.proxy);
        let (read, decode_start) =
            match self.read_prefill(&prefill.body, prefill.runs.as_ref(), body.start) {
                Ok(read) => read,
                Err(fault) => {
                    let _ = head_tx.send(Err(fault));
                    return;
                }
            };
        let decode_json = body.decode_request(read.kv_transfer_params, decode_start);
        let opts = self.merge_options(body.start, decode_start);
        drop(body);
        let lease = lease.take();
        let url = lease.upstream.url.clone();
        let began = Instant::now();
        let decode = match self
            .open_stream(lease, decode_json, prefill_share.held())
            .await
        {
            Ok(d) => d,
            Err(fault) => {
                let _ = head_tx.send(Err(fault));
                return;
            }
        };
        let (lease, upstream) = decode;
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let mut response = Response::new(BodyExt::boxed(ChannelBody(rx)));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        let (record_tx, record_rx) = oneshot::channel();
        let head = (
            url.clone(),
            began.elapsed().as_secs_f64(),
            response,
            record_tx,
        );
        if head_tx.send(Ok(head)).is_err() {
            proxy.release(Side::Decode, lease, Outcome::Unknown);
            return;
        }
        let Ok(record) = record_rx.await else {
            proxy.release(Side::Decode, lease, Outcome::Unknown);
            return;
        };
        let max_line = proxy.config.max_upstream_bytes;
        // Prefill's routing as an event long enough to merge as it passes reads it, found once.
        let rows = OnceLock::new();
        let relay = Relay {
            // Decode's event grows into the room prefill's reply set aside first.
            share: prefill_share.take_reserve().beside(prefill_share.held()),
            proxy,
            url,
            record,
            lease: Some(lease),
            merger: StreamMerger::new(&prefill.body, &read.routing, opts, max_line)
                .streaming(&rows)
                .defer_rows(),
            tx,
            deadline: self.deadline,
            began,
            held: Arc::new((slot, prefill_share)),
            ended_line: true,
        };
        relay.run(upstream.into_body()).await;
    }

    /// The decode call of a stream, up to a response head that is a stream.
    pub(crate) async fn open_stream(
        &self,
        lease: Lease,
        data: Vec<u8>,
        beside: usize,
    ) -> Result<(Lease, Response<Incoming>), Fault> {
        let upstream = std::sync::Arc::clone(&lease.upstream);
        let url = &upstream.url;
        let (mut guard, head) = self.post(Side::Decode, lease, data.into()).await;
        let r = head?;
        let status = r.status().as_u16();
        if status >= 400 {
            guard.outcome = Outcome::of_status(status);
            let mut share = self.proxy.budget.share().beside(beside);
            let proxy = &self.proxy;
            let body = proxy
                .upstreams
                .read_body(
                    r,
                    proxy.config.max_upstream_bytes,
                    &mut share,
                    self.ceiling(Side::Decode),
                    proxy.wait_deadline(self.deadline),
                )
                .await
                .unwrap_or_default();
            return Err(status_fault(Side::Decode, url, status, &body));
        }
        if let Some(enc) = encoding(&r) {
            guard.outcome = Outcome::Ok;
            return Err(encoded_fault(Side::Decode, url, enc));
        }
        if !is_mime(r.headers().get(CONTENT_TYPE), "text/event-stream") {
            guard.outcome = Outcome::Ok;
            log::warn!(target: "routed_experts::proxy", "decode server {url} did not answer with a stream");
            return Err(Fault::new(
                Blame::Decode,
                502,
                "the decode server did not answer with a stream",
            ));
        }
        let lease = guard.lease.take().expect("leased above");
        Ok((lease, r))
    }
}

/// What a stream task hands back once decode answered: the decode server, the seconds to its
/// head, the response for the client, and where to send the request's record.
pub(crate) type Head = (String, f64, Response<Body>, oneshot::Sender<Exchange>);

/// Aborts a task when dropped (the request it serves was dropped: its client left).
pub(crate) struct AbortOnDrop(Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// A decode stream being relayed to its client.
pub(crate) struct Relay<'a> {
    proxy: Arc<Proxy>,
    url: String,
    record: Exchange,
    lease: Option<Lease>,
    merger: StreamMerger<'a>,
    tx: mpsc::Sender<Outgoing>,
    deadline: tokio::time::Instant,
    began: Instant,
    share: Share, // the bytes of the line being received; pieces sent on carry their own
    held: Held, // the completion slot and the prefill body's budget, until the last piece is written
    ended_line: bool, // whether what was sent so far ends with a newline
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
pub(crate) struct ChannelBody(mpsc::Receiver<Outgoing>);

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
