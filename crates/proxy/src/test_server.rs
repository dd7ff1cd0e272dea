//! For the unit tests: a proxy serving on free ports in a thread of its own, and raw HTTP/1.1
//! exchanges with it (what a client's bytes get back, with no client library in between).

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use crate::config::Config;
use crate::server::{Server, Stop, Stopper};

/// A config whose servers are never reached (the discard port): enough to bind and answer what
/// needs no upstream.
pub fn unreachable_config() -> Config {
    Config {
        prefill: vec!["http://127.0.0.1:9".into()],
        decode: vec!["http://127.0.0.1:9".into()],
        ..Config::default()
    }
}

/// A proxy running until [`stop`](Running::stop).
pub struct Running {
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    stopper: Stopper,
    thread: std::thread::JoinHandle<io::Result<()>>,
}

impl Running {
    /// `config` served on a free port (and a free admin port when `admin`).
    pub fn start(config: Config, admin: bool) -> Running {
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = Server::bind(config, any, admin.then_some(any)).unwrap();
        let (addr, admin) = (server.local_addr().unwrap(), server.admin_addr());
        let stopper = server.stopper();
        let thread = std::thread::spawn(move || server.run(false));
        Running {
            addr,
            admin,
            stopper,
            thread,
        }
    }

    /// Stop as `how` asks, and what the server's run returned.
    pub fn stop(self, how: Stop) -> io::Result<()> {
        self.stopper.stop(how);
        self.thread.join().unwrap()
    }
}

/// `request` written to `addr` as it is, and everything read back until the server closes.
pub fn exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The status line of a `method path` request with no body.
pub fn status(addr: SocketAddr, method: &str, path: &str) -> String {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    );
    let out = exchange(addr, request.as_bytes());
    out.lines().next().unwrap_or_default().to_string()
}
