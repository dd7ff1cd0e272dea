//! The payload model (format.md §2): the routing of a contiguous run of token positions, as an
//! array of shape `(num_tokens, num_layers, top_k)` whose row 0 sits at absolute position `start`.

pub mod dtype;
pub mod merge;

use crate::error::{Error, Result};
use crate::kernels::buffer::AlignedBytes;
use crate::payload::dtype::with_element;
use crate::payload::dtype::{DType, Element};

/// An array shape `(num_tokens, num_layers, top_k)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Token positions (rows).
    pub tokens: usize,
    /// MoE layers.
    pub layers: usize,
    /// Experts per token and layer.
    pub top_k: usize,
}

impl Shape {
    /// A shape.
    pub fn new(tokens: usize, layers: usize, top_k: usize) -> Self {
        Shape {
            tokens,
            layers,
            top_k,
        }
    }

    /// Elements in one token row (`layers * top_k`), or an error if that overflows.
    pub fn row_elems(&self) -> Result<usize> {
        self.layers
            .checked_mul(self.top_k)
            .ok_or_else(|| self.overflow())
    }

    /// Elements in the array, or an error if that overflows.
    pub fn elems(&self) -> Result<usize> {
        self.row_elems()?
            .checked_mul(self.tokens)
            .ok_or_else(|| self.overflow())
    }

    /// Bytes the array needs in `dtype`, computed without overflow (checked before allocating).
    pub fn nbytes(&self, dtype: DType) -> Result<usize> {
        self.elems()?
            .checked_mul(dtype.itemsize())
            .ok_or_else(|| self.overflow())
    }

    /// Bytes the shape declares, counting only its non-zero dimensions (`None` on overflow).
    /// This, not the data length, is what bounds a shape: `[2**62, 0, 1]` holds no data but
    /// declares 2**62 bytes, and numpy (like ndarray) refuses any shape whose non-zero
    /// dimensions overflow, whatever its size.
    pub fn declared_bytes(&self, dtype: DType) -> Option<usize> {
        [self.tokens, self.layers, self.top_k]
            .into_iter()
            .filter(|&d| d != 0)
            .try_fold(dtype.itemsize(), usize::checked_mul)
    }

    fn overflow(&self) -> Error {
        Error::field(
            "shape",
            "a size that fits in memory",
            format!("{self} (overflows)"),
        )
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {}, {}]", self.tokens, self.layers, self.top_k)
    }
}

/// How to pick the dtype of a payload built from values (format.md §3.1, "compact dtype choice").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeChoice {
    /// The smallest of uint8/uint16 (int16/int32 with negatives) that holds the values.
    Compact,
    /// uint8 up to 256 experts, else uint16: one dtype for every payload of a model.
    NumExperts(u64),
    /// Exactly this dtype.
    Exact(DType),
}

impl DTypeChoice {
    /// The dtype for values in `[lo, hi]` (`None`: no values).
    pub fn resolve(self, min_max: Option<(i64, i64)>) -> Result<DType> {
        match self {
            DTypeChoice::Exact(d) => Ok(d),
            DTypeChoice::NumExperts(n) => DType::for_num_experts(n),
            DTypeChoice::Compact => match min_max {
                Some((lo, hi)) => DType::compact_for_range(lo, hi),
                None => Ok(DType::U8),
            },
        }
    }
}

/// Everything about a payload but its values: enough to plan a merge before decoding anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Absolute position of row 0.
    pub start: u64,
    /// The array's shape.
    pub shape: Shape,
    /// The element type.
    pub dtype: DType,
}

/// The largest size any array may declare: numpy, ndarray and Rust slices all need sizes that
/// fit `isize`. Every `Header` (and so every `Payload`) is within it, so every view of a payload
/// that numpy is asked to build is one it can represent. The caller's size limit
/// (`limits::check_shape`) is usually far lower.
pub const MAX_DECLARED_BYTES: usize = isize::MAX as usize;

