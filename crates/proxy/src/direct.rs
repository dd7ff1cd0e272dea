//! The calls whose replies the proxy reads whole (prefill's, and decode's for a plain request),
//! on HTTP/1.1 connections of its own: the reply's head is parsed by httparse, and a body with
//! a Content-Length is read from the socket straight into one buffer of that length. Through
//! hyper's client every piece was first read into its buffer, then copied out and joined: 15%
//! of the proxy's CPU on vLLM's 4 MB prefill replies (docs/benchmark-history.md, issue 39).
//! Streams stay on hyper.
//!
//! The framing rules are RFC 9112's for a client: chunked when the last transfer coding is
//! chunked; else a Content-Length (every value the same number); else the body runs to the
//! connection's close. A 1xx head is skipped; 204 and 304 have no body. A connection goes back
//! to its server's idle list only after a whole reply, without `Connection: close`, on HTTP/1.1.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper::header::HeaderValue;
use hyper::Uri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::budget::Share;
use super::upstream::{admit_declared, grow_undeclared, CallError};
use routed_experts::body::Base64Runs;

/// The most bytes a reply's head may take (hyper's default is 400 KiB; servers send < 1 KiB).
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most header lines a reply's head may have.
const MAX_HEADERS: usize = 100;
/// The most bytes of chunk-size lines and trailers taken in a row before data (a server that
/// sends endless chunk extensions or trailers is refused).
const MAX_CHUNK_META: usize = 64 * 1024;
/// How long an idle connection is kept: below uvicorn's 5 s keep-alive, so the server rarely
/// closes one just as it is taken.
const IDLE_FOR: Duration = Duration::from_secs(4);
/// The most a read asks the socket for (a body with a length is scanned piece by piece).
const READ_PIECE: usize = 256 * 1024;

/// How a reply's body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// After this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// At the connection's close.
    Close,
}

/// A reply's head, as the proxy needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    /// The status code.
    pub status: u16,
    /// `Content-Type`, if given.
    pub content_type: Option<HeaderValue>,
    /// `Content-Encoding`, if given.
    pub content_encoding: Option<HeaderValue>,
    /// How its body ends.
    pub framing: Framing,
    /// Whether the connection may carry another request after this reply.
    pub keep_alive: bool,
}

/// The head at the start of `buf`, and its length in bytes; `Ok(None)` when it is not all
/// there yet. `Err` says what is wrong with it.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, String> {
    let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Response::new(&mut lines);
    let used = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
            return Err(format!("a reply head over {MAX_HEAD_BYTES} bytes"))
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("a malformed reply head ({e})")),
    };
    if used > MAX_HEAD_BYTES {
        return Err(format!("a reply head over {MAX_HEAD_BYTES} bytes"));
    }
    let status = r.code.unwrap_or(0);
    let http11 = r.version == Some(1);
    let (mut length, mut chunked, mut coded, mut close) = (None, false, false, !http11);
    let (mut content_type, mut content_encoding) = (None, None);
    for h in r.headers.iter() {
        let value = || HeaderValue::from_bytes(h.value).ok();
        let text = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            for part in text.split(',') {
                let part = part.trim();
                let n: u64 = part
                    .parse()
                    .ok()
                    .filter(|_| part.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| format!("a Content-Length that is no length: {text:?}"))?;
                if length.is_some_and(|m| m != n) {
                    return Err("two different Content-Lengths".into());
                }
                length = Some(n);
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // Only the last coding decides whether the body is chunked.
            for coding in text.split(',').map(str::trim).filter(|c| !c.is_empty()) {
                coded = true;
                chunked = coding.eq_ignore_ascii_case("chunked");
            }
        } else if h.name.eq_ignore_ascii_case("connection") {
            for token in text.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    close = true;
                } else if token.eq_ignore_ascii_case("keep-alive") && !http11 {
                    close = false;
                }
            }
        } else if h.name.eq_ignore_ascii_case("content-type") {
            content_type = value();
        } else if h.name.eq_ignore_ascii_case("content-encoding") {
            content_encoding = value();
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Length(0)
    } else if coded {
        // A Content-Length beside Transfer-Encoding is ignored (RFC 9112 §6.3), and the
        // connection is not reused: the two could be a smuggling attempt.
        close |= length.is_some();
        if chunked {
            Framing::Chunked
        } else {
            Framing::Close
        }
    } else {
        length.map_or(Framing::Close, Framing::Length)
    };
    let keep_alive = !close && framing != Framing::Close;
    Ok(Some((
        Head {
            status,
            content_type,
            content_encoding,
            framing,
            keep_alive,
        },
        used,
    )))
}

