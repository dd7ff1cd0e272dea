//! A prefill/decode (P/D) proxy that merges routed experts: vLLM's disaggregated-serving
//! protocol in front of prefill and decode servers, every response's routing merged by absolute
//! position (format.md §4), on tokio and hyper. `routed-experts proxy` runs it; a Rust router
//! can run it too:
//!
//! ```no_run
//! use routed_experts_proxy::{Config, Server};
//!
//! let config = Config {
//!     prefill: vec!["http://10.0.0.1:8100".into()],
//!     decode: vec!["http://10.0.0.2:8200".into()],
//!     ..Config::default()
//! };
//! let server = Server::bind(config, "0.0.0.0:8000".parse().unwrap(), None)?;
//! server.run(true)?; // until SIGTERM: drain, then exit
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! What it guards against, with the defaults of [`Config`]: heads that arrive slowly or never
//! (408), heads too large (431), too many connections (503, logged), bodies too large (413) or
//! too slow (408), too many requests (503), more bytes held in bodies than the budget (503),
//! upstreams that stay silent (504), fail (502, passive health checks) or answer too much
//! (502), clients that stop reading (the connection is closed), requests and streams that never
//! end (504 or a last error event).

mod answer;
mod blocking;
mod budget;
mod buffered_stream;
mod call;
pub mod config;
mod config_error;
mod conn_io;
pub mod direct;
mod fault;
mod inbound;
mod membership;
mod memory;
mod metrics;
mod parts;
mod policy;
mod pool;
mod process;
mod proxy;
mod record;
mod relay;
mod request;
mod responses;
mod routes;
mod server;
mod stream_merger;
#[cfg(test)]
mod test_server;
mod upstream;

pub use config::Config;
pub use fault::{error_body, Blame, Fault};
pub use policy::{Policy, SESSION_LOAD_FACTOR};
pub use pool::{Changed, Side};
pub use request::{
    decode_start, Api, ClientBody, MAX_DEPTH, PREFILL_KV_TRANSFER_PARAMS, REQUEST_ID, STEERING,
};
pub use server::{Server, Stop, Stopper};
pub use stream_merger::{StreamError, StreamMerger};
