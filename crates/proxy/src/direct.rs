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
mod tests;
