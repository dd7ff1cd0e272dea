//! A client connection's socket as hyper reads and writes it, with a write timeout.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use hyper::rt::{Read, ReadBufCursor, Write};
use tokio::net::TcpStream;

/// A client socket as hyper reads and writes it. Shared (`Arc`), so the server can still
/// answer 408 after hyper gives up on a head; a write that cannot proceed for `write_timeout`
/// fails the connection (a client that stopped reading cannot hold a reply in memory).
pub(crate) struct ConnIo {
    stream: Arc<TcpStream>,
    write_timeout: Duration,
    write_stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl ConnIo {
    pub(crate) fn new(stream: Arc<TcpStream>, write_timeout: Duration) -> Self {
        ConnIo {
            stream,
            write_timeout,
            write_stalled: None,
        }
    }

    /// Called when the socket is not writable: arm the stall timer, or fail once it fired.
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let timeout = self.write_timeout;
        let timer = self
            .write_stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read the response in time",
            )));
        }
        Poll::Pending
    }

    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        write: impl Fn(&TcpStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            match self.stream.poll_write_ready(cx) {
                Poll::Pending => return self.stalled(cx),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            match write(&self.stream) {
                Ok(n) => {
                    self.write_stalled = None;
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl Read for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            // SAFETY: `try_read_buf` writes initialised bytes only into the front of `dst` and
            // returns how many; the cursor is advanced by exactly that many, so every byte it
            // reports as filled was written. Nothing else aliases the cursor meanwhile.
            let result = unsafe {
                let mut dst = buf.as_mut();
                self.stream.try_read_buf(&mut dst)
            };
            match result {
                Ok(n) => {
                    // SAFETY: as above, `n` bytes at the front of the cursor were written.
                    unsafe { buf.advance(n) };
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl Write for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_with(cx, |s| s.try_write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |s| s.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        shutdown_write(&self.stream);
        Poll::Ready(Ok(()))
    }
}

/// Close the writing half of a client socket: the client reads the end of what was sent.
pub(crate) fn shutdown_write(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor belongs to `stream`, which is alive for this call; shutdown(2)
    // only changes the socket's state and touches no memory.
    unsafe {
        libc::shutdown(stream.as_raw_fd(), libc::SHUT_WR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn shutting_the_write_half_ends_what_the_peer_reads_and_keeps_reading_open() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        server.try_write(b"bye").unwrap();
        shutdown_write(&server);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap(); // ends: the proxy's side closed writing
        assert_eq!(got, b"bye");
        // The proxy's side can still read what the client sends.
        tokio::io::AsyncWriteExt::write_all(&mut client, b"more")
            .await
            .unwrap();
        server.readable().await.unwrap();
        let mut buf = [0u8; 8];
        let n = server.try_read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"more");
    }
}