impl Header {
    /// A header whose shape can be represented (`MAX_DECLARED_BYTES`) and whose positions fit in
    /// u64 (`start + num_tokens` is used everywhere as `stop`).
    pub fn new(start: u64, shape: Shape, dtype: DType) -> Result<Header> {
        if shape
            .declared_bytes(dtype)
            .is_none_or(|n| n > MAX_DECLARED_BYTES)
        {
            return Err(Error::field(
                "shape",
                "non-zero dimensions whose product times the item size fits in 2**63-1 bytes",
                format!("{shape} of {dtype}"),
            ));
        }
        start
            .checked_add(shape.tokens as u64)
            .ok_or_else(|| Error::field("start", "start + num_tokens below 2**64", start))?;
        Ok(Header {
            start,
            shape,
            dtype,
        })
    }

    /// Position after the last row (`start + num_tokens`).
    pub fn stop(&self) -> u64 {
        self.start + self.shape.tokens as u64
    }

    /// Bytes of one token row.
    pub fn row_bytes(&self) -> usize {
        self.shape.layers * self.shape.top_k * self.dtype.itemsize()
    }
}

/// The routing of a contiguous run of token positions (format.md §2): an array of shape
/// `(num_tokens, num_layers, top_k)` whose row 0 is absolute position `start`. Immutable once made.
#[derive(Clone, Debug, PartialEq)]
pub struct Payload {
    start: u64,
    shape: Shape,
    dtype: DType,
    data: AlignedBytes,
}

impl Payload {
    /// Wrap raw native-endian bytes; their length must match the shape exactly.
    pub fn new(start: u64, shape: Shape, dtype: DType, data: AlignedBytes) -> Result<Self> {
        let want = shape.nbytes(dtype)?;
        if data.len() != want {
            return Err(Error::field(
                "data",
                format!("{want} bytes for shape {shape} of {dtype}"),
                format!("{} bytes", data.len()),
            ));
        }
        Header::new(start, shape, dtype)?;
        Ok(Payload {
            start,
            shape,
            dtype,
            data,
        })
    }

    /// All-zero values.
    pub fn zeros(start: u64, shape: Shape, dtype: DType) -> Result<Self> {
        Header::new(start, shape, dtype)?; // before allocating
        Payload::new(
            start,
            shape,
            dtype,
            AlignedBytes::zeroed(shape.nbytes(dtype)?),
        )
    }

    /// Build from values in C order, converting to the chosen dtype; a value that does not fit
    /// is an error naming its position, never a silent wrap.
    pub fn from_values<T: Element>(
        values: &[T],
        shape: Shape,
        start: u64,
        choice: DTypeChoice,
    ) -> Result<Self> {
        if values.len() != shape.elems()? {
            return Err(Error::field(
                "array",
                format!("{} values for shape {shape}", shape.elems()?),
                values.len(),
            ));
        }
        let dtype = choice.resolve(min_max(values))?;
        let mut out = Payload::zeros(start, shape, dtype)?;
        with_element!(dtype, D => convert(values, out.data.as_mut_slice::<D>()))
            .map_err(|i| out.value_error(i, values[i].into(), dtype))?;
        Ok(out)
    }