/// A chunked body's decoder, fed bytes as they arrive.
#[derive(Debug, Default)]
pub struct Dechunk {
    state: ChunkState,
    meta: usize,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// A chunk-size line is next.
    #[default]
    Size,
    /// This many data bytes of the current chunk are still to come.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines, until an empty one.
    Trailers,
    /// The body is over.
    Done,
}

/// What [`Dechunk::next`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Body bytes.
    Data(Bytes),
    /// More input is needed.
    More,
    /// The body has ended (what follows in the input is not its).
    End,
}

impl Dechunk {
    /// The next step of the body from `input` (whose used bytes are taken off its front).
    pub fn next(&mut self, input: &mut BytesMut) -> Result<Step, String> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(Step::End),
                ChunkState::Size => match httparse::parse_chunk_size(input) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        self.take_meta(input, used)?;
                        self.state = if size == 0 {
                            ChunkState::Trailers
                        } else {
                            ChunkState::Data(size)
                        };
                    }
                    Ok(httparse::Status::Partial) => return self.more(input),
                    Err(_) => return Err("a malformed chunk size".into()),
                },
                ChunkState::Data(left) => {
                    if input.is_empty() {
                        return Ok(Step::More);
                    }
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(input.len());
                    self.meta = 0;
                    self.state = match left - n as u64 {
                        0 => ChunkState::DataEnd,
                        rest => ChunkState::Data(rest),
                    };
                    return Ok(Step::Data(input.split_to(n).freeze()));
                }
                ChunkState::DataEnd => {
                    if input.len() < 2 {
                        return Ok(Step::More);
                    }
                    if &input[..2] != b"\r\n" {
                        return Err("a chunk's data not followed by CRLF".into());
                    }
                    self.take_meta(input, 2)?;
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    let Some(at) = memchr::memchr(b'\n', input) else {
                        return self.more(input);
                    };
                    let empty = at == 0 || (at == 1 && input[0] == b'\r');
                    self.take_meta(input, at + 1)?;
                    if empty {
                        self.state = ChunkState::Done;
                    }
                }
            }
        }
    }

    /// Whether the body has ended.
    pub fn done(&self) -> bool {
        self.state == ChunkState::Done
    }

    fn take_meta(&mut self, input: &mut BytesMut, n: usize) -> Result<(), String> {
        self.meta += n;
        meta_within_bound(self.meta)?;
        input.advance(n);
        Ok(())
    }

    fn more(&self, input: &BytesMut) -> Result<Step, String> {
        meta_within_bound(self.meta + input.len())?;
        Ok(Step::More)
    }
}

/// Refuses `meta` bytes of chunk sizes and trailers in a row past [`MAX_CHUNK_META`].
fn meta_within_bound(meta: usize) -> Result<(), String> {
    if meta > MAX_CHUNK_META {
        return Err(format!(
            "over {MAX_CHUNK_META} bytes of chunk sizes and trailers without data"
        ));
    }
    Ok(())
}

/// The connections for replies read whole, kept per server.
pub(crate) struct Direct {
    idle: Mutex<HashMap<String, Vec<(TcpStream, Instant)>>>,
    connect_timeout: Duration,
    read_timeout: Duration,
    max_idle: usize,
}

/// A reply whose head has come: its body is read with [`Reply::read_body`].
pub(crate) struct Reply<'d> {
    /// Its head.
    pub head: Head,
    direct: &'d Direct,
    key: String,
    stream: TcpStream,
    /// Bytes read past the head.
    pending: BytesMut,
}

impl Direct {
    /// Connections made within `connect_timeout`, replies that may stay silent for
    /// `read_timeout` at most, up to `max_idle` idle connections kept per server.
    pub fn new(connect_timeout: Duration, read_timeout: Duration, max_idle: usize) -> Self {
        Direct {
            idle: Mutex::new(HashMap::new()),
            connect_timeout,
            read_timeout,
            max_idle,
        }
    }

