//! The kernels every reader and writer runs on: standard base64 (`b64`), the one-pass JSON
//! scanner (`jsonscan`) and the SIMD search inside its strings (`strscan`), buffers aligned for
//! any element type (`buffer`), the split of one pass among the cores (`parallel`), and the
//! long base64 runs of a body found as it arrives (`runs`, which the scanner takes).

pub(crate) mod b64;
pub(crate) mod b64_pieces;
pub mod buffer;
pub(crate) mod jsonscan;
pub(crate) mod parallel;
pub(crate) mod runs;
pub(crate) mod strscan;
