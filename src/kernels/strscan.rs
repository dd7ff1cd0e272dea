//! The search inside a JSON string: the first byte that is a quote, a backslash, or anything
//! that is not printable ASCII (a control character, or the start of a multi-byte UTF-8
//! sequence). One SIMD comparison finds all three, so checking a string's content costs nothing
//! beyond finding its end: routing bodies are megabytes of base64, all printable ASCII.

/// Index of the first byte of `s` that is `"`, `\`, below 0x20 or above 0x7f.
///
/// x86_64: AVX2 when the CPU has it, else SSE2; aarch64: NEON; elsewhere, or with the feature
/// `portable` (which the tests use to run every caller through it), the portable loop.
pub(crate) fn find_special(s: &[u8]) -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", not(feature = "portable")))]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above), the one requirement of `avx2`.
            return unsafe { x86::avx2(s) };
        }
        // SAFETY: SSE2 is part of the x86_64 baseline: every x86_64 CPU has it.
        unsafe { x86::sse2(s) }
    }
    #[cfg(all(target_arch = "aarch64", not(feature = "portable")))]
    {
        neon::find(s)
    }
    #[cfg(any(
        feature = "portable",
        not(any(target_arch = "x86_64", target_arch = "aarch64"))
    ))]
    {
        scalar(s)
    }
}

/// Length of the run of standard base64 characters (`A-Z a-z 0-9 + /`) that `s` starts with.
///
/// A routing value's base64 text is found and checked in this one pass: the run ends at the
/// string's closing quote (or its padding) when the text is valid, so neither a search for the
/// end of the string nor a second pass to check the characters is needed. Kernels as for
/// [`find_special`] (SSSE3 instead of SSE2: the lookup needs a byte shuffle).
pub(crate) fn base64_run(s: &[u8]) -> usize {
    #[cfg(all(target_arch = "x86_64", not(feature = "portable")))]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above), the one requirement of `run_avx2`.
            return unsafe { x86::run_avx2(s) };
        }
        if std::is_x86_feature_detected!("ssse3") {
            // SAFETY: the CPU has SSSE3 (checked just above), the one requirement of
            // `run_ssse3`.
            return unsafe { x86::run_ssse3(s) };
        }
        run_scalar(s)
    }
    #[cfg(all(target_arch = "aarch64", not(feature = "portable")))]
    {
        neon_run::run(s)
    }
    #[cfg(any(
        feature = "portable",
        not(any(target_arch = "x86_64", target_arch = "aarch64"))
    ))]
    {
        run_scalar(s)
    }
}

/// Length of the run of standard base64 characters that `s` ends with: [`base64_run`] over
/// blocks from the end, then the one block holding the last other byte searched back.
pub(crate) fn trailing_base64(s: &[u8]) -> usize {
    const BLOCK: usize = 4096;
    let mut end = s.len();
    while end > 0 {
        let from = end.saturating_sub(BLOCK);
        let block = &s[from..end];
        if base64_run(block) < block.len() {
            let last = block.iter().rposition(|&c| !is_base64(c)).unwrap_or(0);
            return s.len() - (from + last + 1);
        }
        end = from;
    }
    s.len()
}

/// The byte-at-a-time loops: what a CPU without the SIMD kernels runs, and what those kernels
/// finish a string's last bytes with (a leaf: the kernels below import it, it imports nothing).
mod portable {
    /// A character of the standard base64 alphabet (padding `=` aside).
    pub(crate) fn is_base64(c: u8) -> bool {
        c.is_ascii_alphanumeric() || c == b'+' || c == b'/'
    }

    pub(crate) fn run_scalar(s: &[u8]) -> usize {
        s.iter().position(|&c| !is_base64(c)).unwrap_or(s.len())
    }

    pub(crate) fn is_special(c: u8) -> bool {
        c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c)
    }

    pub(crate) fn scalar(s: &[u8]) -> Option<usize> {
        s.iter().position(|&c| is_special(c))
    }
}

pub(crate) use portable::is_base64;
#[allow(unused_imports)]
use portable::{run_scalar, scalar};

