//! The tests of `direct`.

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
    let chunked =
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x\r\nde\r\n0\r\n\r\n";
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
    let text = b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-t: 1\r\n\r\nNEXT";
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