    /// Start, shape and dtype.
    pub fn header(&self) -> Header {
        Header {
            start: self.start,
            shape: self.shape,
            dtype: self.dtype,
        }
    }
    /// Absolute position of row 0.
    pub fn start(&self) -> u64 {
        self.start
    }
    /// Position after the last row.
    pub fn stop(&self) -> u64 {
        self.header().stop()
    }
    /// The array's shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }
    /// Rows.
    pub fn num_tokens(&self) -> usize {
        self.shape.tokens
    }
    /// Layers per row.
    pub fn num_layers(&self) -> usize {
        self.shape.layers
    }
    /// Experts per token and layer.
    pub fn top_k(&self) -> usize {
        self.shape.top_k
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The values' raw bytes (native endian, C order).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_bytes()
    }
    /// The values' buffer.
    pub fn into_data(self) -> AlignedBytes {
        self.data
    }
    /// The values as `T`, which must be the payload's element type (else a panic: a programming error).
    pub fn values<T: Element>(&self) -> &[T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "payload viewed as the wrong element type"
        );
        self.data.as_slice()
    }

    /// Bytes of one token row.
    pub fn row_bytes(&self) -> usize {
        self.header().row_bytes()
    }

    /// The bytes of rows `[from, to)` (row indices, not absolute positions).
    pub fn rows(&self, from: usize, to: usize) -> &[u8] {
        &self.bytes()[from * self.row_bytes()..to * self.row_bytes()]
    }

    /// Rows for absolute positions `[start, stop)`, which must lie inside this payload.
    pub fn slice(&self, start: u64, stop: u64) -> Result<Payload> {
        if start > stop || start < self.start || stop > self.stop() {
            return Err(Error::malformed(format!(
                "slice [{start}, {stop}) is not inside the payload's positions [{}, {})",
                self.start,
                self.stop()
            )));
        }
        let (from, to) = ((start - self.start) as usize, (stop - self.start) as usize);
        let shape = Shape {
            tokens: to - from,
            ..self.shape
        };
        Payload::new(
            start,
            shape,
            self.dtype,
            AlignedBytes::from_slice(self.rows(from, to)),
        )
    }

    /// Rows before absolute position `at` and rows from it (`at` inside this payload's
    /// positions): views of its memory, which both keep alive (no copy), where the rows before
    /// `at` fill whole 8-byte words (a view starts aligned); else copies.
    pub(crate) fn split_at(self, at: u64) -> Result<(Payload, Payload)> {
        // Inside, the rows before `at` are some of this payload's, so their size fits.
        let tokens = at.saturating_sub(self.start) as usize;
        let head_bytes = (self.start <= at && at <= self.stop()).then(|| tokens * self.row_bytes());
        let Some(head_bytes) = head_bytes.filter(|b| b % 8 == 0) else {
            // Outside (refused by `slice`), or a head that ends inside a word: copies.
            return Ok((self.slice(self.start, at)?, self.slice(at, self.stop())?));
        };
        let (start, shape, dtype) = (self.start, self.shape, self.dtype);
        let (head, tail) = self.data.split_views(head_bytes);
        let rest = shape.tokens - tokens;
        Ok((
            Payload::new(start, Shape { tokens, ..shape }, dtype, head)?,
            Payload::new(
                at,
                Shape {
                    tokens: rest,
                    ..shape
                },
                dtype,
                tail,
            )?,
        ))
    }

    /// The same values in another dtype; a value that does not fit is an error.
    pub fn astype(&self, dtype: DType) -> Result<Payload> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        let mut out = Payload::zeros(self.start, self.shape, dtype)?;
        with_element!(dtype, D => self.write_as::<D>(out.data.as_mut_slice()))?;
        Ok(out)
    }

    /// Write the values, converted, into `dst` (which has exactly one slot per value): the
    /// path by which a numpy-owned array is filled without an intermediate buffer.
    pub fn write_as<D: Element>(&self, dst: &mut [D]) -> Result<()> {
        self.write_rows_as(0, self.shape.tokens, dst)
    }

    /// `write_as` for rows `[from, to)` only; `dst` has one slot per value of those rows.
    pub(crate) fn write_rows_as<D: Element>(
        &self,
        from: usize,
        to: usize,
        dst: &mut [D],
    ) -> Result<()> {
        let row = self.shape.layers * self.shape.top_k;
        with_element!(self.dtype, S => {
            let src = &self.data.as_slice::<S>()[from * row..to * row];
            convert(src, dst).map_err(|i| self.value_error(from * row + i, src[i].into(), D::DTYPE))
        })
    }

    /// [`Payload::write_rows_as`] of the layers `layers` only: `dst` has one slot per kept
    /// value of rows `[from, to)` (a pipeline stage's share of them).
    pub(crate) fn write_block_as<D: Element>(
        &self,
        from: usize,
        to: usize,
        layers: std::ops::Range<usize>,
        dst: &mut [D],
    ) -> Result<()> {
        if layers == (0..self.shape.layers) {
            return self.write_rows_as(from, to, dst);
        }
        let (k, row) = (self.shape.top_k, self.shape.layers * self.shape.top_k);
        let width = layers.len() * k;
        with_element!(self.dtype, S => {
            let src = self.data.as_slice::<S>();
            for (r, out) in (from..to).zip(dst.chunks_exact_mut(width.max(1))) {
                let at = r * row + layers.start * k;
                convert(&src[at..at + width], out)
                    .map_err(|i| self.value_error(at + i, src[at + i].into(), D::DTYPE))?;
            }
            Ok(())
        })
    }

    /// How many values of row `r` are -1 (vLLM's mark of a row it has no routing for), and the
    /// first one's place in the row; `(0, 0)` for an unsigned dtype.
    pub(crate) fn sentinels(&self, r: usize) -> (usize, usize) {
        let row = self.shape.layers * self.shape.top_k;
        with_element!(self.dtype, S => {
            let values = &self.data.as_slice::<S>()[r * row..(r + 1) * row];
            let is_mark = |v: &S| Into::<i64>::into(*v) == -1;
            let count = values.iter().filter(|v| is_mark(v)).count();
            (count, values.iter().position(is_mark).unwrap_or(0))
        })
    }

    /// Append rows `[from, to)` of `other` (same layers and top_k; its dtype must fit ours).
    pub(crate) fn append_rows(&mut self, other: &Payload, from: usize, to: usize) -> Result<()> {
        let row = self.shape.layers * self.shape.top_k;
        let tail = self.data.grow((to - from) * self.row_bytes());
        with_element!(self.dtype, D => other.write_rows_as::<D>(from, to, bytemuck::cast_slice_mut(tail)))?;
        self.shape.tokens += to - from;
        debug_assert_eq!(
            self.data.len(),
            self.shape.tokens * row * self.dtype.itemsize()
        );
        Ok(())
    }

    /// Keep the first `tokens` rows.
    pub(crate) fn truncate_rows(&mut self, tokens: usize) {
        self.data.truncate(tokens * self.row_bytes());
        self.shape.tokens = tokens;
    }

    /// Mutable values, for the core's own builders (merge, stitch) that fill a fresh payload.
    pub(crate) fn values_mut<T: Element>(&mut self) -> &mut [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "payload viewed as the wrong element type"
        );
        self.data.as_mut_slice()
    }

    /// Smallest and largest value, `None` when empty.
    pub fn min_max(&self) -> Option<(i64, i64)> {
        with_element!(self.dtype, T => min_max(self.data.as_slice::<T>()))
    }

    /// Value `i` (flat C-order index) widened to i64.
    pub fn value_at(&self, i: usize) -> i64 {
        with_element!(self.dtype, T => self.data.as_slice::<T>()[i].into())
    }

    /// Same positions, shape and values, whatever the dtypes.
    pub fn same_routing(&self, other: &Payload) -> bool {
        if self.start != other.start || self.shape != other.shape {
            return false;
        }
        if self.dtype == other.dtype {
            return self.bytes() == other.bytes();
        }
        (0..self.shape.elems().unwrap_or(0)).all(|i| self.value_at(i) == other.value_at(i))
    }

    /// (absolute position, layer) of flat element index `i`.
    pub(crate) fn locate(&self, i: usize) -> (u64, usize) {
        let row = self.shape.layers * self.shape.top_k;
        (self.start + (i / row) as u64, (i % row) / self.shape.top_k)
    }

    fn value_error(&self, i: usize, value: i64, dtype: DType) -> Error {
        let (pos, layer) = self.locate(i);
        Error::field(
            "array",
            format!(
                "values that fit {dtype} (range {}..={})",
                dtype.min(),
                dtype.max()
            ),
            format!("{value} at position {pos}, layer {layer}"),
        )
    }
}

