//! The HTTP/1.1 server in front: listeners, connection limits and timeouts, exact routes, and
//! shutdown. Each accepted connection is served by hyper with a header read timeout and a
//! header size limit; its socket is wrapped so a write that waits too long (a client that
//! stopped reading) ends the connection, and a head that never arrives is answered with 408.

use std::convert::Infallible;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioTimer;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::config::Config;
use super::conn_io::{shutdown_write, ConnIo};
use super::fault::Blame;
use super::fault::Fault;
use super::membership::reload_upstreams_file;
use super::memory::{give_back_memory, map_large_buffers};
use super::proxy::Proxy;
use super::routes::{route, Routes};

/// How a running server is asked to stop: `Graceful` drains (within the shutdown timeout),
/// `Now` stops at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stop {
    /// Serving.
    Running,
    /// Stop accepting; let requests under way finish within the shutdown timeout.
    Graceful,
    /// Stop at once.
    Now,
}

/// A handle that stops a [`Server`] from any thread.
#[derive(Clone)]
pub struct Stopper(Arc<watch::Sender<Stop>>);

impl Stopper {
    /// Ask for `how`; a second graceful request becomes `Now` (what a second signal does).
    pub fn stop(&self, how: Stop) {
        self.0.send_modify(|s| {
            *s = if *s >= Stop::Graceful && how == Stop::Graceful {
                Stop::Now
            } else {
                (*s).max(how)
            }
        });
    }
}

/// The proxy bound to its addresses, ready to run.
pub struct Server {
    listener: StdListener,
    admin: Option<StdListener>,
    proxy: Arc<Proxy>,
    stop: Arc<watch::Sender<Stop>>,
    workers: usize,
}

/// Client connections are counted here; a new one past the cap is answered and closed.
struct Gate {
    open: AtomicUsize,
    max: usize,
    last_logged: AtomicU64, // seconds since start of the last "cap reached" line
    started: Instant,
}

/// The admin port's own connection cap: scrapers and health checks, not clients, so a flood of
/// the main port never takes `/health` with it, nor the other way round.
const ADMIN_CONNECTIONS: usize = 64;

impl Gate {
    fn new(max: usize) -> Arc<Self> {
        Arc::new(Gate {
            open: AtomicUsize::new(0),
            max,
            last_logged: AtomicU64::new(u64::MAX),
            started: Instant::now(),
        })
    }
}

impl Server {
    /// Check `config` and bind `addr` (and `admin`, which then alone serves `/health` and
    /// `/metrics`). Port 0 picks a free port ([`local_addr`](Self::local_addr) says which).
    pub fn bind(config: Config, addr: SocketAddr, admin: Option<SocketAddr>) -> io::Result<Self> {
        let proxy =
            Proxy::new(config).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listener = bind(addr)?;
        let admin = admin.map(bind).transpose()?;
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        Ok(Server {
            listener,
            admin,
            proxy: Arc::new(proxy),
            stop: Arc::new(watch::channel(Stop::Running).0),
            workers,
        })
    }

    /// The address the proxy serves on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The admin address, when there is one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// A handle to stop the server from another thread.
    pub fn stopper(&self) -> Stopper {
        Stopper(Arc::clone(&self.stop))
    }