/// The SIMD kernels' classification of a byte by its two nibbles: a byte is a base64
/// character when `LOW[low nibble] & HIGH[high nibble]` is not zero. Each bit of `HIGH` stands
/// for one high nibble from 2 to 7 (bytes 0x00-0x1f and 0x80-0xff have none); `LOW` sets, for
/// each low nibble, the bits of the high nibbles it makes a character with: 0x2b `+` and 0x2f
/// `/`; 0x30-0x39; 0x41-0x4f and 0x61-0x6f; 0x50-0x5a and 0x70-0x7a.
#[cfg_attr(
    any(
        feature = "portable",
        not(any(target_arch = "x86_64", target_arch = "aarch64"))
    ),
    allow(dead_code)
)]
mod nibbles {
    const SYMBOLS: u8 = 1 << 0; // 0x2_
    const DIGITS: u8 = 1 << 1; // 0x3_
    const UPPER_1: u8 = 1 << 2; // 0x4_
    const UPPER_2: u8 = 1 << 3; // 0x5_
    const LOWER_1: u8 = 1 << 4; // 0x6_
    const LOWER_2: u8 = 1 << 5; // 0x7_

    pub(crate) const HIGH: [u8; 16] = [
        0, 0, SYMBOLS, DIGITS, UPPER_1, UPPER_2, LOWER_1, LOWER_2, 0, 0, 0, 0, 0, 0, 0, 0,
    ];

    pub(crate) const LOW: [u8; 16] = {
        let mut t = [0u8; 16];
        let mut n = 0;
        while n < 16 {
            let mut bits = 0;
            if n == 0xb || n == 0xf {
                bits |= SYMBOLS;
            }
            if n <= 9 {
                bits |= DIGITS;
            }
            if n >= 1 {
                bits |= UPPER_1 | LOWER_1;
            }
            if n <= 0xa {
                bits |= UPPER_2 | LOWER_2;
            }
            t[n] = bits;
            n += 1;
        }
        t
    };
}

#[cfg(target_arch = "x86_64")]
#[cfg_attr(feature = "portable", allow(dead_code))] // only the tests call it then
mod x86 {
    use std::arch::x86_64::*;

