//! The trainer's end (format.md §5, §6): multi-turn stitching (`trajectory`), packing samples
//! into one batch (`pack`), one rank's share of it (`shard`), and the routers' replay ids
//! (`replay`).

pub mod pack;
pub mod replay;
pub mod shard;
pub mod trajectory;
