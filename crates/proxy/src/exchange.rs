//! One completion request, end to end: the client's body read within its limits, a decode
//! server leased, the prefill call, the decode call, and every response's routing merged by
//! absolute position (a plain body at once, a stream event by event).

use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::{mpsc, oneshot};

use super::budget::{Budget, Share};
use super::config::Config;
use super::fault::Fault;
use super::metrics::Metrics;
use super::parts::{shared_slices, Held, Outgoing, PartsBody};
use super::pool::{Lease, Outcome, Pool, Side};
use super::request::{acceptable_request_id, Api, ClientBody};
use super::stream::{StreamError, StreamMerger, SAMPLE_ROWS};
use super::upstream::{CallError, Upstreams};
use routed_experts::body::{read_prefill, PrefillBody};
use routed_experts::response::{merge_response_found, merge_suspects, routing_rows, MergeOptions};
use routed_experts::{Error, Hints};

/// The body of every response the proxy sends.
pub type Body = BoxBody<Outgoing, Infallible>;

/// Bodies at least this large are read or merged with the runtime told the thread blocks
/// (`block_in_place`), so other connections move to the other workers meanwhile.
const BLOCKING_BYTES: usize = 8 << 20;
/// When every server of a side is out of rotation, one is probed before a request is refused:
/// at most once a second, answered within two seconds (or the connect timeout, if shorter).
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Pieces of a stream queued for a client that is slower than the decode server.
const STREAM_QUEUE: usize = 16;

/// Everything the requests of one proxy share.
pub struct Proxy {
    /// The settings it serves with.
    pub config: Config,
    /// The prefill servers.
    pub prefill: Pool,
    /// The decode servers.
    pub decode: Pool,
    /// Its metrics.
    pub metrics: Metrics,
    /// Bytes held in bodies.
    pub budget: Arc<Budget>,
    /// Completion requests being served.
    pub in_flight: AtomicUsize,
    upstreams: Upstreams,
    merge_max_bytes: usize,
}

impl Proxy {
    /// A proxy serving `config` (checked by [`Config::check`] first).
    pub fn new(config: Config) -> Self {
        let prefill = Pool::new(
            Side::Prefill,
            &config.prefill,
            u32::try_from(config.eject_after).unwrap_or(u32::MAX),
            config.eject_seconds,
        );
        let decode = Pool::new(
            Side::Decode,
            &config.decode,
            u32::try_from(config.eject_after).unwrap_or(u32::MAX),
            config.eject_seconds,
        );
        let metrics = Metrics::default();
        for u in prefill.upstreams.iter().chain(&decode.upstreams) {
            metrics.upstream_healthy(u.side.name(), &u.url, true);
        }
        Proxy {
            upstreams: Upstreams::new(
                config.connect_timeout,
                config.read_timeout,
                config.max_in_flight,
            ),
            budget: Budget::new(config.max_buffered_bytes),
            merge_max_bytes: config.max_merge_bytes,
            prefill,
            decode,
            metrics,
            in_flight: AtomicUsize::new(0),
            config,
        }
    }

