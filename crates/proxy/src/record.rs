//! One request's record: its id, status, blame and phase times, logged and counted once.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Instant;

use hyper::header::HeaderValue;
use hyper::{Request, Response};

use super::fault::Fault;
use super::metrics::Phase;
use super::request::acceptable_request_id;

use super::fault::Blame;
use super::proxy::Proxy;
use super::responses::{fault_response, Body};

/// One request on its way: what its log line and metrics report. Recorded when dropped, so a
/// request whose client left (its future dropped) is counted too, as 499.
pub struct Exchange {
    pub(crate) proxy: Arc<Proxy>,
    /// The id both halves and the response carry.
    pub request_id: String,
    pub(crate) endpoint: &'static str,
    pub(crate) began: Instant,
    pub(crate) status: u16,
    pub(crate) side: Option<Blame>,
    pub(crate) stream: bool,
    pub(crate) prefill: String,
    pub(crate) decode: String,
    /// Seconds of each phase but the total, indexed by [`Phase`].
    pub(crate) seconds: [f64; 3],
    pub(crate) bytes_out: usize,
    pub(crate) finished: bool,
    pub(crate) handed_off: bool, // its record moved to a stream relay, which records it
}

impl Exchange {
    pub(crate) fn new(proxy: Arc<Proxy>, request_id: String, endpoint: &'static str) -> Self {
        Exchange {
            proxy,
            request_id,
            endpoint,
            began: Instant::now(),
            status: 0,
            side: None,
            stream: false,
            prefill: "-".into(),
            decode: "-".into(),
            seconds: [0.0; 3],
            bytes_out: 0,
            finished: false,
            handed_off: false,
        }
    }

    pub(crate) fn status(&mut self, status: u16, side: Option<Blame>) {
        self.status = status;
        self.side = side;
        self.finished = true;
    }

    /// The error response for `fault`, recorded.
    pub(crate) fn fail(&mut self, fault: Fault) -> Response<Body> {
        // Escaped: a message may quote an upstream's text, which must not forge a log line.
        log::warn!(target: "routed_experts::proxy", "{} {} {}: {}",
            self.request_id, self.endpoint, fault.side, crate::fault::one_line(&fault.message));
        self.status(fault.status, Some(fault.side));
        let mut r = fault_response(&fault);
        self.bytes_out = fault.body().len();
        self.tag(&mut r);
        r
    }

    pub(crate) fn tag(&self, r: &mut Response<Body>) {
        tag(r, &self.request_id);
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if self.handed_off {
            return;
        }
        if !self.finished {
            (self.status, self.side) = (499, Some(Blame::Client));
        }
        let total = self.began.elapsed().as_secs_f64();
        let m = &self.proxy.metrics;
        let side = self.side.map_or("none", Blame::name);
        m.request(self.endpoint, self.status, side);
        m.observe(Phase::Total, total);
        for phase in [Phase::Prefill, Phase::Decode, Phase::Merge] {
            let s = self.seconds[phase as usize];
            if s > 0.0 {
                m.observe(phase, s);
            }
        }
        let [p, d, g] = self.seconds.map(|s| s * 1e3);
        log::info!(target: "routed_experts::proxy",
            "request_id={} endpoint={} status={} side={} stream={} prefill={} decode={} \
             prefill_ms={p:.1} decode_ms={d:.1} merge_ms={g:.1} total_ms={:.1} bytes_out={}",
            self.request_id, self.endpoint, self.status, side, self.stream, self.prefill,
            self.decode, total * 1e3, self.bytes_out);
    }
}

/// `X-Request-Id: id` on a response (ids are printable ASCII, so it always fits a header).
pub(crate) fn tag(r: &mut Response<Body>, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert(super::request::REQUEST_ID, v);
    }
}

/// The client's `X-Request-Id` when acceptable, else a new random one.
pub fn request_id<B>(req: &Request<B>) -> String {
    if let Some(v) = req.headers().get(super::request::REQUEST_ID) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_id(id: &[u8]) -> Request<()> {
        let mut r = Request::new(());
        if let Ok(v) = HeaderValue::from_bytes(id) {
            r.headers_mut().insert(crate::request::REQUEST_ID, v);
        }
        r
    }

    #[test]
    fn a_clients_request_id_is_kept_else_a_new_one_is_made() {
        assert_eq!(request_id(&with_id(b"trace-42")), "trace-42");
        let (a, b) = (request_id(&Request::new(())), request_id(&Request::new(())));
        assert!(a.starts_with("rx-") && a.len() == 35, "{a}");
        assert_ne!(a, b, "two requests, one id");
        // An id a log line or a header could be broken by is replaced, not passed on.
        let long = vec![b'a'; 300];
        for bad in [&b"two words"[..], b"", &long] {
            assert!(request_id(&with_id(bad)).starts_with("rx-"), "{bad:?}");
        }
    }
}
