//! A completion request's way in: its body received within its limits, a completion slot
//! taken, the call to the upstreams run within the request's deadline, and what the upstreams
//! are sent as `Authorization`.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH};
use hyper::{Request, Response};

use super::budget::Share;
use super::call::{upstream_headers, Call};
use super::fault::{Blame, Fault};
use super::policy::session_key;
use super::proxy::{Proxy, Slot};
use super::record::{request_id, Exchange};
use super::request::{Api, ClientBody};
use super::responses::{fault_response, Body};

/// A completion request (`endpoint` is its exact path).
pub(crate) async fn completion(
    proxy: &Arc<Proxy>,
    req: Request<Incoming>,
    endpoint: &'static str,
    api: Api,
) -> Response<Body> {
    let began = Instant::now();
    let mut ex = Exchange::new(Arc::clone(proxy), request_id(&req), endpoint);
    let deadline = tokio::time::Instant::from_std(began + proxy.config.request_timeout);
    let auth = upstream_auth(proxy, &req);
    let session_header = proxy
        .session_header
        .as_ref()
        .and_then(|h| req.headers().get(h))
        .map(|v| session_key(v.as_bytes()));
    // The body first, within its limits: a request takes a completion slot only once its
    // body is whole, so clients that drip their bodies cannot hold the slots.
    let raw = match receive_body(proxy, req).await {
        Ok(raw) => raw,
        Err(None) => {
            // Nobody reads this; it says what the log says, never a 200.
            ex.status(499, Some(Blame::Client));
            return fault_response(&Fault::new(Blame::Client, 499, "the client left").closing());
        }
        Err(Some(fault)) => return ex.fail(fault),
    };
    let Some(slot) = Slot::take(proxy) else {
        return ex.fail(proxy.in_flight_fault());
    };
    let mut body = match ClientBody::parse(&raw.0, api) {
        Ok(b) => b,
        Err(fault) => return ex.fail(fault),
    };
    body.session = session_header.or(body.session);
    drop(raw); // its bytes go back to the budget; the parsed fields hold their own copy
    ex.stream = body.stream;
    let call = Call {
        proxy: Arc::clone(proxy),
        endpoint,
        headers: upstream_headers(&ex.request_id, auth),
        deadline,
    };
    match tokio::time::timeout_at(deadline, call.run(&mut ex, body, slot)).await {
        Ok(Ok(response)) => response,
        Ok(Err(fault)) => ex.fail(fault),
        Err(_) => ex.fail(proxy.request_timeout_fault()),
    }
}

/// What the upstreams are sent as `Authorization`: `--upstream-api-key` when set, else the
/// client's own header.
pub(crate) fn upstream_auth(proxy: &Proxy, req: &Request<Incoming>) -> Option<HeaderValue> {
    match &proxy.config.upstream_api_key {
        Some(key) => HeaderValue::from_str(&format!("Bearer {key}")).ok(),
        None => req.headers().get(AUTHORIZATION).cloned(),
    }
}

/// The client's whole body, or the fault to answer with (`None`: the client left).
async fn receive_body(
    proxy: &Proxy,
    req: Request<Incoming>,
) -> Result<(Bytes, Share), Option<Fault>> {
    let c = &proxy.config;
    let too_large = |size: u64| {
        Fault::new(
            Blame::Client,
            413,
            format!(
                "the request body is {size} bytes, over the limit of {} (--max-request-bytes)",
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
    let mut share = proxy.budget.share();
    let over_budget = || {
        proxy.metrics.rejected("buffered_bytes");
        Fault::new(
            Blame::Proxy,
            503,
            format!(
                "the proxy is receiving its limit of {} bytes of request bodies",
                proxy.budget.limit()
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
                    return Err(Some(Fault::new(Blame::Client, 400, why).closing()));
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
            proxy.metrics.rejected("body_timeout");
            let t = c.body_timeout.as_secs_f64();
            Err(Some(
                Fault::new(
                    Blame::Client,
                    408,
                    format!("the request body did not arrive within {t} s"),
                )
                .closing(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::server::Stop;
    use crate::test_server::{self, unreachable_config, Running};

    /// A raw HTTP/1.1 exchange with a proxy whose upstreams are never reached: the status
    /// line and body of its answer to `request`.
    fn exchange(request: &[u8], config: Config) -> String {
        let proxy = Running::start(config, false);
        let out = test_server::exchange(proxy.addr, request);
        proxy.stop(Stop::Now).unwrap();
        out
    }

    fn config() -> Config {
        Config {
            max_request_bytes: 1000,
            ..unreachable_config()
        }
    }

    #[test]
    fn a_body_declared_past_the_limit_is_refused_before_it_is_read() {
        let req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n";
        let out = exchange(req, config());
        assert!(out.starts_with("HTTP/1.1 413"), "{out}");
        assert!(out.contains("5000 bytes, over the limit of 1000"), "{out}");
    }

    #[test]
    fn a_body_that_is_not_a_json_object_is_the_clients_fault() {
        let body = b"[1, 2]";
        let mut req = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        let out = exchange(&req, config());
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    }
}
