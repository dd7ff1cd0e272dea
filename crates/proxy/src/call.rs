//! [`Call`]: the upstream side of one completion request. Prefill, then decode, their replies
//! read within the budget; a plain answer's routing merged by absolute position (`run`), a
//! stream's decode opened and handed to a [`Relay`] (`stream`).

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Response};
use tokio::sync::{mpsc, oneshot};

use routed_experts::body::{read_prefill_scanned, Base64Runs, PrefillBody};
use routed_experts::response::{merge_response_found, merge_suspects, suspect_rows, MergeOptions};
use routed_experts::validate::Suspect;
use routed_experts::Hints;

use super::answer::Answer;
use super::blocking::{blocking_if, BLOCKING_BYTES};
use super::budget::Share;
use super::buffered_stream::merged_events;
use super::config::{RoutingFormat, VllmPlugin};
use super::fault::{encoded_fault, merge_fault, status_fault, Blame, Fault};
use super::metrics::Phase;
use super::parts::{shared_parts, Held, Part, PartsBody};
use super::pool::{Lease, Outcome, Side};
use super::proxy::{Proxy, Slot};
use super::record::Exchange;
use super::relay::{AbortOnDrop, ChannelBody, Head, Relay, STREAM_QUEUE};
use super::request::{decode_start, marked_kv_transfer_params, ClientBody};
use super::responses::Body;
use super::stream_merger::{StreamMerger, SAMPLE_ROWS};

/// What [`Call::merge`] merges.
struct Merge<'a> {
    answer: Answer,
    body: &'a ClientBody,
    prefill: (&'a Bytes, &'a PrefillBody<'a>),
    decode: &'a Bytes,
    decode_start: Option<u64>,
}

/// The upstream side of one completion request.
pub(crate) struct Call {
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) endpoint: &'static str,
    pub(crate) headers: Vec<(&'static str, HeaderValue)>,
    pub(crate) deadline: tokio::time::Instant,
}

impl Call {
    /// Where an upstream reply may fill the budget to: prefill replies leave a quarter free for
    /// decode replies, which finish requests (and so free bytes).
    pub(crate) fn ceiling(&self, side: Side) -> usize {
        match side {
            Side::Prefill => self.proxy.budget.prefill_ceiling(),
            Side::Decode => self.proxy.budget.limit(),
        }
    }

    pub(crate) async fn run(
        self,
        ex: &mut Exchange,
        body: ClientBody,
        slot: Slot,
    ) -> Result<Response<Body>, Fault> {
        let answer = Answer::of(ex.stream, &body, &self.proxy.config)?;
        // A decode server first: with none to take the request, it is refused before a prefill
        // server computes a KV cache that no decode would ever fetch.
        let lease = self.proxy.lease(Side::Decode, body.session).await?;
        let lease = LeaseGuard {
            proxy: Arc::clone(&self.proxy),
            lease: Some(lease),
        };
        let prefill_json = body.prefill_request();
        let prefill = self.prefill(ex, prefill_json, body.session).await?;
        match answer {
            Answer::Relay => self.stream(ex, body, lease, prefill, slot).await,
            Answer::Plain { .. } | Answer::EventsFromPlain => {
                self.plain(ex, answer, body, lease, prefill, slot).await
            }
        }
    }

