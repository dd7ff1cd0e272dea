//! The proxy's data plane as Python sees it: bind, serve with the GIL released, stop.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::errors::PyResult;

use pyo3::types::PyDict;

use routed_experts_proxy::{Config, Server, Stop, Stopper};

/// The Rust data plane of the P/D proxy, bound to its address and ready to serve.
///
/// `settings` holds `ProxyConfig`'s fields (seconds as numbers, limits as integers, None for
/// "not set"). Binding happens here, so port 0 picks a free port that `port` then tells.
/// `serve()` blocks (GIL released) until `stop()` is called from another thread, or, with
/// `signals=True`, until SIGTERM or SIGINT (a second one stops at once).
#[pyclass(module = "routed_experts._core", frozen)]
pub struct _ProxyServer {
    server: Mutex<Option<Server>>,
    stopper: Stopper,
    addr: SocketAddr,
    admin: Option<SocketAddr>,
}

fn resolve(host: &str, port: u16) -> PyResult<SocketAddr> {
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| PyOSError::new_err(format!("cannot resolve {host}:{port}: {e}")))?;
    Ok(addrs
        .next()
        .ok_or_else(|| PyOSError::new_err(format!("{host}:{port} resolves to no address")))?)
}

fn seconds(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let s: f64 = v.extract()?;
    Ok(Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!("{name} must be a positive number of seconds"))
        })?)
}

fn config(
    prefill: Vec<String>,
    decode: Vec<String>,
    settings: &Bound<'_, PyDict>,
) -> PyResult<Config> {
    let mut c = Config {
        prefill,
        decode,
        ..Config::default()
    };
    for (key, value) in settings.iter() {
        let name: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        let v = &value;
        match name.as_str() {
            "read_timeout" => c.read_timeout = seconds(&name, v)?,
            "connect_timeout" => c.connect_timeout = seconds(&name, v)?,
            "body_timeout" => c.body_timeout = seconds(&name, v)?,
            "eject_seconds" => c.eject_seconds = seconds(&name, v)?,
            "header_timeout" => c.header_timeout = seconds(&name, v)?,
            "request_timeout" => c.request_timeout = seconds(&name, v)?,
            "write_timeout" => c.write_timeout = seconds(&name, v)?,
            "shutdown_timeout" => c.shutdown_timeout = seconds(&name, v)?,
            "max_in_flight" => c.max_in_flight = v.extract()?,
            "max_request_bytes" => c.max_request_bytes = v.extract()?,
            "max_buffered_bytes" => c.max_buffered_bytes = v.extract()?,
            "max_upstream_bytes" => c.max_upstream_bytes = v.extract()?,
            "eject_after" => c.eject_after = v.extract()?,
            "max_header_bytes" => c.max_header_bytes = v.extract()?,
            "max_connections" => c.max_connections = v.extract()?,
            "upstream_api_key" => c.upstream_api_key = Some(v.extract()?),
            other => {
                return Err(PyTypeError::new_err(format!("unknown proxy setting {other:?}")).into())
            }
        }
    }
    c.check().map_err(PyValueError::new_err)?;
    Ok(c)
}

#[pymethods]
impl _ProxyServer {
    #[new]
    #[pyo3(signature = (prefill, decode, host, port, settings, admin_port = None))]
    fn new(
        prefill: Vec<String>,
        decode: Vec<String>,
        host: &str,
        port: u16,
        settings: &Bound<'_, PyDict>,
        admin_port: Option<u16>,
    ) -> PyResult<Self> {
        let config = config(prefill, decode, settings)?;
        let addr = resolve(host, port)?;
        let admin = admin_port.map(|p| resolve(host, p)).transpose()?;
        let server = Server::bind(config, addr, admin)
            .map_err(|e| PyOSError::new_err(format!("cannot listen on {addr}: {e}")))?;
        Ok(_ProxyServer {
            addr: server.local_addr().map_err(PyErr::from)?,
            admin: server.admin_addr(),
            stopper: server.stopper(),
            server: Mutex::new(Some(server)),
        })
    }

    /// The port it listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The admin port (`/health`, `/metrics`), or None when they are served on `port`.
    #[getter]
    fn admin_port(&self) -> Option<u16> {
        self.admin.map(|a| a.port())
    }

    /// Serve until stopped (GIL released). Once only.
    #[pyo3(signature = (signals = false))]
    fn serve(&self, py: Python<'_>, signals: bool) -> PyResult<()> {
        let server = self
            .server
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the proxy server's lock is poisoned"))?
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this proxy server has already served"))?;
        py.detach(|| server.run(signals))
            .map_err(|e| PyOSError::new_err(format!("the proxy stopped: {e}")).into())
    }

    /// Stop serving: drain requests under way (up to the shutdown timeout), or at once with
    /// `now=True`. Safe from any thread, before or during `serve`.
    #[pyo3(signature = (now = false))]
    fn stop(&self, now: bool) {
        self.stopper
            .stop(if now { Stop::Now } else { Stop::Graceful });
    }
}

