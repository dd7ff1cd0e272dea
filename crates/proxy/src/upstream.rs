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
use routed_experts::body::Base64Runs;

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

    /// A whole body, refused past `limit` bytes (by its Content-Length before reading, else
    /// as it arrives) and counted against the budget through `share`: it waits (until
    /// `deadline`) for room below `ceiling`, and is refused if none comes. With `set_aside`, a
    /// large body whose size its head gives takes as many bytes again with it, as the share's
    /// reserve ([`Share::set_aside`]), as far as the budget could ever hold them. With `scan`,
    /// also the body's long base64 runs, each piece scanned as it is joined, while it is in
    /// cache ([`Base64Runs`]; none for a body that came in one piece).
    pub async fn read_body(
        &self,
        response: Response<Incoming>,
        limit: usize,
        share: &mut Share,
        (ceiling, set_aside): (usize, bool),
        deadline: tokio::time::Instant,
        scan: bool,
    ) -> Result<(Bytes, Option<Base64Runs>), CallError> {
        let declared = response
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = declared {
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
        }
        let mut body = response.into_body();
        let mut out = BytesMut::new();
        let mut first: Option<Bytes> = None;
        let mut runs = scan.then(Base64Runs::new);
        while let Some(chunk) = self.next_chunk(&mut body).await? {
            let size = out.len() + first.as_ref().map_or(0, Bytes::len) + chunk.len();
            if size > limit {
                return Err(CallError::TooLarge(size as u64, true));
            }
            if declared.is_none_or(|n| size as u64 > n)
                && !share.grow_wait(chunk.len(), ceiling, deadline).await
            {
                let room = share.room(chunk.len(), ceiling).min(ceiling);
                return Err(if chunk.len() > room {
                    CallError::NeverFits(size as u64, room + share.held(), true)
                } else {
                    CallError::Budget
                });
            }
            // A body that arrives in one piece is kept as it is; more pieces are joined once.
            match first.take() {
                None if out.is_empty() => first = Some(chunk),
                None => out.extend_from_slice(&chunk),
                Some(f) => {
                    out.reserve(declared.map_or(size, |n| n as usize));
                    out.extend_from_slice(&f);
                    if let Some(r) = runs.as_mut() {
                        r.extend(&out);
                    }
                    out.extend_from_slice(&chunk);
                }
            }
            if let Some(r) = runs.as_mut().filter(|_| !out.is_empty()) {
                r.extend(&out);
            }
        }
        match first {
            // One piece: no run crosses a piece, so the walk's own scan is all there is.
            Some(one) => Ok((one, None)),
            None => Ok((out.freeze(), runs)),
        }
    }
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
    use crate::budget::Budget;

    /// A prefill-like body with a routing string of `len` base64 characters, served once with a
    /// length, written in pieces of 10,000 bytes so that it arrives in several; what
    /// `read_body` returns with and without `scan`, and where the string's content starts.
    async fn read_in_pieces(len: usize, scan: bool) -> (Bytes, Option<Base64Runs>, usize) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let head = br#"{"choices":[{"index":0,"routed_experts":""#;
        let mut body = head.to_vec();
        body.extend((0..len).map(|i| b"k4/+"[i % 4]));
        body.extend_from_slice(br#""}],"usage":{"prompt_tokens":9}}"#);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let sent = body.clone();
        tokio::spawn(async move {
            let (mut c, _) = listener.accept().await.unwrap();
            let mut request = vec![0; 4096];
            let _ = c.read(&mut request).await.unwrap();
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", sent.len());
            c.write_all(head.as_bytes()).await.unwrap();
            for piece in sent.chunks(10_000) {
                c.write_all(piece).await.unwrap();
                c.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        let up = Upstreams::new(Duration::from_secs(5), Duration::from_secs(5), 1);
        let uri: Uri = format!("http://127.0.0.1:{port}/").parse().unwrap();
        let r = up
            .call(Method::POST, uri, &[], Bytes::new(), None)
            .await
            .unwrap();
        let mut share = Budget::new(1 << 30).share();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let (got, runs) = up
            .read_body(r, 1 << 30, &mut share, (1 << 30, false), deadline, scan)
            .await
            .unwrap();
        assert_eq!(got, body);
        (got, runs, head.len())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_read_in_pieces_knows_its_routing_string_run_when_asked() {
        let (body, runs, start) = read_in_pieces(60_000, true).await;
        let runs = runs.expect("several pieces, scanned");
        assert_eq!(runs.scanned(), body.len());
        assert_eq!(runs.run_from(start), Some(start + 60_000));
        // The walk takes it and reads what it reads without it.
        let with = routed_experts::body::read_prefill_scanned(&body, Some(&runs)).unwrap();
        let without = routed_experts::body::read_prefill(&body).unwrap();
        assert_eq!(format!("{with:?}"), format!("{without:?}"));
        assert!(with.routing.values[0].base64);
        let (_, none, _) = read_in_pieces(60_000, false).await;
        assert!(none.is_none());
    }

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