    /// A request answered from decode's plain answer: decode called from prefill's reply, the
    /// two merged, the answer sent as slices of the two bodies (only the rewritten parts are
    /// new bytes), with the slot and both bodies' budget held until the last part is written.
    async fn plain(
        &self,
        ex: &mut Exchange,
        answer: Answer,
        body: ClientBody,
        mut lease: LeaseGuard,
        (prefill, mut prefill_share): (ReplyBody, Share),
        slot: Slot,
    ) -> Result<Response<Body>, Fault> {
        let (read, decode_start) =
            self.read_prefill(&prefill.body, prefill.runs.as_ref(), body.start)?;
        let kv = self.decode_kv(read.kv_transfer_params)?;
        let decode_json = match answer {
            Answer::EventsFromPlain => body.plain_decode_request(kv.as_deref(), decode_start),
            _ => body.decode_request(kv.as_deref(), decode_start),
        };
        let lease = lease.take();
        ex.decode = lease.upstream.url.clone();
        let reserve = prefill_share.take_reserve().beside(prefill_share.held());
        let (decode, decode_share) = self
            .fetch(ex, Side::Decode, lease, decode_json.into(), reserve)
            .await?;
        let began = Instant::now();
        let merge = Merge {
            answer,
            body: &body,
            prefill: (&prefill.body, &read),
            decode: &decode.body,
            decode_start,
        };
        let (parts, (prefill_seen, decode_seen)) =
            blocking_if(decode.body.len() >= BLOCKING_BYTES, || self.merge(merge))?;
        let metrics = &self.proxy.metrics;
        metrics.routing_rows(Side::Prefill, &ex.prefill, prefill_seen);
        metrics.routing_rows(Side::Decode, &ex.decode, decode_seen);
        ex.seconds[Phase::Merge as usize] = began.elapsed().as_secs_f64();
        let len = parts.iter().map(Part::len).sum();
        metrics.merged(len);
        ex.status(200, None);
        ex.bytes_out = len;
        let held: Held = Arc::new((slot, prefill_share, decode_share));
        let mut r = Response::new(BodyExt::boxed(PartsBody::new(parts, held)));
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(answer.mime()));
        ex.tag(&mut r);
        Ok(r)
    }

    /// The merged answer as parts, and the rows each side's routing was sampled at (for the
    /// suspect-row metrics). A stream written from it is checked whole (the text it would copy
    /// too), then written event by event.
    fn merge(&self, m: Merge<'_>) -> Result<(Vec<Part>, (Suspect, Suspect)), Fault> {
        // Text encoded again from text on another grid (vLLM's rows in a compact sidecar) is
        // written as it is sent, a piece at a time while it is in cache.
        let opts = MergeOptions {
            require_routing: true,
            defer_recode: true,
            shared_prompt: m.answer
                == Answer::Plain {
                    shared_prompt: true,
                },
            ..self.merge_options(m.body.start, m.decode_start)
        };
        let (prefill_body, read) = m.prefill;
        let mut spliced = merge_response_found(prefill_body, &read.routing, m.decode, opts)
            .map_err(merge_fault)?;
        let seen = merge_suspects(
            &read.routing.values,
            spliced.decode_values(),
            &opts,
            SAMPLE_ROWS,
        );
        let parts = match m.answer {
            Answer::EventsFromPlain => {
                spliced.take_checked_recoded_parts().map_err(merge_fault)?;
                let (api, usage) = (m.body.api(), m.body.include_usage);
                merged_events(m.decode, api, usage, (prefill_body, &read.routing), opts)?
            }
            _ => shared_parts(&mut spliced, &[prefill_body, m.decode]).map_err(merge_fault)?,
        };
        Ok((parts, seen))
    }

    /// The `kv_transfer_params` decode is sent: prefill's as they are, or with the vLLM
    /// plugin's marker (`--vllm-plugin mark`).
    fn decode_kv<'b>(&self, prefill: Option<&'b [u8]>) -> Result<Option<Cow<'b, [u8]>>, Fault> {
        Ok(match self.proxy.config.vllm_plugin {
            VllmPlugin::Off => prefill.map(Cow::Borrowed),
            VllmPlugin::Mark => Some(Cow::Owned(marked_kv_transfer_params(prefill)?)),
        })
    }

    /// `start`: the client's prompt start, for prefill's values; `decode_start`: where decode
    /// was asked to start (for formats that carry no start).
    pub(crate) fn merge_options(
        &self,
        start: Option<u64>,
        decode_start: Option<u64>,
    ) -> MergeOptions {
        MergeOptions {
            hints: Hints {
                start,
                ..Hints::default()
            },
            decode_start,
            keep_format: self.proxy.config.routing_format == RoutingFormat::Engine,
            ..MergeOptions::new(self.proxy.merge_max_bytes)
        }
    }

    /// The prefill body read once (`runs`: its base64 runs found as it arrived;
    /// `kv_transfer_params` and its routing, which the merge
    /// reuses), the client's prompt start checked against the prompt's length, and where
    /// decode is to be asked to start its routing ([`decode_start`]; `None` when prefill
    /// returned neither routing nor a prompt count, so decode is asked as the client asked).
    pub(crate) fn read_prefill<'b>(
        &self,
        body: &'b [u8],
        runs: Option<&Base64Runs>,
        start: Option<u64>,
    ) -> Result<(PrefillBody<'b>, Option<u64>), Fault> {
        let max_bytes = self.proxy.merge_max_bytes;
        let (read, prompt) = blocking_if(body.len() >= BLOCKING_BYTES, || {
            prefill_prompt(body, runs, start, max_bytes)
        })
        .map_err(|e| Fault::new(Blame::Prefill, 502, format!("malformed prefill body: {e}")))?;
        let Some(prompt) = prompt else {
            return Ok((read, None));
        };
        if let Some(s) = start.filter(|s| *s >= prompt) {
            return Err(Fault::bad_field(
                "routed_experts_prompt_start",
                format!(
                    "routed_experts_prompt_start={s} is not below the prompt's length \
                     ({prompt} tokens)"
                ),
            ));
        }
        Ok((read, Some(decode_start(prompt, start))))
    }

    /// The prefill call; a server that could not be connected to is replaced by the next.
    pub(crate) async fn prefill(
        &self,
        ex: &mut Exchange,
        data: Vec<u8>,
        session: Option<u64>,
    ) -> Result<(ReplyBody, Share), Fault> {
        let proxy = &self.proxy;
        let lease = proxy.lease(Side::Prefill, session).await?;
        let first = Arc::clone(&lease.upstream);
        ex.prefill = first.url.clone();
        let data = Bytes::from(data);
        let share = || proxy.budget.share();
        match self
            .fetch(ex, Side::Prefill, lease, data.clone(), share())
            .await
        {
            Err(fault) if fault.retryable => {
                let Some(retry) = proxy.pick(Side::Prefill, Some(&first), session) else {
                    return Err(fault);
                };
                let url = retry.upstream.url.clone();
                log::warn!(target: "routed_experts::proxy",
                    "{} prefill {} unreachable, retrying on {url}", ex.request_id, ex.prefill);
                ex.prefill = url;
                self.fetch(ex, Side::Prefill, retry, data, share()).await
            }
            other => other,
        }
    }

    /// POST `data` to the leased upstream: its response head, and the guard that gives the
    /// lease back with the outcome the caller records in it (Failed already if no head came).
    pub(crate) async fn post(
        &self,
        side: Side,
        lease: Lease,
        data: Bytes,
    ) -> (ReleaseGuard<'_>, Result<Response<Incoming>, Fault>) {
        let proxy = &self.proxy;
        let u = Arc::clone(&lease.upstream);
        let mut guard = ReleaseGuard::new(proxy, side, lease);
        let uri = u.target.uri(self.endpoint);
        let head = proxy
            .upstreams
            .call(Method::POST, uri, &self.headers, data, None)
            .await
            .map_err(|e| {
                guard.outcome = Outcome::Failed;
                proxy.call_fault(side, &u.url, e)
            });
        (guard, head)
    }

    /// POST to an upstream and read its JSON reply, recording the upstream's health. The reply
    /// is read whole on the proxy's own connections ([`Direct`](super::direct)): a body with a
    /// length goes straight from the socket into one buffer.
    pub(crate) async fn fetch(
        &self,
        ex: &mut Exchange,
        side: Side,
        lease: Lease,
        data: Bytes,
        mut share: Share,
    ) -> Result<(ReplyBody, Share), Fault> {
        let proxy = &self.proxy;
        let upstream = Arc::clone(&lease.upstream);
        let url = &upstream.url;
        let began = Instant::now();
        let mut guard = ReleaseGuard::new(proxy, side, lease);
        let uri = upstream.target.uri(self.endpoint);
        let reply = match proxy.direct.post(&uri, &self.headers, &data).await {
            Err(e) => {
                guard.outcome = Outcome::Failed;
                Err(proxy.call_fault(side, url, e))
            }
            Ok(r) => {
                let status = r.head.status;
                match content_coding(r.head.content_encoding.as_ref()) {
                    Some(enc) => {
                        guard.outcome = Outcome::of_status(status);
                        Err(encoded_fault(side, url, enc))
                    }
                    None => {
                        let json = is_mime(r.head.content_type.as_ref(), "application/json");
                        let limit = proxy.config.max_upstream_bytes;
                        let (ceiling, deadline) =
                            (self.ceiling(side), proxy.wait_deadline(self.deadline));
                        // Prefill's reply is walked for its routing before the merge: its runs
                        // are found as it arrives, and it takes a reserve for decode's.
                        let prefill = side == Side::Prefill;
                        r.read_body(limit, &mut share, (ceiling, prefill), deadline, prefill)
                            .await
                            .map(|(body, runs)| (status, json, ReplyBody { body, runs }, share))
                            .map_err(|e| {
                                guard.outcome = Outcome::Failed;
                                proxy.call_fault(side, url, e)
                            })
                    }
                }
            }
        };
        ex.seconds[Phase::from(side) as usize] += began.elapsed().as_secs_f64();
        let (status, json, body, share) = reply?;
        guard.outcome = Outcome::of_status(status);
        if status >= 400 {
            return Err(status_fault(side, url, status, &body.body));
        }
        let s = side.name();
        if !json {
            log::warn!(target: "routed_experts::proxy", "{s} server {url} did not answer with JSON");
            return Err(Fault::new(
                side.into(),
                502,
                format!("the {s} server did not answer with JSON"),
            ));
        }
        Ok((body, share))
    }

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
        prefill: (ReplyBody, Share),
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
        (prefill, mut prefill_share): (ReplyBody, Share),
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
        let kv = match self.decode_kv(read.kv_transfer_params) {
            Ok(kv) => kv,
            Err(fault) => {
                let _ = head_tx.send(Err(fault));
                return;
            }
        };
        let decode_json = body.decode_request(kv.as_deref(), decode_start);
        drop(kv);
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