    fn pool(&self, side: Side) -> &Pool {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    fn release(&self, side: Side, lease: Lease, outcome: Outcome) {
        let pool = self.pool(side);
        let url = &pool.upstreams[lease.index].url;
        if outcome == Outcome::Failed {
            self.metrics.upstream_failed(side.name(), url);
        }
        if let Some((index, healthy)) = pool.release(lease, outcome) {
            let url = &pool.upstreams[index].url;
            if healthy {
                log::warn!(target: "routed_experts::proxy", "{} server {url} is back in rotation", side.name());
            }
            self.metrics.upstream_healthy(side.name(), url, healthy);
        }
    }

    /// A completion request (`endpoint` is its exact path).
    pub async fn completion(
        self: &Arc<Self>,
        req: Request<Incoming>,
        endpoint: &'static str,
        api: Api,
    ) -> Response<Body> {
        let began = Instant::now();
        let mut ex = Exchange::new(Arc::clone(self), request_id(&req), endpoint);
        let deadline = tokio::time::Instant::from_std(began + self.config.request_timeout);
        let auth = self.upstream_auth(&req);
        // The body first, within its limits: a request takes a completion slot only once its
        // body is whole, so clients that drip their bodies cannot hold the slots.
        let raw = match self.receive_body(req).await {
            Ok(raw) => raw,
            Err(None) => {
                // Nobody reads this; it says what the log says, never a 200.
                ex.status(499, "client");
                return fault_response(&Fault::new("client", 499, "the client left").closing());
            }
            Err(Some(fault)) => return ex.fail(fault),
        };
        let Some(slot) = Slot::take(self) else {
            return ex.fail(self.in_flight_fault());
        };
        let body = match ClientBody::parse(&raw.0, api) {
            Ok(b) => b,
            Err(fault) => return ex.fail(fault),
        };
        drop(raw); // its bytes go back to the budget; the parsed fields hold their own copy
        ex.stream = body.stream;
        let call = Call {
            proxy: Arc::clone(self),
            endpoint,
            headers: upstream_headers(&ex.request_id, auth),
            deadline,
        };
        match tokio::time::timeout_at(deadline, call.run(&mut ex, body, slot)).await {
            Ok(Ok(response)) => response,
            Ok(Err(fault)) => ex.fail(fault),
            Err(_) => ex.fail(self.request_timeout_fault()),
        }
    }

    /// What the upstreams are sent as `Authorization`: `--upstream-api-key` when set, else the
    /// client's own header.
    fn upstream_auth(&self, req: &Request<Incoming>) -> Option<HeaderValue> {
        match &self.config.upstream_api_key {
            Some(key) => HeaderValue::from_str(&format!("Bearer {key}")).ok(),
            None => req.headers().get(AUTHORIZATION).cloned(),
        }
    }

    /// Every slot of `--max-in-flight` taken.
    fn in_flight_fault(&self) -> Fault {
        self.metrics.rejected("in_flight");
        let max = self.config.max_in_flight;
        Fault::new(
            "proxy",
            503,
            format!("the proxy is serving its limit of {max} requests"),
        )
        .retry_after(1)
    }

    /// A request (or stream) still under way at `--request-timeout`.
    fn request_timeout_fault(&self) -> Fault {
        let t = self.config.request_timeout.as_secs_f64();
        Fault::new(
            "proxy",
            504,
            format!("the request did not finish within {t} s (--request-timeout)"),
        )
    }

    /// How long an upstream reply may wait for room in the body budget: as long as an
    /// upstream may stay silent, within the request's own `deadline`.
    fn wait_deadline(&self, deadline: tokio::time::Instant) -> tokio::time::Instant {
        (tokio::time::Instant::now() + self.config.read_timeout).min(deadline)
    }

    /// The client's whole body, or the fault to answer with (`None`: the client left).
    async fn receive_body(&self, req: Request<Incoming>) -> Result<(Bytes, Share), Option<Fault>> {
        let c = &self.config;
        let too_large = |size: u64| {
            Fault::new(
                "client",
                413,
                format!(
                    "the request body is {size} bytes, over the limit of {}",
                    c.max_request_bytes
                ),
            )
            .closing()
        };
        let declared = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = declared.filter(|&n| n > c.max_request_bytes as u64) {
            return Err(Some(too_large(n)));
        }
        let mut share = self.budget.share();
        let over_budget = || {
            self.metrics.rejected("buffered_bytes");
            Fault::new(
                "proxy",
                503,
                format!(
                    "the proxy is receiving its limit of {} bytes of request bodies",
                    self.budget.limit()
                ),
            )
            .retry_after(1)
            .closing()
        };
        let mut body = req.into_body();
        let mut out = Vec::with_capacity(declared.unwrap_or(0).min(1 << 20) as usize);
        let read = async {
            while let Some(frame) = body.frame().await {
                let data = match frame {
                    Ok(frame) => frame.into_data(),
                    // Gone before the body ended: nobody to answer.
                    Err(e) if e.is_canceled() || e.is_closed() => return Err(None),
                    // Broken framing, or a half-close mid-body: answered, then closed.
                    Err(e) => {
                        let why = format!("the request body could not be read: {e}");
                        return Err(Some(Fault::new("client", 400, why).closing()));
                    }
                };
                let Ok(data) = data else { continue };
                let size = out.len() + data.len();
                if size > c.max_request_bytes {
                    return Err(Some(too_large(size as u64)));
                }
                if !share.grow(data.len()) {
                    return Err(Some(over_budget()));
                }
                out.extend_from_slice(&data);
            }
            Ok(())
        };
        match tokio::time::timeout(c.body_timeout, read).await {
            Ok(Ok(())) => Ok((Bytes::from(out), share)),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                self.metrics.rejected("body_timeout");
                let t = c.body_timeout.as_secs_f64();
                Err(Some(
                    Fault::new(
                        "client",
                        408,
                        format!("the request body did not arrive within {t} s"),
                    )
                    .closing(),
                ))
            }
        }
    }

