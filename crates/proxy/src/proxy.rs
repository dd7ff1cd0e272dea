//! [`Proxy`]: what the requests of one proxy share (settings, server pools, the body budget,
//! metrics, completion slots) and what they ask of it (a server leased from a pool, the fault
//! a failed call is answered with). The handlers that take it are functions of their own
//! files: a completion's way in is `inbound.rs`, the other routes `routes.rs`, list changes
//! `membership.rs`; the calls to the upstreams are `call.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::HeaderName;
use hyper::{Method, StatusCode};

use super::budget::Budget;
use super::config::{Config, ConfigError};
use super::direct::Direct;
use super::fault::{Blame, Fault};
use super::metrics::Metrics;
use super::pool::{Lease, Outcome, Pool, Side, Upstream};
use super::upstream::{CallError, Upstreams};

/// When every server of a side is out of rotation, one is probed before a request is refused:
/// at most once a second, answered within two seconds (or the connect timeout, if shorter).
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(1);
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

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
    pub(crate) upstreams: Upstreams,
    /// Calls whose replies are read whole (the rest go through `upstreams`).
    pub(crate) direct: Direct,
    pub(crate) merge_max_bytes: usize,
    pub(crate) session_header: Option<HeaderName>,
}

impl Proxy {
    /// A proxy serving `config`; `Err` says what cannot serve, as [`Config::check`] does (the
    /// servers are read once, from the lists or the file, and checked as the pools take them).
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.check_settings()?;
        let (prefill, decode) = config.upstream_lists()?;
        let eject_after = u32::try_from(config.eject_after).unwrap_or(u32::MAX);
        let pool = |side, urls: &[String], policy| {
            Pool::new(side, urls, policy, eject_after, config.eject_seconds)
        };
        let prefill = pool(Side::Prefill, &prefill, config.prefill_policy)?;
        let decode = pool(Side::Decode, &decode, config.decode_policy)?;
        let metrics = Metrics::default();
        for pool in [&prefill, &decode] {
            for url in pool.urls() {
                metrics.upstream_healthy(pool.side, &url, true);
            }
        }
        let session_header =
            match &config.session_header {
                Some(h) => Some(HeaderName::from_bytes(h.as_bytes()).map_err(|e| {
                    ConfigError::new("session_header", format!("session_header: {e}"))
                })?),
                None => None,
            };
        Ok(Proxy {
            upstreams: Upstreams::new(
                config.connect_timeout,
                config.read_timeout,
                config.max_in_flight,
            ),
            direct: Direct::new(
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
            session_header,
            config,
        })
    }

