//! A merged body as pieces, mostly slices of the two bodies it was merged from, with the base64
//! text it copies as it is checked on the way out.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use crate::error::Result;
use crate::kernels::b64;

use crate::body::Found;

/// The merged body as pieces (mostly slices of the inputs), so it is assembled with one copy
/// straight into its final buffer.
pub struct Spliced<'a> {
    pub(super) pieces: Vec<Piece<'a>>,
    pub(super) merged: usize,
    /// The decode body's routing values, as the merge found them.
    pub(super) decode: Vec<Found<'a>>,
}

/// One piece of a merged body.
#[derive(Debug)]
pub(super) enum Piece<'a> {
    /// Bytes copied as they are.
    Copy(Cow<'a, [u8]>),
    /// Whole base64 groups of a routing value, checked as they are copied: each chunk is checked
    /// while the copy has it in cache, so the text is read once. `whole` is the value's entire
    /// text and `context` where it sits, to report a bad character as the decoding path would.
    Base64 {
        text: &'a [u8],
        last: bool,
        whole: &'a [u8],
        /// The value's field, as the decoding path names it in an error (`data` of a compact
        /// sidecar, `vllm_npy` for vLLM's text).
        field: &'static str,
        context: String,
        /// `whole` was found to be base64 characters by the scan that read it
        /// (`SidecarFields::data_base64`): only lengths and padding are left to check.
        scanned: bool,
    },
}

/// Whether `text` (cut from `whole`) is valid on its own as whole base64 groups.
pub(super) fn groups_valid(text: &[u8], last: bool, scanned: bool) -> bool {
    if scanned {
        b64::groups_valid_scanned(text, last)
    } else {
        b64::groups_valid(text, last)
    }
}

impl<'a> From<Cow<'a, [u8]>> for Piece<'a> {
    fn from(bytes: Cow<'a, [u8]>) -> Self {
        Piece::Copy(bytes)
    }
}

impl Piece<'_> {
    fn len(&self) -> usize {
        match self {
            Piece::Copy(b) => b.len(),
            Piece::Base64 { text, .. } => text.len(),
        }
    }

    /// Say which choice the piece belongs to (for its error message).
    pub(super) fn in_choice(mut self, index: u64) -> Self {
        if let Piece::Base64 { context, .. } = &mut self {
            *context = format!("choice {index}: {context}");
        }
        self
    }

    /// Copy into the start of `out`, checking base64 on the way; return the rest of `out`.
    fn write<'o>(&self, out: &'o mut [MaybeUninit<u8>]) -> Result<&'o mut [MaybeUninit<u8>]> {
        let (text, last, whole, field, context, scanned) = match self {
            Piece::Copy(b) => return Ok(b64::write_uninit(out, b)),
            Piece::Base64 {
                text,
                last,
                whole,
                field,
                context,
                scanned,
            } => (*text, *last, *whole, *field, context, *scanned),
        };
        let (head, rest) = out.split_at_mut(text.len());
        let valid = if scanned {
            b64::copy_scanned(text, head, last)
        } else {
            b64::copy_checked(text, head, last)
        };
        if !valid {
            return Err(b64::error_in(whole, field).context(context));
        }
        Ok(rest)
    }
}

impl<'a> Spliced<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Piece::len).sum()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Write the body into `out` (which may be uninitialised), `len()` bytes long. Base64 text
    /// still to be checked is checked on the way: an error leaves `out` partly written.
    pub fn write_into(&self, out: &mut [MaybeUninit<u8>]) -> Result<()> {
        let mut rest = out;
        for piece in &self.pieces {
            rest = piece.write(rest)?;
        }
        Ok(())
    }

    /// The body as one vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        b64::try_filled_vec(self.len(), |out| self.write_into(out))
    }

    /// How many routing values of the decode body were merged (0: it carried none, and is
    /// returned as it is).
    pub fn merged_values(&self) -> usize {
        self.merged
    }

    /// The decode body's routing values, as the merge found them (what [`suspect_rows`](super::suspect_rows) looks
    /// at on the decode side).
    pub fn decode_values(&self) -> &[Found<'a>] {
        &self.decode
    }

    /// The body as slices in order, its base64 text checked, nothing copied: each slice is
    /// part of one of the two input bodies, or of this value (the small rewritten parts). For
    /// a server that writes them out with one vectored write instead of assembling the body.
    pub fn checked_slices(&self) -> Result<Vec<&[u8]>> {
        self.check()?;
        Ok(self
            .pieces
            .iter()
            .map(|piece| match piece {
                Piece::Copy(b) => &b[..],
                Piece::Base64 { text, .. } => text,
            })
            .collect())
    }

    /// The body's pieces in order, its base64 text checked, taken out of this value (which
    /// then holds none; what it says of the merge stays): borrowed pieces are parts of the two
    /// input bodies, owned ones the parts the merge wrote, handed over without a copy (a
    /// re-encoded routing value is most of the body).
    pub fn take_checked_parts(&mut self) -> Result<Vec<Cow<'a, [u8]>>> {
        self.check()?;
        Ok(std::mem::take(&mut self.pieces)
            .into_iter()
            .map(|piece| match piece {
                Piece::Copy(b) => b,
                Piece::Base64 { text, .. } => Cow::Borrowed(text),
            })
            .collect())
    }

    /// Check the base64 text the pieces copy as it is.
    fn check(&self) -> Result<()> {
        for piece in &self.pieces {
            if let Piece::Base64 {
                text,
                last,
                whole,
                field,
                context,
                scanned,
            } = piece
            {
                if !groups_valid(text, *last, *scanned) {
                    return Err(b64::error_in(whole, field).context(context));
                }
            }
        }
        Ok(())
    }
}