    /// Serve until stopped (by [`Stopper::stop`], or SIGTERM/SIGINT when `signals`): a first
    /// stop drains requests under way for up to the shutdown timeout, then cancels their
    /// upstream calls and closes their connections; a second one stops at once.
    pub fn run(self, signals: bool) -> io::Result<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.workers)
            .thread_name("routed-experts-proxy")
            .enable_all()
            .build()?;
        let result = runtime.block_on(self.serve(signals));
        // Tasks still running (streams past the shutdown timeout) are dropped here: their
        // upstream connections close.
        runtime.shutdown_timeout(Duration::from_secs(1));
        result
    }

    async fn serve(self, signals: bool) -> io::Result<()> {
        let Server {
            listener,
            admin,
            proxy,
            stop,
            ..
        } = self;
        raise_file_limit();
        map_large_buffers();
        let listener = TcpListener::from_std(listener)?;
        let admin = admin.map(TcpListener::from_std).transpose()?;
        let gate = Gate::new(proxy.config.max_connections);
        let graceful = GracefulShutdown::new();
        if signals {
            tokio::spawn(forward_signals(
                Stopper(Arc::clone(&stop)),
                Arc::clone(&proxy),
            ));
        }
        tokio::spawn(give_back_memory(Arc::clone(&proxy)));
        Arc::clone(&proxy).probe_at_start();
        let mut stopped = stop.subscribe();
        let admin_on = admin.is_some();
        let accept_main = accept_loop(
            listener,
            Arc::clone(&proxy),
            Arc::clone(&gate),
            &graceful,
            if admin_on {
                Routes::Service
            } else {
                Routes::All
            },
            stop.subscribe(),
        );
        let accept_admin = async {
            if let Some(admin) = admin {
                accept_loop(
                    admin,
                    Arc::clone(&proxy),
                    Gate::new(ADMIN_CONNECTIONS),
                    &graceful,
                    Routes::Admin,
                    stop.subscribe(),
                )
                .await;
            }
        };
        tokio::join!(accept_main, accept_admin);
        if *stopped.borrow_and_update() == Stop::Now {
            log::warn!(target: "routed_experts::proxy", "stopping at once");
            return Ok(());
        }
        let wait = proxy.config.shutdown_timeout;
        log::info!(target: "routed_experts::proxy",
            "shutting down: {} requests under way get up to {} s",
            proxy.in_flight.load(Ordering::Relaxed), wait.as_secs_f64());
        tokio::select! {
            _ = graceful.shutdown() => {
                log::info!(target: "routed_experts::proxy", "shutdown complete: every request finished");
            }
            _ = tokio::time::sleep(wait) => {
                log::warn!(target: "routed_experts::proxy",
                    "shutdown timeout: cancelling {} requests under way",
                    proxy.in_flight.load(Ordering::Relaxed));
            }
            _ = stopped.wait_for(|s| *s == Stop::Now) => {
                log::warn!(target: "routed_experts::proxy", "stopping at once");
            }
        }
        Ok(())
    }
}

fn bind(addr: SocketAddr) -> io::Result<StdListener> {
    let l = StdListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

async fn accept_loop(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    gate: Arc<Gate>,
    graceful: &GracefulShutdown,
    routes: Routes,
    mut stop: watch::Receiver<Stop>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s != Stop::Running) => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors or memory: wait instead of spinning.
                log::warn!(target: "routed_experts::proxy", "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        if gate.open.load(Ordering::Relaxed) >= gate.max {
            refuse_connection(&proxy, &gate, stream);
            continue;
        }
        gate.open.fetch_add(1, Ordering::Relaxed);
        proxy.metrics.connections(1);
        let stream = Arc::new(stream);
        let served = Arc::new(AtomicUsize::new(0));
        let io = ConnIo::new(Arc::clone(&stream), proxy.config.write_timeout);
        let svc = {
            let (proxy, served) = (Arc::clone(&proxy), Arc::clone(&served));
            service_fn(move |req| {
                served.fetch_add(1, Ordering::Relaxed);
                let proxy = Arc::clone(&proxy);
                async move { Ok::<_, Infallible>(route(proxy, req, routes).await) }
            })
        };
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(proxy.config.header_timeout)
            .max_buf_size(
                proxy
                    .config
                    .max_header_bytes
                    .max(super::config::MIN_HEADER_BYTES),
            )
            .serve_connection(io, svc);
        let conn = graceful.watch(conn);
        let (proxy, gate) = (Arc::clone(&proxy), Arc::clone(&gate));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                // A head that did not arrive in time on a connection that has not been served
                // yet (slow or silent clients): 408, then close. An idle keep-alive connection
                // is closed without a reply.
                if e.is_timeout() && served.load(Ordering::Relaxed) == 0 {
                    proxy.metrics.rejected("header_timeout");
                    let t = proxy.config.header_timeout.as_secs_f64();
                    let f = Fault::new(
                        Blame::Client,
                        408,
                        format!("the request head did not arrive within {t} s"),
                    );
                    write_raw(&stream, &f, "Request Timeout").await;
                }
            }
            gate.open.fetch_sub(1, Ordering::Relaxed);
            proxy.metrics.connections(-1);
        });
    }
}