/// An upstream's whole reply body, and for prefill's its long base64 runs, found as it arrived
/// (the walk for its routing takes them instead of scanning those megabytes again).
pub(crate) struct ReplyBody {
    pub(crate) body: Bytes,
    pub(crate) runs: Option<Base64Runs>,
}

/// Gives a lease back when a request ends before its upstream call starts.
pub(crate) struct LeaseGuard {
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) lease: Option<Lease>,
}

impl LeaseGuard {
    /// The lease, for the call that now gives it back itself.
    pub(crate) fn take(&mut self) -> Lease {
        self.lease.take().expect("a lease is taken once")
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.proxy.release(Side::Decode, lease, Outcome::Unknown);
        }
    }
}

/// Gives a lease back with the call's outcome (Unknown if the client left first).
pub(crate) struct ReleaseGuard<'a> {
    pub(crate) proxy: &'a Proxy,
    pub(crate) side: Side,
    pub(crate) lease: Option<Lease>,
    pub(crate) outcome: Outcome,
}

impl<'a> ReleaseGuard<'a> {
    /// The guard of `lease`, whose outcome stays Unknown until the caller records it.
    pub(crate) fn new(proxy: &'a Proxy, side: Side, lease: Lease) -> Self {
        ReleaseGuard {
            proxy,
            side,
            lease: Some(lease),
            outcome: Outcome::Unknown,
        }
    }
}