fn min_max<T: Element>(values: &[T]) -> Option<(i64, i64)> {
    let (&first, rest) = values.split_first()?;
    let (lo, hi) = rest.iter().fold((first, first), |(lo, hi), &v| {
        (
            if v.into() < lo.into() { v } else { lo },
            if v.into() > hi.into() { v } else { hi },
        )
    });
    Some((lo.into(), hi.into()))
}

/// Convert element-wise; `Err(i)` is the index of the first value `D` cannot hold.
fn convert<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> std::result::Result<(), usize> {
    assert_eq!(
        src.len(),
        dst.len(),
        "conversion between slices of different lengths"
    );
    if S::DTYPE == D::DTYPE {
        bytemuck::cast_slice_mut::<D, u8>(dst).copy_from_slice(bytemuck::cast_slice(src));
        return Ok(());
    }
    if D::DTYPE.holds(S::DTYPE.min()) && D::DTYPE.holds(S::DTYPE.max()) {
        // Widening: every value fits, so the loop has no branch to stop vectorisation.
        for (d, &s) in dst.iter_mut().zip(src) {
            let v: i64 = s.into();
            *d = D::try_from(v).unwrap_or_else(|_| unreachable!());
        }
        return Ok(());
    }
    for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
        *d = D::try_from(s.into()).map_err(|_| i)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(values: &[i64], tokens: usize, start: u64) -> Payload {
        let shape = Shape::new(tokens, 1, values.len() / tokens.max(1));
        Payload::from_values(values, shape, start, DTypeChoice::Compact).unwrap()
    }

    #[test]
    fn compact_choice_by_values() {
        assert_eq!(p(&[1, 255], 1, 0).dtype(), DType::U8);
        assert_eq!(p(&[1, 256], 1, 0).dtype(), DType::U16);
        assert_eq!(p(&[-1, 3], 1, 0).dtype(), DType::I16);
    }

    #[test]
    fn explicit_dtype_never_wraps() {
        let shape = Shape::new(2, 1, 1);
        let err = Payload::from_values(&[3i64, 300], shape, 10, DTypeChoice::Exact(DType::U8));
        let msg = err.unwrap_err().to_string();
        assert!(msg.contains("300 at position 11, layer 0"), "{msg}");
    }

    #[test]
    fn split_at_views_or_copies_and_refuses_outside() {
        // 8 bytes a row: views; 2 bytes a row: views where the head fills whole words.
        let values: Vec<i64> = (0..24).collect();
        for (rows, at, viewed) in [(3, 11, true), (12, 14, true), (12, 13, false)] {
            let a = p(&values, rows, 10);
            let (head, tail) = a.clone().split_at(at).unwrap();
            assert_eq!((head.start(), head.stop(), tail.start()), (10, at, at));
            assert_eq!([head.bytes(), tail.bytes()].concat(), a.bytes());
            assert_eq!(head.into_data().is_shared(), viewed, "{rows} rows, at {at}");
            assert_eq!(tail.into_data().is_shared(), viewed);
        }
        let a = p(&values, 3, 10);
        for at in [9, 14, u64::MAX] {
            assert!(a.clone().split_at(at).is_err(), "{at}");
        }
        let (head, tail) = a.clone().split_at(13).unwrap();
        assert!(head.bytes() == a.bytes() && tail.num_tokens() == 0);
    }

    #[test]
    fn slice_and_astype() {
        let a = p(&[1, 2, 3, 4, 5, 6], 3, 10);
        let s = a.slice(11, 13).unwrap();
        assert_eq!((s.start(), s.bytes()), (11, &[3u8, 4, 5, 6][..]));
        assert!(a.slice(9, 12).is_err());
        assert!(a.slice(12, 11).is_err());
        let w = a.astype(DType::U16).unwrap();
        assert_eq!(w.values::<u16>(), &[1, 2, 3, 4, 5, 6]);
        assert!(a.same_routing(&w));
        let big = p(&[1, 300], 1, 0);
        assert!(big.astype(DType::U8).is_err());
    }
}
