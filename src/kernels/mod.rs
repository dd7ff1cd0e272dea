//! The kernels every reader and writer runs on: standard base64 (`b64`), the one-pass JSON
//! scanner (`jsonscan`) and the SIMD search inside its strings (`strscan`), buffers aligned for
//! any element type (`buffer`), the split of one pass among the cores (`parallel`), and what
//! the scanner may be given of a body read as it arrived: its long base64 runs (`runs`), its
//! strings held decoded (`predecoded`).

pub(crate) mod b64;
pub(crate) mod b64_pieces;
pub mod buffer;
pub(crate) mod jsonscan;
pub(crate) mod parallel;
pub(crate) mod predecoded;
pub(crate) mod runs;
pub(crate) mod strscan;
