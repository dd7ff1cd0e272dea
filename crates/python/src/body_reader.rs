//! `BodyReader`: a response body fed a chunk at a time as it arrives (the core's
//! `response::BodyReader`), read as `group_from_response` reads a whole one.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyMemoryView, PyString, PyTuple};

use crate::convert;
use crate::errors::PyResult;
use crate::functions::{group_samples, hints};
use routed_experts::response;

/// A response body read as it arrives: `feed` each chunk (bytes, bytearray or memoryview) as
/// the socket gives it, then `group()` reads it as `group_from_response` reads the whole body
/// (the same samples, or the same error). Each long base64 `data` string (a compact sidecar's:
/// the shared-prompt answer's prompt rows and each choice's own) is held decoded as it
/// arrives, so a group's answer is held at about its rows' size, never as text and rows at
/// once. Nothing else of the body is read before `group()`. A reader reads one body.
#[pyclass(module = "routed_experts._core", name = "BodyReader")]
pub struct BodyReader {
    inner: Option<response::BodyReader>,
}

/// The error for a reader whose group was read.
fn spent() -> crate::errors::Failure {
    routed_experts::Error::field(
        "BodyReader",
        "a reader not yet read (a reader reads one body)",
        "one whose group() was read",
    )
    .into()
}

impl BodyReader {
    fn unread(&mut self) -> PyResult<&mut response::BodyReader> {
        self.inner.as_mut().ok_or_else(spent)
    }
}

#[pymethods]
impl BodyReader {
    /// `max_bytes`: no string is held decoded past it (a larger one stays text, and reading it
    /// gives the limit's error as ever); the module's limit by default.
    #[new]
    #[pyo3(signature = (*, max_bytes = None))]
    fn new(
        #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
    ) -> Self {
        let limit = max_bytes.unwrap_or_else(crate::limits::max_bytes);
        BodyReader {
            inner: Some(response::BodyReader::new(limit)),
        }
    }

    /// Take the body's next bytes (with the GIL released).
    fn feed(&mut self, py: Python<'_>, chunk: &Bound<'_, PyAny>) -> PyResult<()> {
        let is_text = chunk.is_instance_of::<PyBytes>()
            || chunk.is_instance_of::<PyByteArray>()
            || chunk.is_instance_of::<PyMemoryView>()
            || chunk.is_instance_of::<PyString>();
        if !is_text {
            let what = "a piece of the body: bytes, bytearray, memoryview or str";
            return Err(
                routed_experts::Error::field("chunk", what, convert::a_value_of(chunk)).into(),
            );
        }
        let text = convert::text_arg(chunk, "chunk")?;
        let reader = self.unread()?;
        py.detach(|| reader.feed(&text));
        Ok(())
    }

    /// The body fed, read as `group_from_response(body, ...)` reads it; the reader is then spent.
    #[pyo3(signature = (*, start = None, num_layers = None, top_k = None, dtype = None, max_bytes = None))]
    fn group<'py>(
        &mut self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::convert::opt::start)] start: Option<u64>,
        #[pyo3(from_py_with = crate::convert::opt::num_layers)] num_layers: Option<usize>,
        #[pyo3(from_py_with = crate::convert::opt::top_k)] top_k: Option<usize>,
        dtype: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::convert::opt::max_bytes)] max_bytes: Option<usize>,
    ) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let hints = hints(start, num_layers, top_k, dtype)?;
        let limit = max_bytes.unwrap_or_else(crate::limits::max_bytes);
        let reader = self.inner.take().ok_or_else(spent)?;
        let group = py.detach(|| reader.group(&hints, limit))?;
        group_samples(py, group)
    }

    /// The bytes held as text: the body fed, less the strings held decoded.
    #[getter]
    fn text_bytes(&mut self) -> PyResult<usize> {
        Ok(self.unread()?.text_bytes())
    }

    /// The bytes held decoded.
    #[getter]
    fn decoded_bytes(&mut self) -> PyResult<usize> {
        Ok(self.unread()?.decoded_bytes())
    }
}
