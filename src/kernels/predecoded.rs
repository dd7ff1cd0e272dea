//! Strings of a body held decoded instead of as text (a `BodyReader`'s, as the body arrived),
//! by the offset of the placeholder left in their place: the scanner hands them out where it
//! meets those placeholders.

use std::collections::HashMap;
use std::sync::Arc;

use super::buffer::AlignedBytes;

/// The placeholders of a body: where each one's opening quote is, and its string's bytes.
#[derive(Debug, Default)]
pub(crate) struct Predecoded {
    at: HashMap<usize, Arc<AlignedBytes>>,
}

impl Predecoded {
    /// The placeholder whose opening quote is at `offset` stands for `bytes`.
    pub(crate) fn insert(&mut self, offset: usize, bytes: Arc<AlignedBytes>) {
        self.at.insert(offset, bytes);
    }

    /// Every placeholder, in body order: (its opening quote's offset, its bytes).
    pub(crate) fn in_order(&self) -> Vec<(usize, &AlignedBytes)> {
        let mut all: Vec<_> = self.at.iter().map(|(o, b)| (*o, b.as_ref())).collect();
        all.sort_unstable_by_key(|(o, _)| *o);
        all
    }

    /// The bytes of the placeholder whose opening quote is at `offset`, as a view (no copy),
    /// or `None` where no placeholder is.
    pub(crate) fn at(&self, offset: usize) -> Option<AlignedBytes> {
        let bytes = self.at.get(&offset)?;
        let owner: Arc<dyn Send + Sync> = bytes.clone();
        // SAFETY: the view's memory is `bytes`' own (owned, 8-aligned words), which nothing
        // mutates (it is only reached through this `Arc`, never mutably) and which lives while
        // `owner`, a clone of the `Arc`, does.
        unsafe { AlignedBytes::from_shared(bytes.as_bytes().as_ptr(), bytes.len(), owner) }
    }
}