    /// 32 bytes at a time. As signed bytes, everything outside 0x20..=0x7f is below 0x20 (bytes
    /// >= 0x80 are negative), so one `cmpgt` finds controls and non-ASCII together.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn avx2(s: &[u8]) -> Option<usize> {
        let (quote, backslash, space) = (
            _mm256_set1_epi8(b'"' as i8),
            _mm256_set1_epi8(b'\\' as i8),
            _mm256_set1_epi8(0x20),
        );
        let mut i = 0;
        while i + 32 <= s.len() {
            // SAFETY: bytes i..i+32 are inside `s` (loop condition); loadu has no alignment
            // requirement.
            let v = unsafe { _mm256_loadu_si256(s.as_ptr().add(i).cast()) };
            let hit = _mm256_or_si256(
                _mm256_or_si256(_mm256_cmpeq_epi8(v, quote), _mm256_cmpeq_epi8(v, backslash)),
                _mm256_cmpgt_epi8(space, v),
            );
            let mask = _mm256_movemask_epi8(hit) as u32;
            if mask != 0 {
                return Some(i + mask.trailing_zeros() as usize);
            }
            i += 32;
        }
        super::portable::scalar(&s[i..]).map(|j| i + j)
    }

    /// `base64_run`, 32 bytes at a time: each byte's two nibbles looked up in the `nibbles`
    /// tables with a byte shuffle; a zero AND of the two marks a byte outside the alphabet.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn run_avx2(s: &[u8]) -> usize {
        // SAFETY: the table is 16 bytes; loadu has no alignment requirement.
        let low = unsafe { _mm_loadu_si128(super::nibbles::LOW.as_ptr().cast()) };
        // SAFETY: the table is 16 bytes; loadu has no alignment requirement.
        let high = unsafe { _mm_loadu_si128(super::nibbles::HIGH.as_ptr().cast()) };
        let (low, high) = (
            _mm256_broadcastsi128_si256(low),
            _mm256_broadcastsi128_si256(high),
        );
        let (nibble, zero) = (_mm256_set1_epi8(0x0f), _mm256_setzero_si256());
        let mut i = 0;
        while i + 32 <= s.len() {
            // SAFETY: bytes i..i+32 are inside `s` (loop condition); loadu has no alignment
            // requirement.
            let v = unsafe { _mm256_loadu_si256(s.as_ptr().add(i).cast()) };
            let lo = _mm256_shuffle_epi8(low, _mm256_and_si256(v, nibble));
            let hi = _mm256_shuffle_epi8(high, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
            let outside = _mm256_cmpeq_epi8(_mm256_and_si256(lo, hi), zero);
            let mask = _mm256_movemask_epi8(outside) as u32;
            if mask != 0 {
                return i + mask.trailing_zeros() as usize;
            }
            i += 32;
        }
        i + super::portable::run_scalar(&s[i..])
    }

    /// `run_avx2`, 16 bytes at a time.
    ///
    /// # Safety
    /// The CPU must support SSSE3.
    #[target_feature(enable = "ssse3")]
    pub(crate) unsafe fn run_ssse3(s: &[u8]) -> usize {
        // SAFETY: the table is 16 bytes; loadu has no alignment requirement.
        let low = unsafe { _mm_loadu_si128(super::nibbles::LOW.as_ptr().cast()) };
        // SAFETY: the table is 16 bytes; loadu has no alignment requirement.
        let high = unsafe { _mm_loadu_si128(super::nibbles::HIGH.as_ptr().cast()) };
        let (nibble, zero) = (_mm_set1_epi8(0x0f), _mm_setzero_si128());
        let mut i = 0;
        while i + 16 <= s.len() {
            // SAFETY: bytes i..i+16 are inside `s` (loop condition); loadu has no alignment
            // requirement.
            let v = unsafe { _mm_loadu_si128(s.as_ptr().add(i).cast()) };
            let lo = _mm_shuffle_epi8(low, _mm_and_si128(v, nibble));
            let hi = _mm_shuffle_epi8(high, _mm_and_si128(_mm_srli_epi16(v, 4), nibble));
            let outside = _mm_cmpeq_epi8(_mm_and_si128(lo, hi), zero);
            let mask = _mm_movemask_epi8(outside) as u32;
            if mask != 0 {
                return i + mask.trailing_zeros() as usize;
            }
            i += 16;
        }
        i + super::portable::run_scalar(&s[i..])
    }

    /// The same, 16 bytes at a time.
    ///
    /// # Safety
    /// The CPU must support SSE2 (every x86_64 CPU does).
    #[target_feature(enable = "sse2")]
    pub(crate) unsafe fn sse2(s: &[u8]) -> Option<usize> {
        let (quote, backslash, space) = (
            _mm_set1_epi8(b'"' as i8),
            _mm_set1_epi8(b'\\' as i8),
            _mm_set1_epi8(0x20),
        );
        let mut i = 0;
        while i + 16 <= s.len() {
            // SAFETY: bytes i..i+16 are inside `s` (loop condition); loadu has no alignment
            // requirement.
            let v = unsafe { _mm_loadu_si128(s.as_ptr().add(i).cast()) };
            let hit = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                _mm_cmpgt_epi8(space, v),
            );
            let mask = _mm_movemask_epi8(hit) as u32;
            if mask != 0 {
                return Some(i + mask.trailing_zeros() as usize);
            }
            i += 16;
        }
        super::portable::scalar(&s[i..]).map(|j| i + j)
    }
}

#[cfg(target_arch = "aarch64")]
#[cfg_attr(feature = "portable", allow(dead_code))]
mod neon {
    use std::arch::aarch64::*;

    /// 16 bytes at a time: a lane is special when it equals `"` or `\`, is below 0x20 or
    /// above 0x7f; a block with any such lane is searched byte by byte for the first.
    pub(crate) fn find(s: &[u8]) -> Option<usize> {
        let mut i = 0;
        while i + 16 <= s.len() {
            // SAFETY: NEON is part of the aarch64 baseline (every aarch64 CPU has it), and
            // bytes i..i+16 are inside `s` (loop condition); vld1q_u8 needs no alignment.
            let any = unsafe {
                let v = vld1q_u8(s.as_ptr().add(i));
                let hit = vorrq_u8(
                    vorrq_u8(
                        vceqq_u8(v, vdupq_n_u8(b'"')),
                        vceqq_u8(v, vdupq_n_u8(b'\\')),
                    ),
                    vorrq_u8(vcltq_u8(v, vdupq_n_u8(0x20)), vcgtq_u8(v, vdupq_n_u8(0x7f))),
                );
                vmaxvq_u8(hit) != 0
            };
            if any {
                return super::portable::scalar(&s[i..i + 16]).map(|j| i + j);
            }
            i += 16;
        }
        super::portable::scalar(&s[i..]).map(|j| i + j)
    }
}

#[cfg(target_arch = "aarch64")]
#[cfg_attr(feature = "portable", allow(dead_code))]
mod neon_run {
    use std::arch::aarch64::*;

