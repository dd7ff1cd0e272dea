//! Replay quality in Python: `agreement` and `expert_load` over payloads, numpy arrays or torch
//! tensors, and the result objects that present the core's counts.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use crate::errors::PyResult;

use pyo3::types::{PyDict, PyList, PyTuple};

use super::convert::{payload_from_array, prefix_error};
use super::payload::RoutedExperts;
use routed_experts::agreement::Agreement as CoreAgreement;
use routed_experts::expert_load::ExpertLoad as CoreExpertLoad;
use routed_experts::{DTypeChoice, Payload};

/// Routing given to a quality function: a payload borrowed in place, or an array (numpy, or
/// anything `numpy.asarray` takes: a CPU torch tensor) read into one, positions from 0.
enum Routing<'py> {
    Borrowed(Bound<'py, RoutedExperts>),
    Owned(Payload),
}

impl Routing<'_> {
    fn get(&self) -> &Payload {
        match self {
            Routing::Borrowed(p) => &p.get().inner,
            Routing::Owned(p) => p,
        }
    }
}

fn routing_arg<'py>(value: &Bound<'py, PyAny>, name: &str) -> PyResult<Routing<'py>> {
    if let Ok(p) = value.cast::<RoutedExperts>() {
        return Ok(Routing::Borrowed(p.clone()));
    }
    payload_from_array(value, 0, DTypeChoice::Compact)
        .map(Routing::Owned)
        .map_err(|e| prefix_error(value.py(), e.into(), &format!("`{name}`: ")).into())
}

/// How two routings of the same positions agree (from `agreement`). Fractions are over the
/// compared rows (positions both cover, missing on neither side); NaN when none was compared.
#[pyclass(frozen, module = "routed_experts._core", name = "Agreement")]
pub struct Agreement {
    inner: CoreAgreement,
}

#[pymethods]
impl Agreement {
    /// Fraction of routers (token x layer) whose expert sets match exactly.
    #[getter]
    fn exact_match(&self) -> f64 {
        self.inner.exact_match()
    }

    /// Mean over routers of |A ∩ B| / top_k.
    #[getter]
    fn overlap(&self) -> f64 {
        self.inner.overlap()
    }

    /// Fraction of tokens with at least one layer whose sets differ.
    #[getter]
    fn tokens_with_difference(&self) -> f64 {
        self.inner.tokens_with_difference()
    }

    /// Mean number of routers per token whose sets differ (prime-rl's replace rate times
    /// num_layers).
    #[getter]
    fn differing_per_token(&self) -> f64 {
        self.inner.differing_per_token()
    }

    /// Per layer (float64 array of num_layers): fraction of routers whose sets match exactly.
    #[getter]
    fn exact_match_per_layer<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        self.inner.exact_match_per_layer().into_pyarray(py)
    }

    /// Per layer (float64 array of num_layers): mean |A ∩ B| / top_k.
    #[getter]
    fn overlap_per_layer<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        self.inner.overlap_per_layer().into_pyarray(py)
    }

    /// Token rows compared.
    #[getter]
    fn compared_rows(&self) -> u64 {
        self.inner.compared_rows
    }

    /// Token rows left out because one side or both marked them missing (all -1).
    #[getter]
    fn excluded_rows(&self) -> u64 {
        self.inner.excluded_rows
    }

    /// First absolute position compared.
    #[getter]
    fn start(&self) -> u64 {
        self.inner.start
    }

    /// End of the compared positions (exclusive).
    #[getter]
    fn stop(&self) -> u64 {
        self.inner.stop
    }

    /// Layers compared.
    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers
    }

    /// Experts per token and layer.
    #[getter]
    fn top_k(&self) -> usize {
        self.inner.top_k
    }

    /// The layers with no router (top_k zero throughout on both sides: a dense layer), left
    /// out of every figure.
    #[getter]
    fn no_router_layers(&self) -> Vec<usize> {
        no_router_layers(&self.inner)
    }

    /// Every figure as a plain dict (lists for the per-layer ones), for logging.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let a = &self.inner;
        let d = PyDict::new(py);
        d.set_item("no_router_layers", no_router_layers(a))?;
        d.set_item("exact_match", a.exact_match())?;
        d.set_item("overlap", a.overlap())?;
        d.set_item("tokens_with_difference", a.tokens_with_difference())?;
        d.set_item("differing_per_token", a.differing_per_token())?;
        d.set_item("exact_match_per_layer", a.exact_match_per_layer())?;
        d.set_item("overlap_per_layer", a.overlap_per_layer())?;
        d.set_item("compared_rows", a.compared_rows)?;
        d.set_item("excluded_rows", a.excluded_rows)?;
        d.set_item("start", a.start)?;
        d.set_item("stop", a.stop)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let a = &self.inner;
        format!(
            "Agreement(positions [{}, {}), compared_rows={}, excluded_rows={}, exact_match={:.4}, \
             overlap={:.4}, tokens_with_difference={:.4}, differing_per_token={:.3})",
            a.start,
            a.stop,
            a.compared_rows,
            a.excluded_rows,
            a.exact_match(),
            a.overlap(),
            a.tokens_with_difference(),
            a.differing_per_token()
        )
    }
}

