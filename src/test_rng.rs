//! A small seeded generator for the unit tests' random inputs (xorshift64: reproducible, no
//! dependency).

/// The next numbers from `seed` (which must not be 0), one per call.
pub fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}