    pub(crate) fn pool(&self, side: Side) -> &Pool {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    pub(crate) fn release(&self, side: Side, lease: Lease, outcome: Outcome) {
        let pool = self.pool(side);
        if outcome == Outcome::Failed {
            self.metrics.upstream_failed(side, &lease.upstream.url);
        }
        if let Some((url, healthy)) = pool.release(lease, outcome) {
            if healthy {
                log::warn!(target: "routed_experts::proxy", "{} server {url} is back in rotation", side.name());
            }
            self.metrics.upstream_healthy(side, &url, healthy);
        }
    }

    /// A server of `side` for a request (see [`Pool::pick`]), its choice counted.
    pub(crate) fn pick(
        &self,
        side: Side,
        avoid: Option<&Upstream>,
        session: Option<u64>,
    ) -> Option<Lease> {
        let lease = self.pool(side).pick(avoid, session)?;
        self.metrics.picked(side, &lease.upstream.url, lease.choice);
        Some(lease)
    }

    /// Every slot of `--max-in-flight` taken.
    pub(crate) fn in_flight_fault(&self) -> Fault {
        self.metrics.rejected("in_flight");
        let max = self.config.max_in_flight;
        Fault::new(
            Blame::Proxy,
            503,
            format!("the proxy is serving its limit of {max} requests"),
        )
        .retry_after(1)
    }

    /// A request (or stream) still under way at `--request-timeout`.
    pub(crate) fn request_timeout_fault(&self) -> Fault {
        let t = self.config.request_timeout.as_secs_f64();
        Fault::new(
            Blame::Proxy,
            504,
            format!("the request did not finish within {t} s (--request-timeout)"),
        )
    }

    /// How long an upstream reply may wait for room in the body budget: as long as an
    /// upstream may stay silent, within the request's own `deadline`.
    pub(crate) fn wait_deadline(&self, deadline: tokio::time::Instant) -> tokio::time::Instant {
        (tokio::time::Instant::now() + self.config.read_timeout).min(deadline)
    }

    /// Each server's `/health` asked once as the proxy starts, and the answer logged: a server
    /// that is not listening is said at once (a typo in a URL, a server still loading), not at
    /// the first request. Nothing is taken out of rotation: a server that starts later serves.
    pub(crate) fn probe_at_start(self: Arc<Self>) {
        for side in [Side::Prefill, Side::Decode] {
            for u in self.pool(side).upstreams() {
                let proxy = Arc::clone(&self);
                tokio::spawn(async move {
                    let s = side.name();
                    let call = proxy.upstreams.call(
                        Method::GET,
                        u.target.uri("/health"),
                        &[],
                        Bytes::new(),
                        Some(proxy.config.connect_timeout.min(PROBE_TIMEOUT)),
                    );
                    match call.await {
                        Ok(r) if r.status() == StatusCode::OK => log::info!(
                            target: "routed_experts::proxy",
                            "{s} server {} answers /health", u.url),
                        Ok(r) => log::warn!(target: "routed_experts::proxy",
                            "{s} server {} answered /health with {} at start; requests still go \
                             to it", u.url, r.status().as_u16()),
                        Err(e) => {
                            let why = match e {
                                CallError::Connect(why) | CallError::Broken(why) => why,
                                CallError::Timeout => "no answer in time".to_string(),
                                _ => "a reply past the limits".to_string(),
                            };
                            log::warn!(target: "routed_experts::proxy",
                                "{s} server {} does not answer /health at start ({}): requests \
                                 to it fail over until it does", u.url, crate::fault::one_line(&why))
                        }
                    }
                });
            }
        }
    }

    /// The next server of `side`; when every one is out of rotation, the one due first is
    /// probed and serves the request if it answers. Else 503 + Retry-After.
    pub(crate) async fn lease(&self, side: Side, session: Option<u64>) -> Result<Lease, Fault> {
        let pool = self.pool(side);
        if let Some(lease) = self.pick(side, None, session) {
            return Ok(lease);
        }
        if let Some(u) = pool.probe_candidate(PROBE_INTERVAL) {
            let wait = self.config.connect_timeout.min(PROBE_TIMEOUT);
            let probe = self.upstreams.call(
                Method::GET,
                u.target.uri("/health"),
                &[],
                Bytes::new(),
                Some(wait),
            );
            let answered = matches!(probe.await, Ok(r) if r.status() == StatusCode::OK);
            if let Some(lease) = pool.probed(&u, answered) {
                self.metrics.picked(side, &u.url, lease.choice);
                log::warn!(target: "routed_experts::proxy",
                    "{} server {} answered a health probe: trying it", side.name(), u.url);
                return Ok(lease);
            }
        }
        self.metrics.rejected("no_upstream");
        Err(Fault::new(
            Blame::Proxy,
            503,
            format!(
                "no {} server is in rotation (each failed repeatedly, and none answered a \
                 health probe)",
                side.name()
            ),
        )
        .retry_after(pool.retry_after()))
    }

    /// The fault a failed call is answered with: a server that could not be reached or read
    /// (its address in the log, never to the client). A timeout is a 504; a connection never
    /// made may be retried elsewhere.
    pub(crate) fn call_fault(&self, side: Side, url: &str, e: CallError) -> Fault {
        let s = side.name();
        let limit = self.config.max_upstream_bytes;
        match e {
            CallError::Connect(why) => {
                log::warn!(target: "routed_experts::proxy", "{s} server {url} failed: {why}");
                Fault {
                    retryable: true,
                    ..Fault::new(
                        side.into(),
                        502,
                        format!("the {s} server could not be reached: connect error"),
                    )
                }
            }
            CallError::Timeout => {
                log::warn!(target: "routed_experts::proxy", "{s} server {url} failed: read timeout");
                Fault::new(
                    side.into(),
                    504,
                    format!("the {s} server did not answer in time (read timeout)"),
                )
            }
            CallError::Broken(why) => {
                log::warn!(target: "routed_experts::proxy", "{s} server {url} failed: {why}");
                Fault::new(
                    side.into(),
                    502,
                    format!("the {s} server failed: the connection broke"),
                )
            }
            CallError::TooLarge(size, more) => Fault::new(
                side.into(),
                502,
                format!(
                    "the {s} server's reply is {}{size} bytes, over the limit of {limit} \
                     (--max-upstream-bytes; a proxy started with --max-upstream-bytes {size}{} \
                     takes it)",
                    if more { "at least " } else { "" },
                    if more { " or more" } else { "" }
                ),
            ),
            CallError::NeverFits(size, room, more) => {
                self.metrics.rejected("buffered_bytes");
                Fault::new(
                    Blame::Proxy,
                    507,
                    format!(
                        "the {s} server's reply is {}{size} bytes, more than the {room} bytes \
                         the proxy could ever hold for it (--max-buffered-bytes {}): raise the \
                         budget or shorten the request",
                        if more { "at least " } else { "" },
                        self.budget.limit()
                    ),
                )
            }
            CallError::Budget => {
                self.metrics.rejected("buffered_bytes");
                Fault::new(
                    Blame::Proxy,
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
pub(crate) struct Slot(Arc<Proxy>);

impl Slot {
    pub(crate) fn take(proxy: &Arc<Proxy>) -> Option<Slot> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(max_in_flight: usize) -> Arc<Proxy> {
        let config = Config {
            max_in_flight,
            ..crate::test_server::unreachable_config()
        };
        Arc::new(Proxy::new(config).unwrap())
    }

    #[test]
    fn slots_stop_at_max_in_flight_and_come_back_on_drop() {
        let p = proxy(2);
        let (a, b) = (Slot::take(&p), Slot::take(&p));
        assert!(a.is_some() && b.is_some());
        assert!(
            Slot::take(&p).is_none(),
            "a third slot past --max-in-flight 2"
        );
        assert_eq!(p.in_flight.load(Ordering::Relaxed), 2);
        drop(a);
        assert_eq!(p.in_flight.load(Ordering::Relaxed), 1);
        assert!(Slot::take(&p).is_some());
        let f = p.in_flight_fault();
        assert_eq!((f.status, f.retry_after), (503, Some(1)));
        assert!(
            f.message.contains("its limit of 2 requests"),
            "{}",
            f.message
        );
    }

    #[test]
    fn a_failed_call_is_answered_by_its_kind_never_with_the_servers_address() {
        let p = proxy(4);
        let url = "http://10.1.2.3:8000";
        let cases = [
            (
                CallError::Connect("refused".into()),
                502,
                true,
                "could not be reached",
            ),
            (CallError::Timeout, 504, false, "did not answer in time"),
            (
                CallError::Broken("eof".into()),
                502,
                false,
                "the connection broke",
            ),
            (
                CallError::TooLarge(10, true),
                502,
                false,
                "at least 10 bytes",
            ),
            (CallError::Budget, 503, false, "bytes of bodies"),
        ];
        for (e, status, retryable, says) in cases {
            let f = p.call_fault(Side::Decode, url, e);
            assert_eq!(
                (f.status, f.retryable),
                (status, retryable),
                "{}",
                f.message
            );
            assert!(f.message.contains(says), "{}", f.message);
            assert!(!f.message.contains("10.1.2.3"), "{}", f.message);
        }
        assert_eq!(p.request_timeout_fault().status, 504);
    }

    #[test]
    fn a_proxy_is_refused_what_cannot_serve() {
        let no_decode = Config {
            decode: Vec::new(),
            ..crate::test_server::unreachable_config()
        };
        let e = Proxy::new(no_decode)
            .err()
            .expect("no decode server refused");
        assert_eq!(
            (e.setting.as_str(), e.message.as_str()),
            ("decode", "give at least one decode server")
        );
        let bad_header = Config {
            session_header: Some("not a header".into()),
            ..crate::test_server::unreachable_config()
        };
        let e = Proxy::new(bad_header).err().expect("a bad header refused");
        assert_eq!(e.setting, "session_header", "{e}");
    }
}
