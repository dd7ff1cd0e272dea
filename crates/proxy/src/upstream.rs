//! Calls to the prefill and decode servers: one pooled HTTP/1.1 client, timeouts on connecting
//! and on silence, and bodies read within the size limit and the buffer budget.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH};
use hyper::{Method, Request, Response, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::budget::Share;

/// An upstream's base URL, parsed: `http://HOST[:PORT][/PREFIX]`, to which endpoint paths are
/// appended.
#[derive(Clone, Debug)]
pub struct Target {
    base: String,
}

impl Target {
    /// `url` checked; `Err` says what is wrong with it.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("expected a URL like http://HOST:PORT, got {url:?} ({e})"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "{url:?}: https upstreams are not supported (the proxy speaks plain HTTP \
                     to the servers, as vLLM serves it)"
                ))
            }
            _ => return Err(format!("expected a URL starting with http://, got {url:?}")),
        }
        let host = uri.host().unwrap_or("");
        if host.is_empty() {
            return Err(format!("expected a host in {url:?}"));
        }
        let authority = uri.authority().map_or("", |a| a.as_str());
        let port = authority.rsplit_once(':').filter(|(_, p)| !p.contains(']'));
        if port.is_some_and(|(_, p)| !p.parse::<u16>().is_ok_and(|p| p > 0)) {
            return Err(format!("expected a port from 1 to 65535 in {url:?}"));
        }
        if uri.query().is_some() || url.contains('#') {
            return Err(format!(
                "expected no query or fragment in {url:?} (endpoints are appended)"
            ));
        }
        Ok(Target {
            base: url.trim_end_matches('/').to_string(),
        })
    }

    /// The URI of `path` (which starts with `/`) on this server.
    pub fn uri(&self, path: &str) -> Uri {
        format!("{}{path}", self.base)
            .parse()
            .expect("a checked base URL and a fixed path form a URI")
    }
}

/// Why a call to an upstream failed.
#[derive(Debug)]
pub enum CallError {
    /// No connection was made (refused, unreachable, connect timeout): safe to retry elsewhere.
    Connect(String),
    /// The server stayed silent past the read timeout.
    Timeout,
    /// The connection broke or the reply was not HTTP.
    Broken(String),
    /// The body passed the size limit: `(bytes, whether more were on the way)`.
    TooLarge(u64, bool),
    /// The body would pass the proxy's budget of buffered bytes.
    Budget,
    /// The body is larger than the budget could ever give it: `(bytes, the most it could get,
    /// whether more were on the way)`.
    NeverFits(u64, usize, bool),
}

/// The pooled client for every upstream.
pub struct Upstreams {
    client: Client<HttpConnector, Full<Bytes>>,
    read_timeout: Duration,
}