/// Merges the routing of server-sent events from a decode server with the prefill routing:
/// the proxy's stream merge (the Rust one), for a router of your own.
///
/// Feed it the decode stream's bytes as they arrive (`feed`), then call `finish`: what they
/// return is the stream to send on, with every event that carries `routed_experts` merged and
/// every other byte as it came. `start` is the requested prompt start (for formats that carry
/// none). Raises MergeError when routing cannot be merged, when the stream ended without
/// `data: [DONE]`, or when no event carried routing while the prefill body did; a line (one
/// event) longer than `max_line_bytes` (default: `get_max_bytes()`) is a PayloadError.
#[pyclass(module = "routed_experts._core", frozen)]
pub struct StreamMerger {
    inner: Mutex<routed_experts_proxy::StreamMerger<'static>>,
}

impl StreamMerger {
    fn run(
        &self,
        py: Python<'_>,
        step: impl FnOnce(
                &mut routed_experts_proxy::StreamMerger<'static>,
                &mut Vec<bytes::Bytes>,
            ) -> Result<(), routed_experts_proxy::StreamError>
            + Send,
    ) -> PyResult<Vec<Py<pyo3::types::PyBytes>>> {
        use routed_experts_proxy::StreamError;
        let out = py.detach(|| {
            let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let mut out = Vec::new();
            step(&mut m, &mut out).map(|()| out)
        });
        let out = out.map_err(|e| -> crate::errors::Failure {
            match e {
                StreamError::NoDone => {
                    routed_experts::Error::merge("the decode stream ended without data: [DONE]")
                        .into()
                }
                StreamError::LineTooLong(n) => routed_experts::Error::payload(format!(
                    "decode stream: a line of more than {n} bytes (the limit on one event)"
                ))
                .into(),
                StreamError::Merge(e) => e.into(),
            }
        })?;
        Ok(out
            .iter()
            .map(|b| pyo3::types::PyBytes::new(py, b).unbind())
            .collect())
    }

    fn read<T>(&self, f: impl FnOnce(&routed_experts_proxy::StreamMerger<'static>) -> T) -> T {
        f(&self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[pymethods]
impl StreamMerger {
    #[new]
    #[pyo3(signature = (prefill_body, start = None, max_line_bytes = None))]
    fn new(
        prefill_body: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = crate::convert::opt::start)] start: Option<u64>,
        #[pyo3(from_py_with = crate::convert::opt::max_line_bytes)] max_line_bytes: Option<usize>,
    ) -> PyResult<Self> {
        let prefill =
            bytes::Bytes::copy_from_slice(&super::convert::body_arg(prefill_body, "prefill_body")?);
        let opts = routed_experts::MergeOptions {
            hints: routed_experts::Hints {
                start,
                ..routed_experts::Hints::default()
            },
            ..routed_experts::MergeOptions::new(crate::max_bytes())
        };
        let max_line = max_line_bytes.unwrap_or_else(crate::max_bytes);
        Ok(StreamMerger {
            inner: Mutex::new(routed_experts_proxy::StreamMerger::owned(
                prefill, opts, max_line,
            )),
        })
    }

    /// The pieces to send on for the lines this chunk completes (routing merged).
    fn feed(
        &self,
        py: Python<'_>,
        chunk: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<pyo3::types::PyBytes>>> {
        let chunk = bytes::Bytes::copy_from_slice(&super::convert::body_arg(chunk, "chunk")?);
        self.run(py, |m, out| m.feed(chunk, out))
    }

    /// One whole line of the stream, as pieces: merged if it is a `data:` event that carries
    /// routing, else as it came.
    fn line(
        &self,
        py: Python<'_>,
        line: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<pyo3::types::PyBytes>>> {
        let line = bytes::Bytes::copy_from_slice(&super::convert::body_arg(line, "line")?);
        self.run(py, |m, out| m.line(line, out))
    }

    /// The rest of the stream (a last line without a newline); then the checks above.
    fn finish(&self, py: Python<'_>) -> PyResult<Vec<Py<pyo3::types::PyBytes>>> {
        self.run(py, |m, out| m.finish(out))
    }

    /// Some event carried routing (and was merged).
    #[getter]
    fn merged(&self) -> bool {
        self.read(|m| m.merged)
    }

    /// The stream's `data: [DONE]` was seen.
    #[getter]
    fn done(&self) -> bool {
        self.read(|m| m.done())
    }

    /// Bytes of the merged events.
    #[getter]
    fn merged_bytes(&self) -> usize {
        self.read(|m| m.merged_bytes)
    }

    /// Bytes of an incomplete line held back until its end arrives.
    #[getter]
    fn buffered(&self) -> usize {
        self.read(|m| m.buffered())
    }
}
