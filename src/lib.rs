//! Parse, merge, stitch and encode the *routed experts* of Mixture-of-Experts models: the
//! per-token, per-layer top-k expert ids that router replay ("R3") needs, as they travel from
//! inference engine to router to orchestrator to trainer.
//!
//! This crate is the pure-Rust core of the `routed_experts` Python package, and a dependency
//! for Rust routers (the vLLM router, Dynamo's frontend, the SGLang gateway) that merge
//! prefill/decode halves in disaggregated serving. It depends on no Python, no async runtime and
//! no process-wide state: every size limit is a value the caller passes. The P/D proxy is the
//! crate `routed_experts_proxy`, the Python extension `routed_experts_python`
//! (docs/architecture.md).
//!
//! # Merging prefill and decode response bodies
//!
//! [`merge_response`] returns the decode body with every routing value replaced by its merge
//! with the prefill routing of the same choice, by absolute position: prefill's rows, then
//! decode's rows from prefill's end on, whatever `start` decode's delta has. Every other byte of
//! the decode body is unchanged. Inconsistent halves are an [`Error`] whose [`kind`](Error::kind)
//! says which rule they broke ([`ErrorKind::Gap`], [`ErrorKind::Shape`], ...), as is malformed
//! input ([`ErrorKind::Field`], [`ErrorKind::Json`], ...): never a guess.
//!
//! ```
//! use routed_experts::{from_response, merge_response, Hints, MergeOptions, DEFAULT_MAX_BYTES};
//!
//! // 1 layer, top_k 2; a prompt of 3 tokens. Prefill computed rows 0..3; decode sent a delta
//! // from position 2 (the last prompt token) with the generated rows.
//! let prefill = br#"{"choices":[{"index":0,"routed_experts":
//!     {"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}}]}"#;
//! let decode = br#"{"choices":[{"index":0,"text":"hi","routed_experts":
//!     {"data":"Hh8oKQ==","shape":[2,1,2],"start":2,"dtype":"uint8"}}]}"#;
//!
//! let merged = merge_response(prefill, decode, MergeOptions::new(DEFAULT_MAX_BYTES))?;
//! let routing = from_response(&merged, 0, &Hints::default(), DEFAULT_MAX_BYTES)?
//!     .expect("choice 0 carries routing");
//! assert_eq!((routing.start(), routing.num_tokens()), (0, 4));
//! assert_eq!(routing.values::<u8>(), &[10, 11, 20, 21, 30, 31, 40, 41]);
//! # Ok::<(), routed_experts::Error>(())
//! ```
//!
//! Routing is found where the engines put it ([`LOCATIONS`]: vLLM, prime-rl, NeMo-RL, SGLang,
//! Dynamo), in any of their formats ([`Format`]); a `routed_experts` key anywhere else, a key
//! given twice, or invalid UTF-8 is an error, so a body whose routing cannot be found never
//! passes as one without.
//!
//! # Payloads
//!
//! A [`Payload`] is the routing of a contiguous run of positions: an array of shape
//! `(num_tokens, num_layers, top_k)` whose row 0 is absolute position `start`.
//!
//! ```
//! use routed_experts::{decode_sidecar, encode_sidecar, merge, DType, DEFAULT_MAX_BYTES};
//!
//! let prefill = decode_sidecar(br#"{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}"#,
//!     DEFAULT_MAX_BYTES)?;
//! let decode = decode_sidecar(br#"{"data":"AAAAAAAAKCk=","shape":[4,1,2],"start":0}"#,
//!     DEFAULT_MAX_BYTES)?;
//! let merged = merge(&prefill, &decode)?;
//! assert_eq!(merged.dtype(), DType::U8);
//! assert_eq!(encode_sidecar(&merged),
//!     br#"{"data":"CgsUFR4fKCk=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#.to_vec());
//! # Ok::<(), routed_experts::Error>(())
//! ```
//!
//! [`Trajectory`] stitches the turns of a multi-turn rollout by position (format.md §5); the modules
//! below hold the rest (formats, validation, packing for the trainer).
//!
//! # Replay quality
//!
//! [`agreement()`] measures how two routings of the same positions agree (rollout against the
//! trainer's recompute); [`ExpertLoad`] counts each layer's picks of each expert.
//!
//! ```
//! use routed_experts::{agreement, DTypeChoice, ExpertLoad, Payload, Shape, DEFAULT_MAX_BYTES};
//!
//! // 2 tokens, 2 layers, top_k 2. The recompute picked {3, 9} where the rollout had {3, 4}.
//! let shape = Shape::new(2, 2, 2);
//! let rollout = Payload::from_values(&[1i64, 2, 3, 4, 5, 6, 7, 8], shape, 0, DTypeChoice::Compact)?;
//! let trainer = Payload::from_values(&[2i64, 1, 3, 9, 6, 5, 7, 8], shape, 0, DTypeChoice::Compact)?;
//! let a = agreement(&rollout, &trainer)?;
//! assert_eq!((a.exact_match(), a.tokens_with_difference()), (0.75, 0.5));
//!
//! let mut load = ExpertLoad::new(2, 10, DEFAULT_MAX_BYTES)?;
//! load.add(&rollout)?;
//! assert_eq!(&load.counts()[..10], &[0, 1, 1, 0, 0, 1, 1, 0, 0, 0]); // layer 0
//! # Ok::<(), routed_experts::Error>(())
//! ```

// `with_element!` instantiates generic code for every dtype; in the int64 arm `.into()` to i64
// is the identity, which is what the generic code means.
#![allow(clippy::useless_conversion)]
#![warn(missing_docs)]

// Folders by concern (docs/architecture.md draws them):
/// Where routing sits in a response body, and what else the body says of it (token counts,
/// vLLM 0.21's split rows).
pub mod body;
mod error;
/// Every routing format in the wild (format.md §3.2): detection, decoding, encoding.
pub mod formats;
/// The text and memory kernels under everything: base64, the JSON scan, aligned buffers, the
/// split of one pass among the cores.
mod kernels;
/// The size limit on decoded payloads.
pub mod limits;
/// The payload (format.md §2), its dtypes, and the merge of two by absolute position (§4).
mod payload;
/// Replay quality (format.md §7): agreement, expert load, the checks before a step.
mod quality;
/// Routing inside whole response bodies: reading it, sampling suspect rows, merging bodies
/// (format.md §3.2, §4).
pub mod response;
#[cfg(test)]
mod test_rng;
/// The trainer's end (format.md §5, §6): multi-turn stitching, packing, a rank's share, the
/// routers' replay ids.
mod trainer;

// The modules by the paths users know (each folder above holds them).

pub use formats::{npy, sidecar};
pub use kernels::buffer;
pub use payload::{dtype, merge};
pub use quality::{agreement, expert_load, validate};
pub use trainer::{pack, replay, shard, trajectory};

pub use agreement::{agreement, Agreement};
pub use body::{
    find_routing, is_routing_key, read_body, read_prefill, BodyRouting, Counts, Found, PrefillBody,
    LOCATIONS,
};
pub use buffer::AlignedBytes;
pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Half, Result};
pub use expert_load::ExpertLoad;
pub use formats::{Format, Hints};
pub use limits::DEFAULT_MAX_BYTES;
pub use payload::merge::merge;
pub use payload::{DTypeChoice, Header, Payload, Shape, MAX_DECLARED_BYTES};
pub use response::{from_response, merge_response, routing_rows, MergeOptions};
pub use sidecar::{decode as decode_sidecar, encode as encode_sidecar};
pub use trajectory::{Overlap, Pad, Trajectory};
