//! Bytes aligned to 8, so one allocation can be viewed as any element type without a copy
//! (numpy wants aligned data; a `Vec<u8>` only promises alignment 1). Either owned, or a
//! read-only view of memory someone else keeps alive and unchanged (copied on first write).

use std::mem::MaybeUninit;
use std::sync::Arc;

#[cfg(target_endian = "big")]
compile_error!("routed_experts stores wire (little-endian) bytes as native ones; big-endian hosts are not supported");

/// Bytes aligned to 8: owned, or a read-only view of memory kept alive by its owner.
#[derive(Clone, Default)]
pub struct AlignedBytes {
    /// Owned memory; empty while `shared` holds the bytes.
    words: Vec<u64>,
    len: usize,
    /// Read-only memory someone else owns (a Python `bytes`, Ray's object store), viewed without
    /// a copy. Any mutation first copies it into `words` (copy on write).
    shared: Option<Shared>,
}

/// Memory kept alive and unchanged by `owner` for as long as the `Arc` lives.
#[derive(Clone)]
struct Shared {
    ptr: *const u8,
    _owner: Arc<dyn Send + Sync>,
}

// SAFETY: `Shared` is only made by `AlignedBytes::from_shared`, whose contract is that the memory
// stays valid and unchanged while the owner lives; it is only ever read, so reading it from
// any thread is as safe as reading a `&[u8]`.
unsafe impl Send for Shared {}
// SAFETY: as for Send: the memory is immutable, so shared references across threads are fine.
unsafe impl Sync for Shared {}

/// Outputs at least this large come from fresh `mmap`ed pages (glibc's largest mmap threshold),
/// each costing a page fault on first touch; below it, malloc's heap pages are mostly mapped.
pub const PREFAULT_MIN: usize = 32 << 20;

/// Make the first touch of `len` fresh bytes at `ptr`, about to be written, cheap: ask for
/// transparent huge pages (`MADV_HUGEPAGE`: one fault and one zeroing per 2 MiB instead of a
/// fault per 4 KiB page; measured 1.8 ms instead of 16.7 ms to write 42 MB of fresh pages on an
/// AMD EPYC VM, where writing mapped memory takes 1.6 ms). Where the kernel gives no huge pages
/// (transparent huge pages `never`), map the pages in one call instead (`MADV_POPULATE_WRITE`,
/// Linux 5.14+; 13.7 ms there). The memory is returned when freed either way. Only an
/// optimisation: ranges below `PREFAULT_MIN` (malloc's reused heap, which advice would mark for
/// good), other systems and older kernels are left to fault as usual. Public for the Python
/// binding, which fills arrays numpy allocated.
pub fn prefault(ptr: *mut u8, len: usize) {
    prepare(ptr, len, true);
}

/// [`prefault`], which pre-faults without huge pages only when `populate`.
fn prepare(ptr: *mut u8, len: usize, populate: bool) {
    #[cfg(target_os = "linux")]
    if len >= PREFAULT_MIN {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        const PAGE: usize = 4096;
        let start = (ptr as usize).div_ceil(PAGE) * PAGE;
        let end = (ptr as usize + len) / PAGE * PAGE;
        if end > start {
            let advice = if huge_pages_possible() {
                libc::MADV_HUGEPAGE
            } else if populate {
                MADV_POPULATE_WRITE
            } else {
                return;
            };
            // SAFETY: [start, end) lies inside the caller's allocation of `len` bytes at `ptr`
            // (rounded inwards to whole pages), a private anonymous mapping of its own (glibc
            // maps every allocation this large separately); neither advice changes contents,
            // so the call cannot break any Rust invariant. Failure is ignored (see above).
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, advice);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len, populate);
}

/// Whether the kernel may back advised memory with transparent huge pages (its setting is
/// `always` or `madvise`, not `never` or absent), read once.
#[cfg(target_os = "linux")]
fn huge_pages_possible() -> bool {
    static POSSIBLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POSSIBLE.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"))
    })
}

impl AlignedBytes {
    /// A view of `len` bytes at `ptr` without a copy, or `None` when `ptr` is not 8-aligned (the
    /// caller copies instead).
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes, and the memory must not change or be freed
    /// while `owner` (any clone of the `Arc`) lives.
    pub unsafe fn from_shared(
        ptr: *const u8,
        len: usize,
        owner: Arc<dyn Send + Sync>,
    ) -> Option<Self> {
        if ptr.is_null() || ptr as usize % 8 != 0 {
            return None;
        }
        Some(AlignedBytes {
            words: Vec::new(),
            len,
            shared: Some(Shared { ptr, _owner: owner }),
        })
    }