/// A connection past the cap: answered with 503 and closed, logged at most once a second.
fn refuse_connection(proxy: &Arc<Proxy>, gate: &Gate, stream: TcpStream) {
    proxy.metrics.rejected("connections");
    let now = gate.started.elapsed().as_secs();
    if gate.last_logged.swap(now, Ordering::Relaxed) != now {
        log::warn!(target: "routed_experts::proxy",
            "connection cap reached: {} client connections open (--max-connections); new ones get 503",
            gate.max);
    }
    let f = Fault::new(
        Blame::Proxy,
        503,
        format!("the proxy has its limit of {} connections open", gate.max),
    )
    .retry_after(1);
    tokio::spawn(async move {
        let stream = Arc::new(stream);
        write_raw(&stream, &f, "Service Unavailable").await;
    });
}

/// Write a whole error response straight to the socket (outside hyper), then close: bounded
/// to a second, for clients that do not read.
async fn write_raw(stream: &TcpStream, fault: &Fault, reason: &str) {
    let body = fault.body();
    let mut head = format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n",
        fault.status,
        body.len()
    );
    if let Some(s) = fault.retry_after {
        head.push_str(&format!("retry-after: {s}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(&body);
    let write = async {
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            stream.writable().await?;
            match stream.try_write(rest) {
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        io::Result::Ok(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
    shutdown_write(stream);
}

/// SIGTERM or SIGINT: a graceful stop; a second one: stop at once. SIGHUP: the upstreams file
/// re-read.
async fn forward_signals(stopper: Stopper, proxy: Arc<Proxy>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        log::warn!(target: "routed_experts::proxy", "cannot listen for signals");
        return;
    };
    loop {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = hup.recv() => {
                reload(&proxy);
                continue;
            }
        };
        log::info!(target: "routed_experts::proxy", "{name} received");
        stopper.stop(Stop::Graceful);
    }
}

/// SIGHUP: the upstreams file re-read, what changed logged.
fn reload(proxy: &Proxy) {
    match reload_upstreams_file(proxy) {
        Ok(None) => log::warn!(target: "routed_experts::proxy",
            "SIGHUP: no upstreams file to re-read (--upstreams-file)"),
        Ok(Some(changes)) => {
            for (side, c) in ["prefill", "decode"].iter().zip(&changes) {
                log::warn!(target: "routed_experts::proxy",
                    "SIGHUP: {side} servers re-read: added {:?}, removed {:?}", c.added, c.removed);
            }
        }
        Err(e) => {
            log::error!(target: "routed_experts::proxy", "SIGHUP: {e}; the lists are unchanged")
        }
    }
}

/// Raise the soft limit on open files to the hard limit, so the connection cap (not the
/// descriptor limit) is what a flood meets.
fn raise_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for getrlimit, and a valid one for setrlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{status, unreachable_config, Running};

    #[test]
    fn a_second_graceful_stop_is_a_stop_now() {
        let stopper = Stopper(Arc::new(watch::channel(Stop::Running).0));
        stopper.stop(Stop::Graceful);
        assert_eq!(*stopper.0.borrow(), Stop::Graceful);
        stopper.stop(Stop::Graceful);
        assert_eq!(*stopper.0.borrow(), Stop::Now);
        stopper.stop(Stop::Running); // never back to running
        assert_eq!(*stopper.0.borrow(), Stop::Now);
    }

    #[test]
    fn it_serves_on_the_port_it_says_until_stopped_and_the_admin_port_alone_serves_health() {
        let proxy = Running::start(unreachable_config(), true);
        let (addr, admin) = (proxy.addr, proxy.admin.unwrap());
        assert!(
            status(admin, "GET", "/health").contains(" 200"),
            "the admin port serves /health"
        );
        assert!(
            status(addr, "GET", "/health").contains(" 404"),
            "the main port leaves it to the admin"
        );
        assert!(status(addr, "GET", "/nowhere").contains(" 404"));
        proxy.stop(Stop::Graceful).unwrap();
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "still listening after a stop"
        );
    }

    #[test]
    fn a_config_that_cannot_serve_is_refused_at_bind() {
        let mut bad = unreachable_config();
        bad.decode.clear();
        let any = "127.0.0.1:0".parse().unwrap();
        let e = Server::bind(bad, any, None).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
