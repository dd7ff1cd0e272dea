//! The Python extension `routed_experts._core`: conversions between Python objects and the
//! core (`routed_experts`) and the proxy (`routed_experts_proxy`), nothing more. The hot paths
//! run in those crates with the GIL released; what is here reads arguments, builds numpy arrays
//! and bytes without a second copy, and turns the core's errors into Python's.

// `with_element!` instantiates generic code for every dtype; in the int64 arm `.into()` to i64
// is the identity, which is what the generic code means.
#![allow(clippy::useless_conversion)]
// PyO3's generated wrappers are the documentation Python sees (`__doc__`), not rustdoc.
#![allow(missing_docs)]

pub mod body_reader;
pub mod bytes_out;
pub mod convert;
pub mod errors;
pub mod functions;
pub mod limits;
pub mod numpy_out;
pub mod payload;
pub mod proxy;
pub mod quality;
pub mod replay;
pub mod trajectory;

#[pyo3::pymodule]
mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use crate::body_reader::BodyReader;
    #[pymodule_export]
    use crate::errors::{ConfigError, MergeError, PayloadError, RoutedExpertsError};
    #[pymodule_export]
    use crate::functions::{
        _sniff, decode, detect_format, encode, from_response, group_from_response, merge,
        merge_response, pack, pack_shard, shard,
    };
    #[pymodule_export]
    use crate::limits::{get_max_bytes, set_max_bytes};
    #[pymodule_export]
    use crate::payload::{_from_raw, RoutedExperts};
    #[pymodule_export]
    use crate::proxy::{
        _ProxyServer, _check_proxy_settings, _proxy_choices, _proxy_protocol, _proxy_settings,
        _proxy_text_settings, StreamMerger,
    };
    #[pymodule_export]
    use crate::quality::{agreement, expert_load, Agreement, ExpertLoad};
    #[pymodule_export]
    use crate::replay::_replay_ids;
    #[pymodule_export]
    use crate::trajectory::{_trajectory_from_payload, Trajectory};

    /// The crate's version (`routed_experts.__version__`), from the build.
    #[pymodule_export]
    #[allow(non_upper_case_globals)] // Python's name for it
    const __version__: &str = env!("CARGO_PKG_VERSION");

    /// The proxy's Rust log records go to Python's `logging` (logger `routed_experts.proxy`).
    /// Levels are looked up on each record, so `logging` settings made later still apply.
    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let logger = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::Nothing)?
            .filter(log::LevelFilter::Info);
        // Another extension may have installed a `log` logger first; then ours stays off.
        let _ = logger.install();
        // The formats' names, in the core's order: Python's choices come from here, not a list
        // of its own (tests/test_new_user.py holds the stub's `_Format` to it).
        let names = routed_experts::Format::ALL.map(routed_experts::Format::name);
        m.add("FORMATS", pyo3::types::PyTuple::new(m.py(), names)?)?;
        // The core's error kinds, as the `kind` of the exceptions it raises; an exception
        // raised elsewhere (argument checks in Python) has kind None and no details.
        let kinds = routed_experts::ErrorKind::NAMES;
        m.add("_ERROR_KINDS", pyo3::types::PyTuple::new(m.py(), kinds)?)?;
        let base = m.getattr("RoutedExpertsError")?;
        base.setattr("kind", m.py().None())?;
        let empty = m.py().import("types")?.getattr("MappingProxyType")?;
        base.setattr("details", empty.call1((pyo3::types::PyDict::new(m.py()),))?)?;
        // `__all__` is the package's public API, the one list of it (`routed_experts` imports
        // it whole): what is exported above, but the internal `_` names and the proxy's
        // `StreamMerger` (`routed_experts.proxy` exports it).
        let exported: Vec<String> = m.index()?.extract()?;
        let public: Vec<String> = exported
            .into_iter()
            .filter(|n| !n.starts_with('_') && n != "StreamMerger")
            .collect();
        m.setattr("__all__", pyo3::types::PyList::new(m.py(), public)?)?;
        Ok(())
    }
}