    /// POST `body` to `uri` with `headers`, and wait for the reply's head (within the read
    /// timeout, once sent). A kept connection that the server closed while it was idle (the
    /// request could not be written, or the connection closed before any byte of a reply) is
    /// replaced by a new one, once.
    pub async fn post(
        &self,
        uri: &Uri,
        headers: &[(&'static str, HeaderValue)],
        body: &Bytes,
    ) -> Result<Reply<'_>, CallError> {
        let authority = uri
            .authority()
            .map(|a| a.as_str().to_string())
            .ok_or_else(|| CallError::Connect(format!("no host in {uri}")))?;
        let key = match uri.port_u16() {
            Some(_) => authority.clone(),
            None => format!("{authority}:80"),
        };
        let mut head = Vec::with_capacity(256);
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        head.extend_from_slice(format!("POST {path} HTTP/1.1\r\nhost: {authority}\r\n").as_bytes());
        for (name, value) in headers {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
        if let Some(stream) = self.take_idle(&key) {
            match self.exchange(stream, &key, &head, body).await {
                Err(Attempt::Stale) => {} // closed while idle: once more on a new one
                Err(Attempt::Failed(e)) => return Err(e),
                Ok(reply) => return Ok(reply),
            }
        }
        let stream = self.connect(&key).await?;
        match self.exchange(stream, &key, &head, body).await {
            Ok(reply) => Ok(reply),
            Err(Attempt::Stale) => Err(CallError::Broken(
                "the connection closed before a reply".into(),
            )),
            Err(Attempt::Failed(e)) => Err(e),
        }
    }

    async fn connect(&self, key: &str) -> Result<TcpStream, CallError> {
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(key)).await
        {
            Err(_) => return Err(CallError::Connect("connect timeout".into())),
            Ok(Err(e)) => return Err(CallError::Connect(e.to_string())),
            Ok(Ok(s)) => s,
        };
        stream
            .set_nodelay(true)
            .map_err(|e| CallError::Connect(e.to_string()))?;
        Ok(stream)
    }

    /// The request written and the reply's head read; `Stale` when the connection was closed
    /// before any byte of a reply.
    async fn exchange(
        &self,
        mut stream: TcpStream,
        key: &str,
        head: &[u8],
        body: &[u8],
    ) -> Result<Reply<'_>, Attempt> {
        let write = async {
            stream.write_all(head).await?;
            stream.write_all(body).await
        };
        match tokio::time::timeout(self.read_timeout, write).await {
            Err(_) => return Err(Attempt::Failed(CallError::Timeout)),
            Ok(Err(_)) => return Err(Attempt::Stale),
            Ok(Ok(())) => {}
        }
        let mut buf = BytesMut::with_capacity(8 * 1024);
        let read_head = async {
            loop {
                if let Some((head, used)) = parse_head(&buf).map_err(CallError::Broken)? {
                    buf.advance(used);
                    if (100..200).contains(&head.status) {
                        continue; // an interim reply: the final one follows
                    }
                    return Ok(Some(head));
                }
                let read = stream.read_buf(&mut buf).await;
                match read {
                    Ok(0) | Err(_) if buf.is_empty() => return Ok(None),
                    Ok(0) => return Err(CallError::Broken("the reply's head was cut".into())),
                    Err(e) => return Err(CallError::Broken(e.to_string())),
                    Ok(_) => {}
                }
            }
        };
        match tokio::time::timeout(self.read_timeout, read_head).await {
            Err(_) => Err(Attempt::Failed(CallError::Timeout)),
            Ok(Err(e)) => Err(Attempt::Failed(e)),
            Ok(Ok(None)) => Err(Attempt::Stale),
            Ok(Ok(Some(head))) => Ok(Reply {
                head,
                direct: self,
                key: key.to_string(),
                stream,
                pending: buf,
            }),
        }
    }

    /// A kept connection to `key` that is still open and quiet, if any.
    fn take_idle(&self, key: &str) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(key)?;
        while let Some((stream, since)) = list.pop() {
            // Readable while idle means closed (or sending what nobody asked for): dropped.
            let mut probe = [0u8; 1];
            let quiet = matches!(stream.try_read(&mut probe),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            if quiet && since.elapsed() < IDLE_FOR {
                return Some(stream);
            }
        }
        None
    }

