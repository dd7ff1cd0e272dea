//! Bytes aligned to 8, so one allocation can be viewed as any element type without a copy
//! (numpy wants aligned data; a `Vec<u8>` only promises alignment 1).

#[cfg(target_endian = "big")]
compile_error!("routed_experts stores wire (little-endian) bytes as native ones; big-endian hosts are not supported");

#[derive(Clone, Default)]
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// `len` zero bytes (calloc: untouched pages cost nothing until written).
    pub fn zeroed(len: usize) -> Self {
        AlignedBytes {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    /// An empty buffer that can grow to `capacity` bytes without reallocating.
    pub fn with_capacity(capacity: usize) -> Self {
        AlignedBytes {
            words: Vec::with_capacity(capacity.div_ceil(8)),
            len: 0,
        }
    }

    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut out = AlignedBytes::zeroed(bytes.len());
        out.as_mut_bytes().copy_from_slice(bytes);
        out
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.words.capacity() * 8
    }

    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// View as elements; `len` must be a multiple of `size_of::<T>()` (payloads guarantee it).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }

    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_mut_bytes())
    }

    /// Append bytes, growing geometrically (amortised O(1) per byte).
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.grow(bytes.len()).copy_from_slice(bytes);
    }

    /// Lengthen by `n` bytes and return them for the caller to overwrite in full (their previous
    /// contents are unspecified). Capacity at least doubles when it runs out, so a run of
    /// appends costs about one copy of the final size.
    pub fn grow(&mut self, n: usize) -> &mut [u8] {
        let old = self.len;
        let need_words = (old + n).div_ceil(8);
        if need_words > self.words.len() {
            if need_words > self.words.capacity() {
                let target = need_words.max(self.words.capacity() * 2);
                self.words.reserve_exact(target - self.words.len());
            }
            self.words.resize(need_words, 0);
        }
        self.len = old + n;
        &mut self.as_mut_bytes()[old..]
    }

    /// Shorten to `len` bytes (keeps the allocation).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.words.truncate(len.div_ceil(8));
        }
    }
}

impl PartialEq for AlignedBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_truncates_and_views() {
        let mut b = AlignedBytes::with_capacity(3);
        b.extend_from_slice(&[1, 2, 3]);
        b.extend_from_slice(&[4, 5, 6, 7, 8, 9]);
        assert_eq!(b.as_bytes(), &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        b.truncate(4);
        assert_eq!(b.as_slice::<u16>(), &[0x0201, 0x0403]);
        b.extend_from_slice(&[10]);
        assert_eq!(b.as_bytes(), &[1, 2, 3, 4, 10]);
        assert_eq!(b.as_bytes().as_ptr() as usize % 8, 0);
    }
}