impl Drop for ReleaseGuard<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.proxy.release(self.side, lease, self.outcome);
        }
    }
}

/// The prefill body read as the proxy needs it, and the prompt's length when it returned
/// routing: the count the body states (`usage.prompt_tokens`, prompt ids), else where its first
/// routing value ends (a prefill half generates one token, so its rows end at the prompt's
/// length: vLLM 0.24's generate bodies state no counts).
pub(crate) fn prefill_prompt<'b>(
    body: &'b [u8],
    runs: Option<&Base64Runs>,
    start: Option<u64>,
    max_bytes: usize,
) -> routed_experts::Result<(PrefillBody<'b>, Option<u64>)> {
    let read = read_prefill_scanned(body, runs)?;
    let Some(first) = read.routing.values.first() else {
        // No routing from prefill (a server started without it): the prompt's length from its
        // counts still says where decode computes, so a decode engine with routing on is never
        // asked for rows it received over the KV connector (vLLM 0.32 dies on that). Not for
        // vLLM 0.21's split bodies (a `prompt_routed_experts` key), which take no start.
        if read.routing.prompt_key {
            return Ok((read, None));
        }
        let prompt = read.routing.choices.iter().find_map(|(_, c)| c.prompt);
        return Ok((read, prompt.map(|(p, _)| p)));
    };
    if let Some((prompt, _)) = first.counts.prompt {
        return Ok((read, Some(prompt)));
    }
    let hints = Hints {
        start,
        ..Hints::default()
    };
    let (_, end) = suspect_rows(first, &hints, max_bytes, 0, 0)
        .map_err(|e| e.context(format!("choice {}", first.index)))?;
    Ok((read, Some(end)))
}

pub(crate) fn is_mime(value: Option<&HeaderValue>, mime: &str) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case(mime))
}

pub(crate) fn upstream_headers(
    id: &str,
    auth: Option<HeaderValue>,
) -> Vec<(&'static str, HeaderValue)> {
    // Bodies are merged as they come: a compressed one could not be read.
    let mut h = vec![
        ("content-type", HeaderValue::from_static("application/json")),
        ("accept-encoding", HeaderValue::from_static("identity")),
    ];
    if let Ok(v) = HeaderValue::from_str(id) {
        h.push((super::request::REQUEST_ID, v));
    }
    if let Some(a) = auth {
        h.push(("authorization", a));
    }
    h
}

/// A reply's content coding other than identity (which the proxy asked for), as sent.
pub(crate) fn encoding(r: &Response<Incoming>) -> Option<String> {
    content_coding(r.headers().get(hyper::header::CONTENT_ENCODING))
}

/// The coding a `Content-Encoding` value names, unless it is none (`identity` or empty).
pub(crate) fn content_coding(v: Option<&HeaderValue>) -> Option<String> {
    let v = v?;
    let text = String::from_utf8_lossy(v.as_bytes())
        .trim()
        .to_ascii_lowercase();
    (text != "identity" && !text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests;
