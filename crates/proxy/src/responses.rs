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