impl Upstreams {
    /// A client with these timeouts; up to `max_idle` idle connections kept per server.
    pub fn new(connect_timeout: Duration, read_timeout: Duration, max_idle: usize) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(4))
            .pool_max_idle_per_host(max_idle)
            .http1_max_buf_size(256 * 1024)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);
        Upstreams {
            client,
            read_timeout,
        }
    }

    /// Send a request and wait for the response head (within the read timeout once sent).
    pub async fn call(
        &self,
        method: Method,
        uri: Uri,
        headers: &[(&'static str, HeaderValue)],
        body: Bytes,
        timeout: Option<Duration>,
    ) -> Result<Response<Incoming>, CallError> {
        let mut req = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            req = req.header(*name, value.clone());
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| CallError::Broken(e.to_string()))?;
        let wait = timeout.unwrap_or(self.read_timeout);
        match tokio::time::timeout(wait, self.client.request(req)).await {
            Err(_) => Err(CallError::Timeout),
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) if e.is_connect() => Err(CallError::Connect(describe(&e))),
            Ok(Err(e)) => Err(CallError::Broken(describe(&e))),
        }
    }

    /// The next piece of a body, within the read timeout; `None` at its end.
    pub async fn next_chunk(&self, body: &mut Incoming) -> Result<Option<Bytes>, CallError> {
        loop {
            match tokio::time::timeout(self.read_timeout, body.frame()).await {
                Err(_) => return Err(CallError::Timeout),
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => return Err(CallError::Broken(describe(&e))),
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        if !data.is_empty() {
                            return Ok(Some(data));
                        }
                    } // trailers: nothing to relay
                }
            }
        }
    }

    /// A whole body (`/v1/models`, an error reply to a stream request; completions' replies
    /// read whole are [`Direct`](super::direct)'s), refused past `limit` bytes (by its
    /// Content-Length before reading, else as it arrives) and counted against the budget
    /// through `share`: it waits (until `deadline`) for room below `ceiling`, and is refused if
    /// none comes.
    pub async fn read_body(
        &self,
        response: Response<Incoming>,
        limit: usize,
        share: &mut Share,
        ceiling: usize,
        deadline: tokio::time::Instant,
    ) -> Result<Bytes, CallError> {
        let declared = response
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = declared {
            admit_declared(n, limit, share, (ceiling, false), deadline).await?;
        }
        let mut body = response.into_body();
        let mut out = BytesMut::new();
        while let Some(chunk) = self.next_chunk(&mut body).await? {
            let size = out.len() + chunk.len();
            if size > limit {
                return Err(CallError::TooLarge(size as u64, true));
            }
            if declared.is_none_or(|n| size as u64 > n) {
                grow_undeclared(share, chunk.len(), size, ceiling, deadline).await?;
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out.freeze())
    }
}

/// Room for `piece` more bytes of a body whose length was not declared (`size` with them),
/// waited for until `deadline`; refused when none comes, or when the budget could never give it.
pub(crate) async fn grow_undeclared(
    share: &mut Share,
    piece: usize,
    size: usize,
    ceiling: usize,
    deadline: tokio::time::Instant,
) -> Result<(), CallError> {
    if share.grow_wait(piece, ceiling, deadline).await {
        return Ok(());
    }
    let room = share.room(piece, ceiling).min(ceiling);
    Err(if piece > room {
        CallError::NeverFits(size as u64, room + share.held(), true)
    } else {
        CallError::Budget
    })
}

/// A body whose head declares `n` bytes, admitted before it is read: refused past `limit`, or
/// when the budget could never give it room below `ceiling`; else it waits (until `deadline`)
/// for that room in `share`. With `set_aside`, a large body takes as many bytes again with it,
/// as the share's reserve ([`Share::set_aside`]), as far as the budget could ever hold them.
pub(crate) async fn admit_declared(
    n: u64,
    limit: usize,
    share: &mut Share,
    (ceiling, set_aside): (usize, bool),
    deadline: tokio::time::Instant,
) -> Result<(), CallError> {
    if n > limit as u64 {
        return Err(CallError::TooLarge(n, false));
    }
    let asked = usize::try_from(n).unwrap_or(usize::MAX);
    let room = share.room(asked, ceiling);
    if asked > room.min(ceiling) {
        return Err(CallError::NeverFits(n, room.min(ceiling), false));
    }
    // A large body takes its reserve only as far as the budget could ever hold it.
    let extra = if set_aside && !share.is_small(asked) {
        asked.min(room - asked)
    } else {
        0
    };
    if !share.grow_wait(asked + extra, ceiling, deadline).await {
        return Err(CallError::Budget);
    }
    share.set_aside(extra);
    Ok(())
}

/// An error and its causes in one line (hyper's top-level message alone says little).
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_joined() {
        let t = Target::parse("http://127.0.0.1:8000/prefix/").unwrap();
        assert_eq!(
            t.uri("/v1/completions").to_string(),
            "http://127.0.0.1:8000/prefix/v1/completions"
        );
        for (url, why) in [
            ("localhost:8000", "expected a URL starting with http://"),
            ("ftp://h:1", "expected a URL starting with http://"),
            ("https://h:1", "https upstreams"),
            ("http://h:99999", "expected a port from 1 to 65535"),
            ("http://h:1/?x=1", "expected no query"),
            ("http://h:1/#x", "expected no query"),
        ] {
            let e = Target::parse(url).unwrap_err();
            assert!(e.contains(why), "{url}: {e}");
        }
    }
}
