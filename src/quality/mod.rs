//! Replay quality (format.md §7): how far two routings of the same positions agree
//! (`agreement`), how the experts' load is spread (`expert_load`), and the checks a trainer
//! runs before a step (`validate`).

pub mod agreement;
pub mod expert_load;
pub mod validate;