    /// The bytes before `at` and from it, as two views of this memory that both keep it alive
    /// (no copy). `at` must be a multiple of 8 (a view starts aligned) and at most the length.
    pub(crate) fn split_views(self, at: usize) -> (AlignedBytes, AlignedBytes) {
        assert!(
            at % 8 == 0 && at <= self.len,
            "split_views: {at} of {} bytes",
            self.len
        );
        let (ptr, owner): (*const u8, Arc<dyn Send + Sync>) = match self.shared {
            Some(s) => (s.ptr, s._owner),
            None => {
                // Moving the words into the `Arc` leaves their heap memory where it is.
                let words = Arc::new(self.words);
                (words.as_ptr().cast::<u8>(), words)
            }
        };
        let view = |from: usize, len: usize, owner: Arc<dyn Send + Sync>| {
            // SAFETY: [ptr + from, ptr + from + len) lies inside the memory `owner` keeps alive
            // and never changes (an `Arc`'d `Vec` that nothing mutates, or the owner of a view,
            // under `from_shared`'s contract); `ptr` is 8-aligned (words, or a view's start)
            // and `from` a multiple of 8, so the view's start is too.
            let v = unsafe { AlignedBytes::from_shared(ptr.wrapping_add(from), len, owner) };
            v.expect("split_views: an aligned start")
        };
        let len = self.len;
        (view(0, at, owner.clone()), view(at, len - at, owner))
    }

    /// Whether the bytes are a view of someone else's memory (no copy was made).
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Copy shared bytes into owned memory, before a mutation.
    fn own(&mut self) {
        if let Some(shared) = self.shared.take() {
            let mut words = vec![0u64; self.len.div_ceil(8)];
            // SAFETY: `shared.ptr` is valid for `self.len` bytes (from_shared's contract, and
            // `len` only ever shrinks while shared), and `words` holds at least that many.
            unsafe {
                std::ptr::copy_nonoverlapping(shared.ptr, words.as_mut_ptr().cast::<u8>(), self.len)
            };
            self.words = words;
        }
    }

    /// `len` zero bytes (calloc: untouched pages cost nothing until written).
    pub fn zeroed(len: usize) -> Self {
        let mut words = vec![0u64; len.div_ceil(8)];
        prefault(words.as_mut_ptr().cast(), len);
        AlignedBytes {
            words,
            len,
            shared: None,
        }
    }

