//! The proxy's data plane as Python sees it: bind, serve with the GIL released, stop.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Mutex;

use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;

use crate::errors::PyResult;

use pyo3::types::PyDict;

use routed_experts_proxy::config::{Unit, Value, SETTINGS, TEXT_SETTINGS};
use routed_experts_proxy::{Config, Server, Stop, Stopper};

use crate::errors::ConfigError;

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

/// One setting's value from Python, read as its declared unit says (a bool, a str or a
/// negative number is a `ConfigError` naming the setting).
fn setting_value(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Value> {
    let s =
        routed_experts_proxy::config::setting(name).map_err(|e| ConfigError::new_err(e.message))?;
    let wrong = || {
        ConfigError::new_err(format!(
            "{name}: expected {}, got {}",
            s.unit.name(),
            crate::convert::a_value_of(v)
        ))
    };
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(wrong().into());
    }
    Ok(match s.unit {
        Unit::Seconds => Value::Seconds(v.extract::<f64>().map_err(|_| wrong())?),
        Unit::Count | Unit::Bytes => {
            if v.is_instance_of::<pyo3::types::PyFloat>() {
                return Err(wrong().into());
            }
            let n = v.extract::<i128>().map_err(|_| wrong())?;
            let n = u64::try_from(n).map_err(|_| {
                let bound = if n < 0 {
                    format!("at least {}", s.minimum)
                } else {
                    "below 2**64".into()
                };
                ConfigError::new_err(format!("{name} must be {bound}, got {n}"))
            })?;
            Value::Whole(n)
        }
    })
}

/// The proxy's configuration from the settings Python gives (`ProxyConfig.settings()`), each
/// checked against its declaration (`routed_experts_proxy::config::SETTINGS`).
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
    apply(&mut c, settings)?;
    c.check().map_err(|e| ConfigError::new_err(e.message))?;
    Ok(c)
}

/// Each setting of `settings` (None: the default) set on `c`, as its declaration reads it.
fn apply(c: &mut Config, settings: &Bound<'_, PyDict>) -> PyResult<()> {
    for (key, value) in settings.iter() {
        let name: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        if TEXT_SETTINGS.iter().any(|(n, _, _)| *n == name) {
            let text = value.extract::<String>().map_err(|_| {
                let got = crate::convert::a_value_of(&value);
                ConfigError::new_err(format!("{name}: expected a str, got {got}"))
            })?;
            c.set_text(&name, &text)
                .map_err(|e| ConfigError::new_err(e.message))?;
            continue;
        }
        c.set(&name, setting_value(&name, &value)?)
            .map_err(|e| ConfigError::new_err(e.message))?;
    }
    Ok(())
}

/// Every proxy setting as declared once in Rust: (name, unit, default, minimum, help), in the
/// order the command lists them. What `ProxyConfig`, the command's flags and docs/proxy.md's table
/// are checked against or made from.
#[pyfunction]
pub fn _proxy_settings() -> Vec<(&'static str, &'static str, u64, u64, &'static str)> {
    SETTINGS
        .iter()
        .map(|s| (s.name, s.unit.name(), s.default, s.minimum, s.help))
        .collect()
}

/// The proxy settings that take text, as declared in Rust: (name, default or None, help).
#[pyfunction]
pub fn _proxy_text_settings() -> Vec<(&'static str, Option<&'static str>, &'static str)> {
    TEXT_SETTINGS.to_vec()
}

/// The text settings that take one of a few names, with those names as Rust declares them
/// (the policies, `routing_format`, `stream_routing`, `prompt_routing`, `vllm_plugin`): the
/// command's choices.
#[pyfunction]
pub fn _proxy_choices() -> Vec<(&'static str, Vec<&'static str>)> {
    use routed_experts_proxy::config::{PromptRouting, RoutingFormat, StreamRouting, VllmPlugin};
    use routed_experts_proxy::Policy;
    let policies: Vec<&'static str> = Policy::ALL.iter().map(|p| p.name()).collect();
    vec![
        ("prefill_policy", policies.clone()),
        ("decode_policy", policies),
        (
            "routing_format",
            RoutingFormat::ALL.iter().map(|f| f.name()).collect(),
        ),
        (
            "stream_routing",
            StreamRouting::ALL.iter().map(|f| f.name()).collect(),
        ),
        (
            "prompt_routing",
            PromptRouting::ALL.iter().map(|f| f.name()).collect(),
        ),
        (
            "vllm_plugin",
            VllmPlugin::ALL.iter().map(|f| f.name()).collect(),
        ),
    ]
}

/// The protocol's constants as the Rust data plane holds them: (the endpoints' paths, the
/// request-id header, the prefill request's `kv_transfer_params` as JSON text).
#[pyfunction]
pub fn _proxy_protocol() -> (Vec<&'static str>, &'static str, &'static str) {
    use routed_experts_proxy::{Api, PREFILL_KV_TRANSFER_PARAMS, REQUEST_ID};
    let paths = Api::PATHS.iter().map(|(path, _)| *path).collect();
    (paths, REQUEST_ID, PREFILL_KV_TRANSFER_PARAMS)
}

/// Check proxy settings (a dict of `ProxyConfig`'s fields) without starting a server: a
/// `ConfigError` names the first that cannot serve.
#[pyfunction]
pub fn _check_proxy_settings(settings: &Bound<'_, PyDict>) -> PyResult<()> {
    apply(&mut Config::default(), settings)
}

#[pymethods]
impl _ProxyServer {
    #[new]
    #[pyo3(signature = (prefill, decode, host, port, settings, admin_port = None))]
    fn new(
        prefill: Vec<String>,
        decode: Vec<String>,
        host: &str,
        #[pyo3(from_py_with = crate::convert::arg::port)] port: u16,
        settings: &Bound<'_, PyDict>,
        #[pyo3(from_py_with = crate::convert::opt::admin_port)] admin_port: Option<u16>,
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
                StreamError::NoDone => routed_experts::Error::inconsistent(
                    "the decode stream ended without data: [DONE]",
                )
                .into(),
                StreamError::LineTooLong(n) => routed_experts::Error::malformed(format!(
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
            ..routed_experts::MergeOptions::new(crate::limits::max_bytes())
        };
        let max_line = max_line_bytes.unwrap_or_else(crate::limits::max_bytes);
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

    /// Bytes of the merged events' data (after `data:`, through the end of each one's line).
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
