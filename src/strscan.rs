//! The search inside a JSON string: the first byte that is a quote, a backslash, or anything
//! that is not printable ASCII (a control character, or the start of a multi-byte UTF-8
//! sequence). One SIMD comparison finds all three, so checking a string's content costs nothing
//! beyond finding its end: routing bodies are megabytes of base64, all printable ASCII.

/// Index of the first byte of `s` that is `"`, `\`, below 0x20 or above 0x7f.
///
/// x86_64: AVX2 when the CPU has it, else SSE2; aarch64: NEON; elsewhere, or with the feature
/// `portable` (which the tests use to run every caller through it), the portable loop.
pub fn find_special(s: &[u8]) -> Option<usize> {
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

fn is_special(c: u8) -> bool {
    c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c)
}

fn scalar(s: &[u8]) -> Option<usize> {
    s.iter().position(|&c| is_special(c))
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
    pub unsafe fn avx2(s: &[u8]) -> Option<usize> {
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
        super::scalar(&s[i..]).map(|j| i + j)
    }

    /// The same, 16 bytes at a time.
    ///
    /// # Safety
    /// The CPU must support SSE2 (every x86_64 CPU does).
    #[target_feature(enable = "sse2")]
    pub unsafe fn sse2(s: &[u8]) -> Option<usize> {
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
        super::scalar(&s[i..]).map(|j| i + j)
    }
}

#[cfg(target_arch = "aarch64")]
#[cfg_attr(feature = "portable", allow(dead_code))]
mod neon {
    use std::arch::aarch64::*;

    /// 16 bytes at a time: a lane is special when it equals `"` or `\`, is below 0x20 or
    /// above 0x7f; a block with any such lane is searched byte by byte for the first.
    pub fn find(s: &[u8]) -> Option<usize> {
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
                return super::scalar(&s[i..i + 16]).map(|j| i + j);
            }
            i += 16;
        }
        super::scalar(&s[i..]).map(|j| i + j)
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
        assert_eq!(find_special(b""), None);
        assert_eq!(find_special(b"\x7f~ "), None);
    }
}