    fn keep(&self, key: String, stream: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(key).or_default();
        list.retain(|(_, since)| since.elapsed() < IDLE_FOR);
        if list.len() < self.max_idle {
            list.push((stream, Instant::now()));
        }
    }
}

/// Why one try on a connection gave no reply head.
enum Attempt {
    /// A kept connection the server had closed: tried again on a new one.
    Stale,
    /// The call failed.
    Failed(CallError),
}

impl Reply<'_> {
    /// The whole body, under the rules of hyper's side (`Upstreams::read_body`): refused past
    /// `limit` bytes, counted against the budget through `share` (a declared length before
    /// reading, with `set_aside` its reserve; else as it arrives), with `scan` its base64 runs
    /// found as it arrives. A body with a length is read straight into one buffer of that
    /// length.
    pub async fn read_body(
        mut self,
        limit: usize,
        share: &mut Share,
        (ceiling, set_aside): (usize, bool),
        deadline: tokio::time::Instant,
        scan: bool,
    ) -> Result<(Bytes, Option<Base64Runs>), CallError> {
        let mut runs = scan.then(Base64Runs::new);
        let read_timeout = self.direct.read_timeout;
        let body = match self.head.framing {
            Framing::Length(n) => {
                admit_declared(n, limit, share, (ceiling, set_aside), deadline).await?;
                let n = usize::try_from(n).map_err(|_| CallError::TooLarge(n, false))?;
                let mut out = BytesMut::with_capacity(n);
                let have = self.pending.len().min(n);
                out.extend_from_slice(&self.pending[..have]);
                if self.pending.len() > n {
                    self.head.keep_alive = false; // more than it declared: not reused
                }
                while out.len() < n {
                    if let Some(r) = runs.as_mut() {
                        r.extend(&out);
                    }
                    // At most a piece at a time: the scan of what came runs while it is in
                    // cache (a read of several megabytes left it cold: 16% of the proxy's CPU
                    // in the scan, against 7% at 256 KiB).
                    let want = (n - out.len()).min(READ_PIECE);
                    let mut read = (&mut out).limit(want);
                    match tokio::time::timeout(read_timeout, self.stream.read_buf(&mut read)).await
                    {
                        Err(_) => return Err(CallError::Timeout),
                        Ok(Err(e)) => return Err(CallError::Broken(e.to_string())),
                        Ok(Ok(0)) => {
                            return Err(CallError::Broken(format!(
                                "the connection closed {} bytes into a body of {n}",
                                out.len()
                            )))
                        }
                        Ok(Ok(_)) => {}
                    }
                }
                if let Some(r) = runs.as_mut() {
                    r.extend(&out);
                }
                out
            }
            Framing::Chunked | Framing::Close => {
                let mut out = BytesMut::new();
                let mut dechunk = (self.head.framing == Framing::Chunked).then(Dechunk::default);
                let mut input = std::mem::take(&mut self.pending);
                loop {
                    let piece = match dechunk.as_mut() {
                        Some(d) => match d.next(&mut input).map_err(CallError::Broken)? {
                            Step::Data(piece) => Some(piece),
                            Step::End => break,
                            Step::More => None,
                        },
                        None if !input.is_empty() => Some(input.split().freeze()),
                        None => None,
                    };
                    if let Some(piece) = piece {
                        let size = out.len() + piece.len();
                        if size > limit {
                            return Err(CallError::TooLarge(size as u64, true));
                        }
                        grow_undeclared(share, piece.len(), size, ceiling, deadline).await?;
                        out.extend_from_slice(&piece);
                        if let Some(r) = runs.as_mut() {
                            r.extend(&out);
                        }
                        continue;
                    }
                    input.reserve(READ_PIECE);
                    match tokio::time::timeout(read_timeout, self.stream.read_buf(&mut input)).await
                    {
                        Err(_) => return Err(CallError::Timeout),
                        Ok(Err(e)) => return Err(CallError::Broken(e.to_string())),
                        Ok(Ok(0)) if dechunk.is_none() => break,
                        Ok(Ok(0)) => {
                            return Err(CallError::Broken(
                                "the connection closed inside a chunked body".into(),
                            ))
                        }
                        Ok(Ok(_)) => {}
                    }
                }
                if !input.is_empty() {
                    self.head.keep_alive = false; // bytes after the body: not reused
                }
                out
            }
        };
        if self.head.keep_alive {
            self.direct.keep(self.key, self.stream);
        }
        Ok((body.freeze(), runs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<(Head, usize)>, String> {
        parse_head(text.as_bytes())
    }

    #[test]
    fn a_head_says_how_its_body_ends() {
        let text =
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\n\r\nhello";
        let (h, used) = head(text).unwrap().unwrap();
        assert_eq!(used, text.len() - 5);
        assert_eq!(
            (h.status, h.framing, h.keep_alive),
            (200, Framing::Length(5), true)
        );
        assert_eq!(h.content_type.unwrap(), "application/json");
        let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n";
        assert_eq!(head(chunked).unwrap().unwrap().0.framing, Framing::Chunked);
        // Chunked decides over a length, and such a connection is not reused.
        let both = "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n";
        let h = head(both).unwrap().unwrap().0;
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        let neither = "HTTP/1.1 200 OK\r\n\r\n";
        let h = head(neither).unwrap().unwrap().0;
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let closing = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
        assert!(!head(closing).unwrap().unwrap().0.keep_alive);
        let old = "HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert!(!head(old).unwrap().unwrap().0.keep_alive);
        let old_kept = "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n";
        assert!(head(old_kept).unwrap().unwrap().0.keep_alive);
        let none = "HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(head(none).unwrap().unwrap().0.framing, Framing::Length(0));
        assert_eq!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap(), None);
    }

    #[test]
    fn a_bad_head_is_refused_by_what_is_wrong() {
        for (text, says) in [
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 3, 4\r\n\r\n",
                "two different",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
                "two different",
            ),
            ("HTTP/1.1 200 OK\r\ncontent-length: -3\r\n\r\n", "no length"),
            ("HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\n", "no length"),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
                "no length",
            ),
            ("SMTP hello\r\n\r\n", "malformed"),
        ] {
            let err = head(text).unwrap_err();
            assert!(err.contains(says), "{text:?}: {err}");
        }
        // Equal repeats are one length.
        let same = "HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\n";
        assert_eq!(head(same).unwrap().unwrap().0.framing, Framing::Length(3));
        let long = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD_BYTES));
        assert!(head(&long).unwrap_err().contains("over"));
    }

    use crate::budget::Budget;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::net::TcpListener;

    /// A server that answers each connection's requests with `replies[conn][i]` (written in
    /// pieces of `piece` bytes), then closes it; the connections it accepted are counted. A
    /// `None` reply closes the connection once the request is read (a server that closed a
    /// kept connection just as the client sent on it).
    async fn scripted(replies: Vec<Vec<Option<Vec<u8>>>>, piece: usize) -> (Uri, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            for conn in replies {
                let (mut c, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    for reply in conn {
                        // The request: its head, then the body its length gives.
                        let mut got = Vec::new();
                        let mut buf = [0u8; 4096];
                        let body_at = loop {
                            let n = c.read(&mut buf).await.unwrap_or(0);
                            if n == 0 {
                                return; // the client went
                            }
                            got.extend_from_slice(&buf[..n]);
                            if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                                break at + 4;
                            }
                        };
                        let text = String::from_utf8_lossy(&got[..body_at]).to_lowercase();
                        let len: usize = text
                            .split("content-length: ")
                            .nth(1)
                            .and_then(|t| t.split("\r\n").next())
                            .unwrap()
                            .parse()
                            .unwrap();
                        while got.len() < body_at + len {
                            let n = c.read(&mut buf).await.unwrap();
                            got.extend_from_slice(&buf[..n]);
                        }
                        let Some(reply) = reply else { return };
                        for p in reply.chunks(piece) {
                            c.write_all(p).await.unwrap();
                            c.flush().await.unwrap();
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                });
            }
        });
        let uri = format!("http://127.0.0.1:{port}/v1/completions")
            .parse()
            .unwrap();
        (uri, accepted)
    }

    fn reply(body: &[u8]) -> Option<Vec<u8>> {
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        Some([head.as_bytes(), body].concat())
    }

    async fn get(
        direct: &Direct,
        uri: &Uri,
        limit: usize,
        scan: bool,
    ) -> Result<(Head, Bytes, Option<Base64Runs>), CallError> {
        let r = direct
            .post(
                uri,
                &[("x-request-id", HeaderValue::from_static("r1"))],
                &Bytes::from_static(b"{}"),
            )
            .await?;
        let head = r.head.clone();
        let mut share = Budget::new(1 << 30).share();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let (body, runs) = r
            .read_body(limit, &mut share, (1 << 30, false), deadline, scan)
            .await?;
        Ok((head, body, runs))
    }

    fn direct() -> Direct {
        Direct::new(Duration::from_secs(2), Duration::from_millis(500), 4)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_with_a_length_is_read_whole_in_pieces_and_its_runs_found() {
        let mut body = br#"{"choices":[{"index":0,"routed_experts":""#.to_vec();
        let start = body.len();
        body.extend((0..60_000).map(|i| b"k4/+"[i % 4]));
        body.extend_from_slice(br#""}],"usage":{"prompt_tokens":9}}"#);
        let (uri, _) = scripted(vec![vec![reply(&body)]], 10_000).await;
        let (head, got, runs) = get(&direct(), &uri, 1 << 30, true).await.unwrap();
        assert_eq!((head.status, got.as_ref()), (200, &body[..]));
        let runs = runs.unwrap();
        assert_eq!(runs.scanned(), body.len());
        assert_eq!(runs.run_from(start), Some(start + 60_000));
        // The walk takes it and reads what it reads without it; without `scan`, no runs.
        let with = routed_experts::body::read_prefill_scanned(&got, Some(&runs)).unwrap();
        let without = routed_experts::body::read_prefill(&got).unwrap();
        assert_eq!(format!("{with:?}"), format!("{without:?}"));
        assert!(with.routing.values[0].base64);
        let (uri, _) = scripted(vec![vec![reply(&body)]], 10_000).await;
        assert!(get(&direct(), &uri, 1 << 30, false)
            .await
            .unwrap()
            .2
            .is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_is_kept_and_one_the_server_closed_is_replaced() {
        // The first connection answers twice, then closes while idle: the third request goes
        // on a new connection, which closes as the fourth is sent on it: the fourth is sent
        // again on a third.
        let first = vec![reply(b"one"), reply(b"two")];
        let second = vec![reply(b"three"), None];
        let (uri, accepted) = scripted(vec![first, second, vec![reply(b"four")]], 1 << 20).await;
        let d = direct();
        for want in [&b"one"[..], b"two"] {
            assert_eq!(get(&d, &uri, 1 << 20, false).await.unwrap().1, want);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(50)).await; // the server has closed it
        assert_eq!(
            get(&d, &uri, 1 << 20, false).await.unwrap().1,
            &b"three"[..]
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(get(&d, &uri, 1 << 20, false).await.unwrap().1, &b"four"[..]);
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunked_and_close_delimited_bodies_are_read_and_only_the_first_kept() {
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x\r\nde\r\n0\r\n\r\n";
        let closing = b"HTTP/1.1 500 Oops\r\ncontent-type: text/plain\r\n\r\nno engine";
        let (uri, accepted) = scripted(
            vec![
                vec![Some(chunked.to_vec()), Some(closing.to_vec())],
                vec![reply(b"{}")],
            ],
            3,
        )
        .await;
        let d = direct();
        assert_eq!(
            get(&d, &uri, 1 << 20, false).await.unwrap().1,
            &b"abcde"[..]
        );
        let (head, body, _) = get(&d, &uri, 1 << 20, false).await.unwrap();
        assert_eq!((head.status, body.as_ref()), (500, &b"no engine"[..]));
        assert!(!head.keep_alive);
        assert_eq!(get(&d, &uri, 1 << 20, false).await.unwrap().1, &b"{}"[..]);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_interim_reply_is_skipped() {
        let both = [
            &b"HTTP/1.1 100 Continue\r\n\r\n"[..],
            &reply(b"ok").unwrap(),
        ]
        .concat();
        let (uri, _) = scripted(vec![vec![Some(both)]], 1 << 20).await;
        assert_eq!(
            get(&direct(), &uri, 1 << 20, false).await.unwrap().1,
            &b"ok"[..]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failures_are_named() {
        let d = direct();
        // Closed before any reply, on a new connection: broken, not retried.
        let (uri, accepted) = scripted(vec![vec![None], vec![reply(b"x")]], 1 << 20).await;
        let e = get(&d, &uri, 1 << 20, false).await.err().unwrap();
        assert!(
            matches!(e, CallError::Broken(ref w) if w.contains("before a reply")),
            "{e:?}"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // Cut inside its body.
        let cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this".to_vec();
        let (uri, _) = scripted(vec![vec![Some(cut)]], 1 << 20).await;
        let e = get(&d, &uri, 1 << 20, false).await.err().unwrap();
        assert!(
            matches!(e, CallError::Broken(ref w) if w.contains("9 bytes into a body of 100")),
            "{e:?}"
        );
        // Over the limit by its length, before it is read.
        let (uri, _) = scripted(vec![vec![reply(&[b'x'; 64])]], 1 << 20).await;
        let e = get(&d, &uri, 10, false).await.err().unwrap();
        assert!(matches!(e, CallError::TooLarge(64, false)), "{e:?}");
        // Over the limit as a chunked body arrives.
        let long = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n40\r\n".to_vec();
        let long = [long, vec![b'x'; 64], b"\r\n0\r\n\r\n".to_vec()].concat();
        let (uri, _) = scripted(vec![vec![Some(long)]], 1 << 20).await;
        let e = get(&d, &uri, 10, false).await.err().unwrap();
        assert!(matches!(e, CallError::TooLarge(64, true)), "{e:?}");
        // A malformed head.
        let (uri, _) = scripted(
            vec![vec![Some(b"HTTP/1.1 2x0 OK\r\n\r\n".to_vec())]],
            1 << 20,
        )
        .await;
        let e = get(&d, &uri, 10, false).await.err().unwrap();
        assert!(
            matches!(e, CallError::Broken(ref w) if w.contains("malformed")),
            "{e:?}"
        );
        // Silence past the read timeout.
        let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = silent.local_addr().unwrap().port();
        let uri: Uri = format!("http://127.0.0.1:{port}/").parse().unwrap();
        let e = get(&d, &uri, 10, false).await.err().unwrap();
        assert!(matches!(e, CallError::Timeout), "{e:?}");
        drop(silent);
        // Nothing listening.
        let e = get(&d, &uri, 10, false).await.err().unwrap();
        assert!(matches!(e, CallError::Connect(_)), "{e:?}");
    }

    /// `text` dechunked when fed `piece` bytes at a time: the body, and what followed it.
    fn dechunk(text: &[u8], piece: usize) -> Result<(Vec<u8>, Vec<u8>), String> {
        let mut d = Dechunk::default();
        let (mut input, mut out) = (BytesMut::new(), Vec::new());
        let mut rest = text;
        loop {
            match d.next(&mut input)? {
                Step::Data(b) => out.extend_from_slice(&b),
                Step::End => return Ok((out, input.to_vec())),
                Step::More if rest.is_empty() => return Err("cut".into()),
                Step::More => {
                    let n = piece.min(rest.len());
                    input.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
            }
        }
    }

    #[test]
    fn a_chunked_body_is_the_same_in_any_pieces() {
        let text =
            b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-t: 1\r\n\r\nNEXT";
        for piece in [1, 2, 3, 7, 100] {
            let (body, after) = dechunk(text, piece).unwrap();
            assert_eq!(body, b"helloabcdefghijklmnopqrstuvwxyz");
            assert!(b"NEXT".starts_with(&after), "{piece}: {after:?}");
        }
        assert_eq!(dechunk(b"0\r\n\r\n", 1).unwrap().0, b"");
        for (bad, says) in [
            (&b"zz\r\n"[..], "chunk size"),
            (b"3\r\nabcXY", "CRLF"),
            (b"3\r\nabc", "cut"),
            (b"ffffffffffffffffffff\r\n", "chunk size"),
        ] {
            let err = dechunk(bad, 2).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
        let endless = [&b"1;"[..], &b"x".repeat(MAX_CHUNK_META + 10)].concat();
        assert!(dechunk(&endless, 4096)
            .unwrap_err()
            .contains("without data"));
        let trailers = [&b"0\r\n"[..], &b"t: 1\r\n".repeat(MAX_CHUNK_META / 4)].concat();
        assert!(dechunk(&trailers, 4096)
            .unwrap_err()
            .contains("without data"));
    }
}