    /// The next server of `side`; when every one is out of rotation, the one due first is
    /// probed and serves the request if it answers. Else 503 + Retry-After.
    async fn lease(&self, side: Side) -> Result<Lease, Fault> {
        let pool = self.pool(side);
        if let Some(lease) = pool.pick(None) {
            return Ok(lease);
        }
        if let Some(index) = pool.probe_candidate(PROBE_INTERVAL) {
            let u = &pool.upstreams[index];
            let wait = self.config.connect_timeout.min(PROBE_TIMEOUT);
            let probe = self.upstreams.call(
                Method::GET,
                u.target.uri("/health"),
                &[],
                Bytes::new(),
                Some(wait),
            );
            let answered = matches!(probe.await, Ok(r) if r.status() == StatusCode::OK);
            if let Some(lease) = pool.probed(index, answered) {
                log::warn!(target: "routed_experts::proxy",
                    "{} server {} answered a health probe: trying it", side.name(), u.url);
                return Ok(lease);
            }
        }
        self.metrics.rejected("no_upstream");
        Err(Fault::new(
            "proxy",
            503,
            format!(
                "no {} server is in rotation (each failed repeatedly, and none answered a \
                 health probe)",
                side.name()
            ),
        )
        .retry_after(pool.retry_after()))
    }

    /// `GET /v1/models`, relayed from a decode server (clients call it first).
    pub async fn models(self: &Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let id = request_id(&req);
        // The same rules as a completion: the upstream key in place of the client's, a slot
        // under --max-in-flight, the request timeout.
        let headers = upstream_headers(&id, self.upstream_auth(&req));
        let Some(_slot) = Slot::take(self) else {
            let mut response = fault_response(&self.in_flight_fault());
            tag(&mut response, &id);
            return response;
        };
        let answer = async {
            let lease = self.lease(Side::Decode).await?;
            let u = &self.decode.upstreams[lease.index];
            let result = self
                .upstreams
                .call(
                    Method::GET,
                    u.target.uri("/v1/models"),
                    &headers,
                    Bytes::new(),
                    None,
                )
                .await;
            let result = match result {
                Ok(r) => {
                    let status = r.status();
                    let mut share = self.budget.share();
                    let limit = self.config.max_upstream_bytes;
                    let deadline = tokio::time::Instant::now() + self.config.read_timeout;
                    let ceiling = self.budget.limit();
                    self.upstreams
                        .read_body(r, limit, &mut share, ceiling, deadline)
                        .await
                        .map(|b| (status, Outgoing::new(b, Some(share), None)))
                }
                Err(e) => Err(e),
            };
            let outcome = match &result {
                Ok((s, _)) => Outcome::of_status(s.as_u16()),
                Err(_) => Outcome::Failed,
            };
            let url = u.url.clone();
            self.release(Side::Decode, lease, outcome);
            result.map_err(|e| self.call_fault(Side::Decode, &url, e))
        };
        let answer = tokio::time::timeout(self.config.request_timeout, answer);
        let mut response = match answer.await {
            Ok(Ok((status, body))) => json_response(status.as_u16(), body),
            Ok(Err(fault)) => fault_response(&fault),
            Err(_) => fault_response(&self.request_timeout_fault()),
        };
        tag(&mut response, &id);
        response
    }

    /// The fault a failed call is answered with: a server that could not be reached or read
    /// (its address in the log, never to the client). A timeout is a 504; a connection never
    /// made may be retried elsewhere.
    fn call_fault(&self, side: Side, url: &str, e: CallError) -> Fault {
        let s = side.name();
        let limit = self.config.max_upstream_bytes;
        match e {
            CallError::Connect(why) => {
                log::warn!(target: "routed_experts::proxy", "{s} server {url} failed: {why}");
                Fault {
                    retryable: true,
                    ..Fault::new(
                        s,
                        502,
                        format!("the {s} server could not be reached: connect error"),
                    )
                }
            }
            CallError::Timeout => {
                log::warn!(target: "routed_experts::proxy", "{s} server {url} failed: read timeout");
                Fault::new(
                    s,
                    504,
                    format!("the {s} server did not answer in time (read timeout)"),
                )
            }
            CallError::Broken(why) => {
                log::warn!(target: "routed_experts::proxy", "{s} server {url} failed: {why}");
                Fault::new(
                    s,
                    502,
                    format!("the {s} server failed: the connection broke"),
                )
            }
            CallError::TooLarge(size, more) => Fault::new(
                s,
                502,
                format!(
                    "the {s} server's reply is {}{size} bytes, over the limit of {limit} \
                     (--max-upstream-bytes)",
                    if more { "at least " } else { "" }
                ),
            ),
            CallError::Budget => {
                self.metrics.rejected("buffered_bytes");
                Fault::new(
                    "proxy",
                    503,
                    format!(
                        "the proxy is holding its limit of {} bytes of bodies",
                        self.budget.limit()
                    ),
                )
                .retry_after(1)
            }
        }
    }
}

