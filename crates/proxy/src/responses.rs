//! The HTTP responses the proxy builds: JSON and error answers, with their headers.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use super::fault::Fault;
use super::parts::Outgoing;

/// The body of every response the proxy sends.
pub type Body = BoxBody<Outgoing, Infallible>;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::Blame;

    #[test]
    fn a_faults_answer_carries_its_status_and_headers() {
        let f = Fault::new(Blame::Proxy, 503, "busy")
            .retry_after(2)
            .closing();
        let r = fault_response(&f);
        assert_eq!(r.status(), 503);
        let h = r.headers();
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["connection"], "close");
        let plain = fault_response(&Fault::new(Blame::Client, 400, "bad"));
        assert!(plain.headers().get("retry-after").is_none());
        // A status no HTTP status can be is sent as a 502, never a panic.
        assert_eq!(json_response(1000, Bytes::new()).status(), 502);
    }
}