    /// `base64_run`, 16 bytes at a time, with the `nibbles` tables looked up by `tbl`; a block
    /// with a byte outside the alphabet is searched byte by byte for the first.
    pub(crate) fn run(s: &[u8]) -> usize {
        let mut i = 0;
        // SAFETY: NEON is part of the aarch64 baseline; each table is 16 bytes.
        let (low, high) = unsafe {
            (
                vld1q_u8(super::nibbles::LOW.as_ptr()),
                vld1q_u8(super::nibbles::HIGH.as_ptr()),
            )
        };
        while i + 16 <= s.len() {
            // SAFETY: NEON is part of the aarch64 baseline, and bytes i..i+16 are inside `s`
            // (loop condition); vld1q_u8 needs no alignment.
            let any = unsafe {
                let v = vld1q_u8(s.as_ptr().add(i));
                let lo = vqtbl1q_u8(low, vandq_u8(v, vdupq_n_u8(0x0f)));
                let hi = vqtbl1q_u8(high, vshrq_n_u8(v, 4));
                vminvq_u8(vandq_u8(lo, hi)) == 0
            };
            if any {
                return i + super::portable::run_scalar(&s[i..i + 16]);
            }
            i += 16;
        }
        i + super::portable::run_scalar(&s[i..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_agrees_with_the_scalar_search() {
        let mut text: Vec<u8> = (0..200).map(|i| b'A' + (i % 26) as u8).collect();
        let specials = [b'"', b'\\', 0x00, 0x1f, 0x80, 0xff, 0xc3];
        for &c in &specials {
            for at in [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 150, 199] {
                let saved = text[at];
                text[at] = c;
                for start in [0, 1, 5] {
                    let want = scalar(&text[start..]);
                    assert_eq!(find_special(&text[start..]), want);
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: SSE2 is part of x86_64; AVX2 is used only where it is detected.
                    unsafe {
                        assert_eq!(x86::sse2(&text[start..]), want);
                        if std::is_x86_feature_detected!("avx2") {
                            assert_eq!(x86::avx2(&text[start..]), want);
                        }
                    }
                    #[cfg(target_arch = "aarch64")]
                    assert_eq!(neon::find(&text[start..]), want);
                }
                text[at] = saved;
            }
        }
        assert_eq!(find_special(&text), None);
    }

    #[test]
    fn the_trailing_run_is_the_scalar_count_back_from_the_end() {
        let mut text: Vec<u8> = (0..9000).map(|i| b"Az09+/"[i % 6]).collect();
        assert_eq!(trailing_base64(&text), 9000);
        assert_eq!(trailing_base64(b""), 0);
        for at in [0, 1, 4095, 4096, 4903, 4904, 4905, 8999] {
            for c in [b'"', b'=', b'\\', 0xc3, b'\n'] {
                let saved = std::mem::replace(&mut text[at], c);
                let want = text.iter().rev().take_while(|&&c| is_base64(c)).count();
                assert_eq!(want, 8999 - at);
                assert_eq!(trailing_base64(&text), want, "byte {c:#x} at {at}");
                text[at] = saved;
            }
        }
    }

    #[test]
    fn every_base64_run_kernel_agrees_with_the_scalar_run_on_every_byte() {
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut text: Vec<u8> = (0..200).map(|i| alphabet[(i * 7) % 64]).collect();
        assert_eq!(base64_run(&text), 200);
        assert_eq!(base64_run(b""), 0);
        for c in 0..=255u8 {
            for at in [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 150, 199] {
                let saved = text[at];
                text[at] = c;
                for start in [0, 1, 5] {
                    let want = run_scalar(&text[start..]);
                    let is = is_base64(c);
                    assert_eq!(
                        want,
                        if is || at < start {
                            200 - start
                        } else {
                            at - start
                        }
                    );
                    assert_eq!(base64_run(&text[start..]), want, "byte {c:#x} at {at}");
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: each kernel runs only where its CPU feature is detected.
                    unsafe {
                        if std::is_x86_feature_detected!("ssse3") {
                            assert_eq!(x86::run_ssse3(&text[start..]), want);
                        }
                        if std::is_x86_feature_detected!("avx2") {
                            assert_eq!(x86::run_avx2(&text[start..]), want);
                        }
                    }
                    #[cfg(target_arch = "aarch64")]
                    assert_eq!(neon_run::run(&text[start..]), want);
                }
                text[at] = saved;
            }
        }
        assert_eq!(find_special(b""), None);
        assert_eq!(find_special(b"\x7f~ "), None);
    }
}