/// How two routings of the same token positions agree: rollout against the trainer's
/// recompute, one engine against another, two runs.
///
/// `a` and `b` are payloads (aligned by absolute position: only the rows both cover are
/// compared), or numpy arrays / CPU torch tensors of shape (tokens, layers, top_k) taken as
/// starting at position 0. Each router's top_k is compared as a set. Rows marked missing (all
/// -1) on either side are excluded and counted. Raises PayloadError when the positions do not
/// overlap, the layers or top_k differ, top_k is 0, or a row that is not missing holds a
/// negative id.
#[pyfunction]
pub fn agreement(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
) -> PyResult<Agreement> {
    let (a, b) = (routing_arg(a, "a")?, routing_arg(b, "b")?);
    let (a, b) = (a.get(), b.get());
    let inner = py.detach(|| routed_experts::agreement::agreement(a, b))?;
    Ok(Agreement { inner })
}

fn no_router_layers(a: &CoreAgreement) -> Vec<usize> {
    a.no_router
        .iter()
        .enumerate()
        .filter(|(_, &none)| none)
        .map(|(l, _)| l)
        .collect()
}

/// How often each layer's router picked each expert (from `expert_load`).
#[pyclass(frozen, module = "routed_experts._core", name = "ExpertLoad")]
pub struct ExpertLoad {
    inner: CoreExpertLoad,
}

#[pymethods]
impl ExpertLoad {
    /// The (num_layers, num_experts) int64 count table.
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let (l, e) = (self.inner.num_layers(), self.inner.num_experts());
        // Counts are bounded by the ids counted (at most the size limit): they fit int64.
        let flat: Vec<i64> = self.inner.counts().iter().map(|&c| c as i64).collect();
        Ok(flat.into_pyarray(py).reshape([l, e])?)
    }

    /// Per layer: the busiest expert's count over the mean (1.0 is perfectly even).
    #[getter]
    fn imbalance<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        self.inner.imbalance().into_pyarray(py)
    }

    /// Per layer: coefficient of variation of the counts (std over mean; 0.0 is even).
    #[getter]
    fn cv<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        self.inner.coefficient_of_variation().into_pyarray(py)
    }

    /// Per layer: how many experts were never chosen.
    #[getter]
    fn never_chosen_per_layer<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.never_chosen_per_layer().into_pyarray(py)
    }

    /// The experts no layer ever chose, ascending.
    #[getter]
    fn never_chosen<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.never_chosen().into_pyarray(py)
    }

    /// Token rows counted.
    #[getter]
    fn rows(&self) -> u64 {
        self.inner.rows()
    }

    /// Token rows skipped because they were marked missing (all -1).
    #[getter]
    fn missing_rows(&self) -> u64 {
        self.inner.missing_rows()
    }

    /// Layers of the table.
    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    /// Experts of the table.
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }

    /// Every figure as a plain dict (lists per layer; `counts` as nested lists), for logging.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = &self.inner;
        let d = PyDict::new(py);
        let counts: Vec<Vec<u64>> = e
            .counts()
            .chunks(e.num_experts().max(1))
            .map(|r| r.to_vec())
            .collect();
        d.set_item("counts", counts)?;
        d.set_item("imbalance", e.imbalance())?;
        d.set_item("cv", e.coefficient_of_variation())?;
        d.set_item("never_chosen_per_layer", e.never_chosen_per_layer())?;
        d.set_item("never_chosen", e.never_chosen())?;
        d.set_item("rows", e.rows())?;
        d.set_item("missing_rows", e.missing_rows())?;
        d.set_item("num_layers", e.num_layers())?;
        d.set_item("num_experts", e.num_experts())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let imbalance = self.inner.imbalance();
        let worst = imbalance.iter().copied().fold(f64::NAN, f64::max);
        format!(
            "ExpertLoad(num_layers={}, num_experts={}, rows={}, missing_rows={}, worst imbalance={:.3})",
            self.inner.num_layers(),
            self.inner.num_experts(),
            self.inner.rows(),
            self.inner.missing_rows(),
            worst
        )
    }
}

/// The (num_layers, num_experts) table of how often each layer picked each expert, over one
/// routing (payload, numpy array, CPU torch tensor) or a list or tuple of them, with per-layer
/// imbalance (max over mean), coefficient of variation and the experts never chosen.
///
/// Rows marked missing (all -1) are skipped and counted. Raises PayloadError for an id that is
/// negative or `>= num_experts` (naming position and layer), for routings with different layer
/// counts, and for a `num_experts` of 0 or one whose table would pass the size limit.
#[pyfunction]
pub fn expert_load(
    py: Python<'_>,
    routing: &Bound<'_, PyAny>,
    #[pyo3(from_py_with = crate::convert::arg::num_experts)] num_experts: usize,
) -> PyResult<ExpertLoad> {
    let items: Vec<Bound<'_, PyAny>> =
        if routing.is_instance_of::<PyList>() || routing.is_instance_of::<PyTuple>() {
            routing.try_iter()?.collect::<pyo3::PyResult<_>>()?
        } else {
            vec![routing.clone()]
        };
    let routings = items
        .iter()
        .map(|r| routing_arg(r, "routing"))
        .collect::<PyResult<Vec<_>>>()?;
    let Some(first) = routings.first() else {
        return Err(routed_experts::Error::field(
            "routing",
            "at least one routing",
            "an empty list",
        )
        .into());
    };
    let layers = first.get().num_layers();
    let payloads: Vec<&Payload> = routings.iter().map(Routing::get).collect();
    let inner = py.detach(|| {
        let mut load = CoreExpertLoad::new(layers, num_experts, crate::limits::max_bytes())?;
        for p in payloads {
            load.add(p)?;
        }
        Ok::<_, routed_experts::Error>(load)
    })?;
    Ok(ExpertLoad { inner })
}