    /// The bytes `fill` writes at the start of up to `capacity` bytes of fresh memory, nothing
    /// zeroed first (for tens of MB, zeroing is a second pass over every page): `fill` returns
    /// how many it wrote. The memory past them is given back. When `capacity` bytes cannot be
    /// reserved, `fill` gets no room at all (it is called either way, once).
    ///
    /// # Safety
    /// `fill` must have initialised the first `n` bytes of the slice it is given when it
    /// returns `n`, and `n` must not exceed the slice's length.
    pub(crate) unsafe fn written_up_to(
        capacity: usize,
        fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> usize,
    ) -> Self {
        let mut words: Vec<u64> = Vec::new();
        let capacity = match words.try_reserve_exact(capacity.div_ceil(8)) {
            Ok(()) => capacity,
            Err(_) => 0,
        };
        // Huge pages at most: `capacity` is a bound, often far above what `fill` writes, and
        // pre-faulting it would map memory never used.
        prepare(words.as_mut_ptr().cast(), capacity, false);
        let spare = words.spare_capacity_mut();
        // SAFETY: the spare capacity is at least `capacity.div_ceil(8)` words, so at least
        // `capacity` bytes, and `MaybeUninit<u8>` has no alignment or validity requirement.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<MaybeUninit<u8>>(), capacity)
        };
        let len = fill(bytes);
        assert!(len <= capacity, "written_up_to: wrote past its room");
        // The last word's bytes past `len` are not written: zero them, so every word is.
        let used = len.div_ceil(8);
        if len % 8 != 0 {
            let tail = &mut words.spare_capacity_mut()[used - 1];
            // SAFETY: the word's first `len % 8` bytes were written by `fill` (its contract);
            // the rest are zeroed here, byte by byte, before the word is read as a whole.
            unsafe {
                let p = tail.as_mut_ptr().cast::<u8>();
                std::ptr::write_bytes(p.add(len % 8), 0, 8 - len % 8);
            }
        }
        // SAFETY: the first `used` words are initialised: the first `len` bytes by `fill`,
        // the rest of the last word just above.
        unsafe { words.set_len(used) };
        if words.capacity() - used >= 512 {
            words.shrink_to_fit(); // glibc shrinks in place (mremap for large blocks): no copy
        }
        AlignedBytes {
            words,
            len,
            shared: None,
        }
    }

    /// An empty buffer that can grow to `capacity` bytes without reallocating.
    pub fn with_capacity(capacity: usize) -> Self {
        AlignedBytes {
            words: Vec::with_capacity(capacity.div_ceil(8)),
            len: 0,
            shared: None,
        }
    }

    /// A copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut out = AlignedBytes::zeroed(bytes.len());
        out.as_mut_bytes().copy_from_slice(bytes);
        out
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes it can hold without reallocating.
    pub fn capacity(&self) -> usize {
        match self.shared {
            Some(_) => self.len,
            None => self.words.capacity() * 8,
        }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.shared {
            // SAFETY: valid, unchanged memory of at least `len` bytes while `self` (which holds
            // the owner) lives: from_shared's contract; `len` only shrinks while shared.
            Some(s) => unsafe { std::slice::from_raw_parts(s.ptr, self.len) },
            None => &bytemuck::cast_slice(&self.words)[..self.len],
        }
    }

    /// The bytes, writable (a shared view is copied first).
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        self.own();
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// View as elements; `len` must be a multiple of `size_of::<T>()` (payloads guarantee it).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }

    /// View as mutable elements; `len` must be a multiple of `size_of::<T>()`.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_mut_bytes())
    }

    /// Append bytes, growing geometrically (amortised O(1) per byte).
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.grow(bytes.len()).copy_from_slice(bytes);
    }

    /// Room for `need_words` words of owned memory: capacity at least doubles when it runs out,
    /// so a run of appends costs about one copy of the final size.
    fn reserve_words(&mut self, need_words: usize) {
        if need_words > self.words.capacity() {
            let target = need_words.max(self.words.capacity() * 2);
            self.words.reserve_exact(target - self.words.len());
        }
    }

    /// Lengthen by `n` bytes and return them for the caller to overwrite in full (their previous
    /// contents are unspecified). Capacity at least doubles when it runs out, so a run of
    /// appends costs about one copy of the final size.
    pub fn grow(&mut self, n: usize) -> &mut [u8] {
        self.own();
        let old = self.len;
        let need_words = (old + n).div_ceil(8);
        if need_words > self.words.len() {
            self.reserve_words(need_words);
            self.words.resize(need_words, 0);
        }
        self.len = old + n;
        &mut self.as_mut_bytes()[old..]
    }

    /// Lengthen by the bytes `fill` writes into `n` bytes of room past the end, nothing zeroed
    /// first (a decoder's output is written once, not zeroed then overwritten): `fill` returns
    /// how many it wrote, and only those are kept. Capacity grows as [`AlignedBytes::grow`]'s.
    ///
    /// # Safety
    /// `fill` must have initialised the first `w` bytes of the room it is given when it returns
    /// `w`, and `w` must not exceed `n`.
    pub(crate) unsafe fn append_written(
        &mut self,
        n: usize,
        fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> usize,
    ) -> usize {
        self.own();
        let old = self.len;
        let end = old
            .checked_add(n)
            .expect("append_written: a length past usize");
        let need_words = end.div_ceil(8);
        self.reserve_words(need_words);
        let base = self.words.as_mut_ptr().cast::<MaybeUninit<u8>>();
        // SAFETY: the allocation holds `need_words` words, so bytes [old, old + n) lie inside
        // it; `MaybeUninit<u8>` has no alignment or validity requirement; nothing else borrows
        // `self.words` while the slice lives.
        let room = unsafe { std::slice::from_raw_parts_mut(base.add(old), n) };
        let written = fill(room);
        assert!(written <= n, "append_written: wrote past its room");
        let len = old + written;
        let words = len.div_ceil(8);
        if words > self.words.len() {
            // SAFETY: bytes [old, len) were written by `fill` (its contract), and every word
            // before `self.words.len()` was already initialised; the last new word's bytes past
            // `len` are zeroed here, so the first `words` words are all initialised.
            unsafe {
                std::ptr::write_bytes(base.add(len), 0, words * 8 - len);
                self.words.set_len(words);
            }
        }
        self.len = len;
        written
    }

    /// Shorten to `len` bytes (keeps the allocation).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.words.truncate(len.div_ceil(8)); // shared: a shorter view, no copy
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

    #[test]
    fn appends_only_the_bytes_written() {
        let mut b = AlignedBytes::default();
        b.extend_from_slice(&[1, 2, 3]);
        for (room, wrote) in [(13, 13), (20, 5), (9, 0), (1, 1)] {
            let before = b.as_bytes().to_vec();
            // SAFETY: the closure writes the first `wrote` bytes of its room.
            let n = unsafe {
                b.append_written(room, |r| {
                    assert_eq!(r.len(), room);
                    for (i, x) in r[..wrote].iter_mut().enumerate() {
                        x.write(100 + i as u8);
                    }
                    wrote
                })
            };
            assert_eq!(n, wrote);
            let want: Vec<u8> = before
                .iter()
                .copied()
                .chain((0..wrote).map(|i| 100 + i as u8))
                .collect();
            assert_eq!(b.as_bytes(), &want[..]);
            assert_eq!(b.words.len(), b.len().div_ceil(8));
            assert_eq!(b.as_bytes().as_ptr() as usize % 8, 0);
        }
        b.truncate(2);
        b.extend_from_slice(&[7]);
        assert_eq!(b.as_bytes(), &[1, 2, 7]);
    }

    #[test]
    fn splits_into_views_of_one_memory() {
        let mut owned = AlignedBytes::default();
        owned.extend_from_slice(&(0..21).collect::<Vec<u8>>());
        let at_ptr = owned.as_bytes().as_ptr();
        let (head, tail) = owned.split_views(16);
        assert!(head.is_shared() && tail.is_shared());
        assert_eq!(head.as_bytes(), &(0..16).collect::<Vec<u8>>()[..]);
        assert_eq!(tail.as_bytes(), &[16, 17, 18, 19, 20]);
        assert_eq!(head.as_bytes().as_ptr(), at_ptr, "no copy");
        assert_eq!(tail.as_bytes().as_ptr(), at_ptr.wrapping_add(16));
        drop(head); // the tail keeps the memory alive
        let (a, b) = tail.split_views(0);
        assert!(a.is_empty() && b.as_bytes() == [16, 17, 18, 19, 20]);
        let (c, d) = b.split_views(0);
        let mut c = c;
        c.extend_from_slice(&[9]); // a write copies first
        assert_eq!(
            (c.as_bytes(), d.as_bytes()),
            (&[9u8][..], &[16u8, 17, 18, 19, 20][..])
        );
    }

    #[test]
    fn shared_bytes_are_viewed_then_copied_on_write() {
        let source: Arc<Vec<u64>> = Arc::new(vec![0x0807060504030201, 0x100f0e0d0c0b0a09]);
        let ptr = source.as_ptr().cast::<u8>();
        let owner: Arc<dyn Send + Sync> = source.clone();
        // SAFETY: `source` is never mutated and lives in the owner.
        let mut b = unsafe { AlignedBytes::from_shared(ptr, 13, owner) }.unwrap();
        assert!(b.is_shared() && b.as_bytes().as_ptr() == ptr);
        assert_eq!(b.as_bytes(), &(1..=13).collect::<Vec<u8>>()[..]);
        let view = b.clone();
        b.truncate(4);
        assert!(b.is_shared() && b.as_bytes() == [1, 2, 3, 4]);
        b.extend_from_slice(&[9]);
        assert!(!b.is_shared() && b.as_bytes() == [1, 2, 3, 4, 9]);
        assert_eq!(view.as_bytes().len(), 13);
        let unaligned = source.clone() as Arc<dyn Send + Sync>;
        // SAFETY: as above.
        assert!(unsafe { AlignedBytes::from_shared(ptr.wrapping_add(1), 3, unaligned) }.is_none());
    }
}