/// A completion slot, given back on drop.
struct Slot(Arc<Proxy>);

impl Slot {
    fn take(proxy: &Arc<Proxy>) -> Option<Slot> {
        let max = proxy.config.max_in_flight;
        proxy
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        proxy.metrics.in_flight(1);
        Some(Slot(Arc::clone(proxy)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.in_flight(-1);
    }
}

/// One request on its way: what its log line and metrics report. Recorded when dropped, so a
/// request whose client left (its future dropped) is counted too, as 499.
pub struct Exchange {
    proxy: Arc<Proxy>,
    /// The id both halves and the response carry.
    pub request_id: String,
    endpoint: &'static str,
    began: Instant,
    status: u16,
    side: &'static str,
    stream: bool,
    prefill: String,
    decode: String,
    seconds: [f64; 3], // prefill, decode, merge
    bytes_out: usize,
    finished: bool,
    handed_off: bool, // its record moved to a stream relay, which records it
}

impl Exchange {
    fn new(proxy: Arc<Proxy>, request_id: String, endpoint: &'static str) -> Self {
        Exchange {
            proxy,
            request_id,
            endpoint,
            began: Instant::now(),
            status: 0,
            side: "none",
            stream: false,
            prefill: "-".into(),
            decode: "-".into(),
            seconds: [0.0; 3],
            bytes_out: 0,
            finished: false,
            handed_off: false,
        }
    }

    fn status(&mut self, status: u16, side: &'static str) {
        self.status = status;
        self.side = side;
        self.finished = true;
    }

    /// The error response for `fault`, recorded.
    fn fail(&mut self, fault: Fault) -> Response<Body> {
        log::warn!(target: "routed_experts::proxy",
            "{} {} {}: {}", self.request_id, self.endpoint, fault.side, fault.message);
        self.status(fault.status, fault.side);
        let mut r = fault_response(&fault);
        self.bytes_out = fault.body().len();
        self.tag(&mut r);
        r
    }

    fn tag(&self, r: &mut Response<Body>) {
        tag(r, &self.request_id);
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if self.handed_off {
            return;
        }
        if !self.finished {
            (self.status, self.side) = (499, "client");
        }
        let total = self.began.elapsed().as_secs_f64();
        let m = &self.proxy.metrics;
        m.request(self.endpoint, self.status, self.side);
        m.observe("total", total);
        for (phase, s) in ["prefill", "decode", "merge"].iter().zip(self.seconds) {
            if s > 0.0 {
                m.observe(phase, s);
            }
        }
        let [p, d, g] = self.seconds.map(|s| s * 1e3);
        log::info!(target: "routed_experts::proxy",
            "request_id={} endpoint={} status={} side={} stream={} prefill={} decode={} \
             prefill_ms={p:.1} decode_ms={d:.1} merge_ms={g:.1} total_ms={:.1} bytes_out={}",
            self.request_id, self.endpoint, self.status, self.side, self.stream, self.prefill,
            self.decode, total * 1e3, self.bytes_out);
    }
}

/// The upstream side of one completion request.
struct Call {
    proxy: Arc<Proxy>,
    endpoint: &'static str,
    headers: Vec<(&'static str, HeaderValue)>,
    deadline: tokio::time::Instant,
}

impl Call {
    /// Where an upstream reply may fill the budget to: prefill replies leave a quarter free for
    /// decode replies, which finish requests (and so free bytes).
    fn ceiling(&self, side: Side) -> usize {
        match side {
            Side::Prefill => self.proxy.budget.prefill_ceiling(),
            Side::Decode => self.proxy.budget.limit(),
        }
    }

    async fn run(
        self,
        ex: &mut Exchange,
        body: ClientBody,
        slot: Slot,
    ) -> Result<Response<Body>, Fault> {
        let proxy = Arc::clone(&self.proxy);
        // A decode server first: with none to take the request, it is refused before a prefill
        // server computes a KV cache that no decode would ever fetch.
        let lease = proxy.lease(Side::Decode).await?;
        let mut lease = LeaseGuard {
            proxy: Arc::clone(&proxy),
            lease: Some(lease),
        };
        let prefill_json = body.prefill_request();
        let (prefill_body, prefill_share) = self.prefill(ex, prefill_json).await?;
        if ex.stream {
            let prefill = (prefill_body, prefill_share);
            return self.stream(ex, body, lease, prefill, slot).await;
        }
        let read = self.read_prefill(&prefill_body, body.start)?;
        let decode_json = body.decode_request(read.kv_transfer_params);
        let lease = lease.take();
        ex.decode = proxy.decode.upstreams[lease.index].url.clone();
        let (decode_body, decode_share) = self
            .fetch(
                ex,
                Side::Decode,
                lease,
                decode_json.into(),
                prefill_share.held(),
            )
            .await?;
        let began = Instant::now();
        // The merged body goes out as slices of the two bodies (only the rewritten parts are
        // new bytes): nothing is assembled, and the bodies' budget is held until it is sent.
        let parts = blocking_if(decode_body.len() >= BLOCKING_BYTES, || {
            let opts = MergeOptions {
                require_routing: true,
                ..self.merge_options(body.start)
            };
            let spliced = merge_response_found(&prefill_body, &read.routing, &decode_body, opts)?;
            let seen = merge_suspects(
                &read.routing.values,
                spliced.decode_values(),
                &opts,
                SAMPLE_ROWS,
            );
            Ok((
                shared_slices(&spliced, &[&prefill_body, &decode_body])?,
                seen,
            ))
        })
        .map_err(merge_fault)?;
        let (parts, (prefill_seen, decode_seen)) = parts;
        proxy
            .metrics
            .routing_rows("prefill", &ex.prefill, prefill_seen);
        proxy
            .metrics
            .routing_rows("decode", &ex.decode, decode_seen);
        ex.seconds[2] = began.elapsed().as_secs_f64();
        let len = parts.iter().map(Bytes::len).sum();
        proxy.metrics.merged(len);
        ex.status(200, "none");
        ex.bytes_out = len;
        // The slot and both bodies' budget stay held until the last part is written.
        let held: Held = Arc::new((slot, prefill_share, decode_share));
        let body = PartsBody::new(parts, held);
        let mut r = Response::new(BodyExt::boxed(body));
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        ex.tag(&mut r);
        Ok(r)
    }

    fn merge_options(&self, start: Option<u64>) -> MergeOptions {
        MergeOptions {
            hints: Hints {
                start,
                ..Hints::default()
            },
            ..MergeOptions::new(self.proxy.merge_max_bytes)
        }
    }

    /// The prefill body read once (`kv_transfer_params` and its routing, which the merge
    /// reuses), and the client's prompt start checked against the rows prefill returned.
    fn read_prefill<'b>(
        &self,
        body: &'b [u8],
        start: Option<u64>,
    ) -> Result<PrefillBody<'b>, Fault> {
        let max_bytes = self.proxy.merge_max_bytes;
        let (read, rows) = blocking_if(body.len() >= BLOCKING_BYTES, || {
            prefill_rows(body, start, max_bytes)
        })
        .map_err(|e| Fault::new("prefill", 502, format!("malformed prefill body: {e}")))?;
        if let Some(s) = start.filter(|_| rows.contains(&0)) {
            return Err(Fault::bad_field(
                "routed_experts_prompt_start",
                format!(
                    "routed_experts_prompt_start={s} is not below the prompt's length \
                     (prefill returned no rows)"
                ),
            ));
        }
        Ok(read)
    }

    /// The prefill call; a server that could not be connected to is replaced by the next.
    async fn prefill(&self, ex: &mut Exchange, data: Vec<u8>) -> Result<(Bytes, Share), Fault> {
        let proxy = &self.proxy;
        let lease = proxy.lease(Side::Prefill).await?;
        let first = lease.index;
        ex.prefill = proxy.prefill.upstreams[first].url.clone();
        let data = Bytes::from(data);
        match self.fetch(ex, Side::Prefill, lease, data.clone(), 0).await {
            Err(fault) if fault.retryable => {
                let Some(retry) = proxy.prefill.pick(Some(first)) else {
                    return Err(fault);
                };
                let url = proxy.prefill.upstreams[retry.index].url.clone();
                log::warn!(target: "routed_experts::proxy",
                    "{} prefill {} unreachable, retrying on {url}", ex.request_id, ex.prefill);
                ex.prefill = url;
                self.fetch(ex, Side::Prefill, retry, data, 0).await
            }
            other => other,
        }
    }

    /// POST `data` to the leased upstream: its response head, and the guard that gives the
    /// lease back with the outcome the caller records in it (Failed already if no head came).
    async fn post(
        &self,
        side: Side,
        lease: Lease,
        data: Bytes,
    ) -> (ReleaseGuard<'_>, Result<Response<Incoming>, Fault>) {
        let proxy = &self.proxy;
        let u = &proxy.pool(side).upstreams[lease.index];
        let mut guard = ReleaseGuard {
            proxy,
            side,
            lease: Some(lease),
            outcome: Outcome::Unknown,
        };
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

    /// An upstream's whole reply body, within the size limit and the body budget.
    /// `beside`: bytes the request already holds (the prefill body, while decode's reply is
    /// read), which make it a holder in the budget's waiting rule.
    async fn read_reply(
        &self,
        side: Side,
        r: Response<Incoming>,
        beside: usize,
    ) -> Result<(Bytes, Share), CallError> {
        let proxy = &self.proxy;
        let mut share = proxy.budget.share().beside(beside);
        let limit = proxy.config.max_upstream_bytes;
        let (ceiling, deadline) = (self.ceiling(side), proxy.wait_deadline(self.deadline));
        let body = proxy
            .upstreams
            .read_body(r, limit, &mut share, ceiling, deadline)
            .await?;
        Ok((body, share))
    }

    /// POST to an upstream and read its JSON reply, recording the upstream's health.
    async fn fetch(
        &self,
        ex: &mut Exchange,
        side: Side,
        lease: Lease,
        data: Bytes,
        beside: usize,
    ) -> Result<(Bytes, Share), Fault> {
        let proxy = &self.proxy;
        let url = &proxy.pool(side).upstreams[lease.index].url;
        let began = Instant::now();
        let (mut guard, head) = self.post(side, lease, data).await;
        let reply = match head {
            Ok(r) if encoding(&r).is_some() => {
                guard.outcome = Outcome::of_status(r.status().as_u16());
                Err(encoded_fault(side, url, encoding(&r).unwrap_or_default()))
            }
            Ok(r) => {
                let status = r.status().as_u16();
                let json = is_mime(r.headers().get(CONTENT_TYPE), "application/json");
                self.read_reply(side, r, beside)
                    .await
                    .map(|(body, share)| (status, json, body, share))
                    .map_err(|e| {
                        guard.outcome = Outcome::Failed;
                        proxy.call_fault(side, url, e)
                    })
            }
            Err(fault) => Err(fault),
        };
        let i = if side == Side::Prefill { 0 } else { 1 };
        ex.seconds[i] += began.elapsed().as_secs_f64();
        let (status, json, body, share) = reply?;
        guard.outcome = Outcome::of_status(status);
        if status >= 400 {
            return Err(status_fault(side, url, status, &body));
        }
        let s = side.name();
        if !json {
            log::warn!(target: "routed_experts::proxy", "{s} server {url} did not answer with JSON");
            return Err(Fault::new(
                s,
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
    async fn stream(
        self,
        ex: &mut Exchange,
        body: ClientBody,
        lease: LeaseGuard,
        prefill: (Bytes, Share),
        slot: Slot,
    ) -> Result<Response<Body>, Fault> {
        let (head_tx, head_rx) = oneshot::channel();
        let task = tokio::spawn(self.stream_task(body, lease, prefill, slot, head_tx));
        let mut abort = AbortOnDrop(Some(task.abort_handle()));
        let head = head_rx
            .await
            .map_err(|_| Fault::new("proxy", 500, "the stream ended before its response head"))?;
        let (decode_url, decode_seconds, mut response, record_tx) = head?;
        abort.0 = None; // the task owns the stream from here on (its handle dropped, not aborted)
        ex.decode = decode_url;
        ex.seconds[1] = decode_seconds;
        ex.status(200, "none");
        ex.tag(&mut response);
        // The record goes to the task, which logs it when the stream ends.
        let proxy = Arc::clone(&ex.proxy);
        let mut record = Exchange::new(proxy, ex.request_id.clone(), ex.endpoint);
        std::mem::swap(&mut record, ex);
        ex.handed_off = true;
        let _ = record_tx.send(record);
        Ok(response)
    }

    async fn stream_task(
        self,
        body: ClientBody,
        mut lease: LeaseGuard,
        (prefill_body, prefill_share): (Bytes, Share),
        slot: Slot,
        head_tx: oneshot::Sender<Result<Head, Fault>>,
    ) {
        let proxy = Arc::clone(&self.proxy);
        let read = match self.read_prefill(&prefill_body, body.start) {
            Ok(read) => read,
            Err(fault) => {
                let _ = head_tx.send(Err(fault));
                return;
            }
        };
        let decode_json = body.decode_request(read.kv_transfer_params);
        let opts = self.merge_options(body.start);
        drop(body);
        let lease = lease.take();
        let url = proxy.decode.upstreams[lease.index].url.clone();
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
        let relay = Relay {
            share: proxy.budget.share().beside(prefill_share.held()),
            proxy,
            url,
            record,
            lease: Some(lease),
            merger: StreamMerger::new(&prefill_body, &read.routing, opts, max_line),
            tx,
            deadline: self.deadline,
            began,
            held: Arc::new((slot, prefill_share)),
            ended_line: true,
        };
        relay.run(upstream.into_body()).await;
    }

    /// The decode call of a stream, up to a response head that is a stream.
    async fn open_stream(
        &self,
        lease: Lease,
        data: Vec<u8>,
        beside: usize,
    ) -> Result<(Lease, Response<Incoming>), Fault> {
        let url = &self.proxy.decode.upstreams[lease.index].url;
        let (mut guard, head) = self.post(Side::Decode, lease, data.into()).await;
        let r = head?;
        let status = r.status().as_u16();
        if status >= 400 {
            guard.outcome = Outcome::of_status(status);
            let body = self
                .read_reply(Side::Decode, r, beside)
                .await
                .map(|(b, _)| b);
            let body = body.unwrap_or_default();
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
                "decode",
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
type Head = (String, f64, Response<Body>, oneshot::Sender<Exchange>);

/// Aborts a task when dropped (the request it serves was dropped: its client left).
struct AbortOnDrop(Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// A decode stream being relayed to its client.
struct Relay<'a> {
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

enum Step {
    Chunk(Option<Bytes>),
    Failed(CallError),
    Expired,
    ClientGone,
}

impl Relay<'_> {
    async fn run(mut self, mut body: Incoming) {
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
                    // The bytes sent on stay counted, with the pieces, until they are written;
                    // what stays with the relay is the line held back.
                    let sent = self.share.split_beyond(self.merger.buffered());
                    if !self.send_all(out, Some(sent)).await {
                        self.record.finished = false;
                        break (Outcome::Unknown, None);
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
        metrics.routing_rows("prefill", &self.record.prefill, prefill_seen);
        metrics.routing_rows("decode", &self.url, decode_seen);
        if let Some(fault) = tail {
            log::warn!(target: "routed_experts::proxy", "{} {} stream {}: {}",
                self.record.request_id, self.record.endpoint, fault.side, fault.message);
            self.record.side = fault.side;
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
        self.record.seconds[1] = self.began.elapsed().as_secs_f64();
    }

    /// Send pieces to the client, the last holding `share` (the bytes they came from) until
    /// it is written; `false` when the client is gone.
    async fn send_all(&mut self, pieces: Vec<Bytes>, mut share: Option<Share>) -> bool {
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
struct ChannelBody(mpsc::Receiver<Outgoing>);

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

/// Gives a lease back when a request ends before its upstream call starts.
struct LeaseGuard {
    proxy: Arc<Proxy>,
    lease: Option<Lease>,
}

impl LeaseGuard {
    /// The lease, for the call that now gives it back itself.
    fn take(&mut self) -> Lease {
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
struct ReleaseGuard<'a> {
    proxy: &'a Proxy,
    side: Side,
    lease: Option<Lease>,
    outcome: Outcome,
}

impl Drop for ReleaseGuard<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.proxy.release(self.side, lease, self.outcome);
        }
    }
}

/// The prefill body read as the proxy needs it, and, when the client gave a prompt start,
/// each routing value's rows.
fn prefill_rows(
    body: &[u8],
    start: Option<u64>,
    max_bytes: usize,
) -> routed_experts::Result<(PrefillBody<'_>, Vec<usize>)> {
    let read = read_prefill(body)?;
    let hints = Hints {
        start,
        ..Hints::default()
    };
    let rows = match start {
        None => Vec::new(),
        Some(_) => read
            .routing
            .values
            .iter()
            .map(|f| {
                routing_rows(f, &hints, max_bytes)
                    .map_err(|e| e.context(format!("choice {}", f.index)))
            })
            .collect::<routed_experts::Result<_>>()?,
    };
    Ok((read, rows))
}

/// Run `f` telling the runtime this thread blocks, when the work is large.
fn blocking_if<T>(large: bool, f: impl FnOnce() -> T) -> T {
    if large {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

fn merge_fault(e: Error) -> Fault {
    let text = e.to_string();
    for side in ["prefill", "decode"] {
        if text.contains(&format!("missing routing on the {side} side")) {
            return Fault::new(side, 502, text);
        }
    }
    match e {
        Error::Merge(_) => Fault::new(
            "merge",
            502,
            format!("prefill and decode routing do not merge: {text}"),
        ),
        Error::Payload(_) => Fault::new(
            "merge",
            502,
            format!("malformed routing from an upstream: {text}"),
        ),
    }
}

fn stream_fault(e: StreamError) -> Fault {
    match e {
        StreamError::NoDone => {
            Fault::new("decode", 502, "the decode stream ended before data: [DONE]")
        }
        StreamError::LineTooLong(n) => Fault::new(
            "decode",
            502,
            format!("decode stream: a line of more than {n} bytes (the limit on one event)"),
        ),
        StreamError::Merge(e) => merge_fault(e),
    }
}

/// A 4xx is about the client's request: its status is passed on. A 5xx is the upstream's
/// fault (502).
fn status_fault(side: Side, url: &str, status: u16, body: &[u8]) -> Fault {
    // Escaped before it reaches the log: a newline or an escape sequence in a server's answer
    // must not be able to forge a log line.
    let text: String = String::from_utf8_lossy(&body[..body.len().min(2000)])
        .escape_debug()
        .collect();
    let s = side.name();
    log::warn!(target: "routed_experts::proxy", "{s} server {url} answered {status}: {text}");
    let code = if status < 500 { status } else { 502 };
    Fault::new(s, code, format!("the {s} server answered {status}: {text}"))
}

fn is_mime(value: Option<&HeaderValue>, mime: &str) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case(mime))
}

fn upstream_headers(id: &str, auth: Option<HeaderValue>) -> Vec<(&'static str, HeaderValue)> {
    // Bodies are merged as they come: a compressed one could not be read.
    let mut h = vec![
        ("content-type", HeaderValue::from_static("application/json")),
        ("accept-encoding", HeaderValue::from_static("identity")),
    ];
    if let Ok(v) = HeaderValue::from_str(id) {
        h.push(("x-request-id", v));
    }
    if let Some(a) = auth {
        h.push(("authorization", a));
    }
    h
}

/// A reply's content coding other than identity (which the proxy asked for), as sent.
fn encoding(r: &Response<Incoming>) -> Option<String> {
    let v = r.headers().get(hyper::header::CONTENT_ENCODING)?;
    let text = String::from_utf8_lossy(v.as_bytes())
        .trim()
        .to_ascii_lowercase();
    (text != "identity" && !text.is_empty()).then_some(text)
}

/// A reply in a content coding the proxy cannot merge (it asks for identity).
fn encoded_fault(side: Side, url: &str, encoding: String) -> Fault {
    let s = side.name();
    let shown = encoding.escape_debug().take(40).collect::<String>();
    log::warn!(target: "routed_experts::proxy", "{s} server {url} answered in Content-Encoding {shown}");
    Fault::new(
        s,
        502,
        format!(
            "the {s} server answered in Content-Encoding \"{shown}\"; the proxy merges only \
             identity bodies (it sends Accept-Encoding: identity)"
        ),
    )
}

/// `X-Request-Id: id` on a response (ids are printable ASCII, so it always fits a header).
fn tag(r: &mut Response<Body>, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert("x-request-id", v);
    }
}

/// The client's `X-Request-Id` when acceptable, else a new random one.
pub fn request_id<B>(req: &Request<B>) -> String {
    if let Some(v) = req.headers().get("x-request-id") {
        if acceptable_request_id(v.as_bytes()) {
            if let Ok(s) = v.to_str() {
                return s.to_string();
            }
        }
    }
    // RandomState is seeded from the OS per process and stepped per instance: 128 random-
    // enough bits with no extra dependency (ids need to be unique, not secret).
    let s = std::collections::hash_map::RandomState::new();
    let (mut a, mut b) = (s.build_hasher(), s.build_hasher());
    a.write_u8(1);
    b.write_u8(2);
    format!("rx-{:016x}{:016x}", a.finish(), b.finish())
}

/// A JSON response with `body`.
pub fn json_response(status: u16, body: impl Into<Outgoing>) -> Response<Body> {
    response(status, "application/json", body)
}

/// A response with a content type and a whole body (bytes, or bytes that hold their budget
/// share until written).
pub fn response(
    status: u16,
    content_type: &'static str,
    body: impl Into<Outgoing>,
) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// The error response for `fault`, with its headers.
pub fn fault_response(fault: &Fault) -> Response<Body> {
    let mut r = json_response(fault.status, Bytes::from(fault.body()));
    let h = r.headers_mut();
    if let Some(s) = fault.retry_after {
        h.insert("retry-after", HeaderValue::from(s));
    }
    if let Some(allow) = fault.allow {
        h.insert("allow", HeaderValue::from_static(allow));
    }
    if fault.close {
        h.insert("connection", HeaderValue::from_static("close"));
    }
    r
}
