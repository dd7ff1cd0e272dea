//! A merged body as pieces, mostly slices of the two bodies it was merged from, with the base64
//! text it copies as it is checked on the way out.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use crate::error::{Error, Result};
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
    /// Whole base64 groups of a routing value, checked as they are copied.
    Base64(CopiedBase64<'a>),
    /// The base64 text of bytes `[from, to)` of the file `text` encodes, a multiple of 3 bytes
    /// from groups before `text`'s last, all of whose characters the scan found to be base64
    /// characters: text that decodes whatever it holds, so it can be written when it is sent.
    Recode(Recoded<'a>),
}

/// Whole base64 groups of a routing value, copied as they are and checked as they are copied:
/// each chunk is checked while the copy has it in cache, so the text is read once.
#[derive(Debug)]
pub(super) struct CopiedBase64<'a> {
    /// The groups.
    pub(super) text: &'a [u8],
    /// They end the value (so may end in padding).
    pub(super) last: bool,
    /// The value's entire text, to report a bad character as the decoding path would.
    pub(super) whole: &'a [u8],
    /// The value's field, as the decoding path names it in an error (`data` of a compact
    /// sidecar, `vllm_npy` for vLLM's text).
    pub(super) field: &'static str,
    /// Where the value sits (`prefill`, `choice 1: decode`), before the error's message.
    pub(super) context: String,
    /// `whole` was found to be base64 characters by the scan that read it
    /// (`SidecarFields::data_base64`): only lengths and padding are left to check.
    pub(super) scanned: bool,
}

impl CopiedBase64<'_> {
    /// Whether the groups hold only what base64 may (all of it, or only the length and the
    /// padding where the scan checked the characters).
    fn valid(&self) -> bool {
        groups_valid(self.text, self.last, self.scanned)
    }

    /// The error the decoding path gives for the value.
    fn error(&self) -> Error {
        b64::error_in(self.whole, self.field).context(&self.context)
    }

    /// Copy into the start of `out`, checking on the way; return the rest of `out`.
    fn write<'o>(&self, out: &'o mut [MaybeUninit<u8>]) -> Result<&'o mut [MaybeUninit<u8>]> {
        let (head, rest) = out.split_at_mut(self.text.len());
        let valid = if self.scanned {
            b64::copy_scanned(self.text, head, self.last)
        } else {
            b64::copy_checked(self.text, head, self.last)
        };
        match valid {
            true => Ok(rest),
            false => Err(self.error()),
        }
    }
}

/// Base64 text re-encoded from other base64 text on another byte grid (vLLM's `.npy` rows,
/// which start 128 bytes into the file, written as a compact sidecar's data, which starts at
/// the first row), left to be written as it is sent: a piece at a time, each encoded while
/// the bytes it was decoded from are in the core's cache, instead of all of it at once into a
/// buffer the size of the body. Made only of text found to be base64 characters, from groups
/// before its last, so that its decoding cannot fail.
#[derive(Debug, Clone, Copy)]
pub struct Recoded<'a> {
    text: &'a [u8],
    from: usize,
    to: usize,
}

impl<'a> Recoded<'a> {
    /// Bytes `range` of the file base64 `text` encodes, when they are whole 3-byte groups'
    /// worth from groups before `text`'s last (else `None`). Writing them fails where `text`
    /// is not base64 characters; a merge makes them only of text it found to be, so theirs
    /// does not (a server that keeps a part's text and range makes it again from them).
    pub fn new(text: &'a [u8], range: std::ops::Range<usize>) -> Option<Self> {
        let last_group = (text.len() / 4).checked_sub(1)?;
        let fits = range.start < range.end
            && (range.end - range.start) % 3 == 0
            && (range.end - 1) / 3 < last_group;
        fits.then_some(Recoded {
            text,
            from: range.start,
            to: range.end,
        })
    }

    /// Bytes `[from, to)` of the file `text` encodes, written after an output that holds `held`
    /// bytes of an unfinished group: where the bytes that finish that group end (`head`), and
    /// the largest part from there that can be left to be written as it is sent (whole groups'
    /// worth, short of `text`'s last group, whose padding decoding checks), if any.
    pub(crate) fn largest_after(
        text: &'a [u8],
        (from, to): (usize, usize),
        held: usize,
    ) -> (usize, Option<Self>) {
        let head = from + ((3 - held % 3) % 3).min(to - from);
        let last_group_at = (text.len() / 4).saturating_sub(1) * 3;
        let end = head + to.min(last_group_at).saturating_sub(head) / 3 * 3;
        (head, Recoded::new(text, head..end))
    }

    /// The base64 text the bytes come from (what a caller holds on to until it is written).
    pub fn text(&self) -> &'a [u8] {
        self.text
    }

    /// The bytes of the file `text` encodes whose text this is.
    pub fn bytes(&self) -> std::ops::Range<usize> {
        self.from..self.to
    }

    /// Length of its text.
    pub fn len(&self) -> usize {
        (self.to - self.from) / 3 * 4
    }

    /// Whether it is empty (never, as made).
    pub fn is_empty(&self) -> bool {
        self.to == self.from
    }

    /// Appends to `out` the text of its bytes `[at, at + n)` (counted from its first byte;
    /// both multiples of 3, within its bytes), decoded and encoded again a block at a time (or,
    /// when its bytes start on a group of `text`, copied from `text` as it is checked).
    pub fn write_part(&self, at: usize, n: usize, out: &mut Vec<u8>) -> Result<()> {
        let within = at
            .checked_add(n)
            .is_some_and(|end| end <= self.to - self.from);
        if !within || at % 3 != 0 || n % 3 != 0 {
            return Err(crate::error::Error::field(
                "at",
                format!(
                    "a part of the {} recoded bytes, on 3-byte groups",
                    self.to - self.from
                ),
                format!("{n} bytes at {at}"),
            ));
        }
        let from = self.from + at;
        if self.from % 3 == 0 {
            // On the text's own grid (a stream's `.npy` rows kept as `.npy`, a sidecar's rows):
            // the text is its own encoding, checked and copied instead of decoded and encoded.
            let groups = &self.text[from / 3 * 4..(from + n) / 3 * 4];
            if !b64::groups_valid(groups, false) {
                return Err(b64::error_in(self.text, "data"));
            }
            out.extend_from_slice(groups);
            return Ok(());
        }
        let mut scratch = Vec::new();
        // Blocks of whole groups (but the last, which ends with the range): no padding inside.
        b64::decode_range_blocks(self.text, from, from + n, &mut scratch, |block| {
            crate::kernels::b64_pieces::encode(block, out)
        })
    }

    /// Its whole text appended to `out` in parts of the lengths `size` gives (multiples of 3),
    /// as a server writes it: the tests' way of sending it.
    #[cfg(test)]
    pub(crate) fn write_in_parts(&self, mut size: impl FnMut() -> usize, out: &mut Vec<u8>) {
        let n = self.to - self.from;
        let mut at = 0;
        while at < n {
            let k = size().min(n - at);
            self.write_part(at, k, out)
                .expect("a merge's recoded text always writes");
            at += k;
        }
    }

    /// Its whole text.
    fn encoded(&self) -> Result<Vec<u8>> {
        let mut text = Vec::with_capacity(self.len());
        self.write_part(0, self.to - self.from, &mut text)?;
        Ok(text)
    }
}

/// One part of a merged body as [`Spliced::take_checked_recoded_parts`] hands it over.
#[derive(Debug)]
pub enum Part<'a> {
    /// Bytes to send as they are: borrowed from the two input bodies, or written by the merge.
    Bytes(Cow<'a, [u8]>),
    /// Text to write as it is sent ([`Recoded::write_part`]).
    Recoded(Recoded<'a>),
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
            Piece::Base64(b) => b.text.len(),
            Piece::Recode(r) => r.len(),
        }
    }

    /// Say which choice the piece belongs to (for its error message).
    pub(super) fn in_choice(mut self, index: u64) -> Self {
        if let Piece::Base64(b) = &mut self {
            b.context = format!("choice {index}: {}", b.context);
        }
        self
    }

    /// Copy into the start of `out`, checking base64 on the way; return the rest of `out`.
    fn write<'o>(&self, out: &'o mut [MaybeUninit<u8>]) -> Result<&'o mut [MaybeUninit<u8>]> {
        match self {
            Piece::Copy(b) => Ok(b64::write_uninit(out, b)),
            Piece::Recode(r) => Ok(b64::write_uninit(out, &r.encoded()?)),
            Piece::Base64(b) => b.write(out),
        }
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
        if out.len() != self.len() {
            let expected = format!("{} bytes (the body's len())", self.len());
            return Err(Error::field("out", expected, out.len()));
        }
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
        self.pieces
            .iter()
            .map(|piece| match piece {
                Piece::Copy(b) => Ok(&b[..]),
                Piece::Base64(b) => Ok(b.text),
                Piece::Recode(_) => Err(recoded_error()),
            })
            .collect()
    }

    /// The body's pieces in order, its base64 text checked, taken out of this value (which
    /// then holds none; what it says of the merge stays): borrowed pieces are parts of the two
    /// input bodies, owned ones the parts the merge wrote, handed over without a copy (a
    /// re-encoded routing value is most of the body).
    pub fn take_checked_parts(&mut self) -> Result<Vec<Cow<'a, [u8]>>> {
        self.take_checked_recoded_parts()?
            .into_iter()
            .map(|part| match part {
                Part::Bytes(b) => Ok(b),
                Part::Recoded(r) => Ok(Cow::Owned(r.encoded()?)),
            })
            .collect()
    }

    /// [`take_checked_parts`](Self::take_checked_parts), with the text the merge would encode
    /// again from other text left to be written as it is sent ([`Part::Recoded`]): a server
    /// writes it a piece at a time, each piece while its source is in the core's cache.
    pub fn take_checked_recoded_parts(&mut self) -> Result<Vec<Part<'a>>> {
        self.check()?;
        Ok(std::mem::take(&mut self.pieces)
            .into_iter()
            .map(|piece| match piece {
                Piece::Copy(b) => Part::Bytes(b),
                Piece::Base64(b) => Part::Bytes(Cow::Borrowed(b.text)),
                Piece::Recode(r) => Part::Recoded(r),
            })
            .collect())
    }

    /// Check the base64 text the pieces copy as it is.
    fn check(&self) -> Result<()> {
        for piece in &self.pieces {
            if let Piece::Base64(b) = piece {
                if !b.valid() {
                    return Err(b.error());
                }
            }
        }
        Ok(())
    }
}

/// `text[from..to]` (whole groups) as a piece checked while it is copied (or, when the scan
/// that read `text` found it to be base64 characters, `scanned`, only for its length and
/// padding); text that had escapes (so is owned, not borrowed from the body) is checked here
/// and copied as it is.
pub(super) fn checked_copy<'a>(
    text: &Cow<'a, [u8]>,
    from: usize,
    to: usize,
    side: &'static str,
    scanned: bool,
) -> Result<Piece<'a>> {
    let last = to == text.len();
    match text {
        Cow::Borrowed(t) => Ok(Piece::Base64(CopiedBase64 {
            text: &t[from..to],
            last,
            whole: t,
            field: "data",
            context: side.to_string(),
            scanned,
        })),
        Cow::Owned(t) => {
            if !b64::groups_valid(&t[from..to], last) {
                return Err(b64::error_in(t, "data").context(side));
            }
            Ok(Piece::Copy(Cow::Owned(t[from..to].to_vec())))
        }
    }
}

/// `checked_slices` is for bodies that are all slices; one with text left to encode has none
/// to give for it.
fn recoded_error() -> crate::error::Error {
    crate::error::Error::field(
        "pieces",
        "slices of the bodies",
        "text left to be encoded (take_checked_recoded_parts writes it)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recoded_text_is_made_of_whole_groups_before_the_last_and_written_in_parts() {
        let file: Vec<u8> = (0..=200u8).collect();
        let text = b64::encode(&file); // 67 groups, the last padded
        assert!(Recoded::new(&text, 5..5).is_none()); // empty
        assert!(Recoded::new(&text, 5..9).is_none()); // not whole groups' worth
        assert!(Recoded::new(&text, 5..200).is_none()); // reaches the last group
        assert!(Recoded::new(&[], 0..3).is_none());
        let r = Recoded::new(&text, 5..197).unwrap(); // the last group starts at byte 198
        assert_eq!((r.bytes(), r.len(), r.is_empty()), (5..197, 256, false));
        let mut out = Vec::new();
        for (at, n) in [(0, 3), (3, 90), (93, 99)] {
            r.write_part(at, n, &mut out).unwrap();
        }
        assert_eq!(out, b64::encode(&file[5..197]));
        // On the text's own grid: copied as checked, the same text.
        let on_grid = Recoded::new(&text, 6..195).unwrap();
        let mut copied = Vec::new();
        for (at, n) in [(0, 9), (9, 3), (12, 177)] {
            on_grid.write_part(at, n, &mut copied).unwrap();
        }
        assert_eq!(copied, b64::encode(&file[6..195]));
        // Text that is not base64 does not write, on the grid or off it.
        let mut bad = text.clone();
        bad[100] = b'*';
        for range in [6..195, 5..197] {
            let r = Recoded::new(&bad, range).unwrap();
            let err = r.write_part(0, r.bytes().len(), &mut Vec::new());
            assert!(err.unwrap_err().to_string().contains("data"));
        }
        for (at, n) in [(1, 3), (0, 4), (0, 195), (usize::MAX - 2, 3)] {
            let err = r.write_part(at, n, &mut out).unwrap_err().to_string();
            assert!(
                err.contains("at") && err.contains("192 recoded bytes"),
                "{err}"
            );
        }
        let spliced = Spliced {
            pieces: vec![Piece::Copy(Cow::Borrowed(b"[")), Piece::Recode(r)],
            merged: 1,
            decode: Vec::new(),
        };
        assert_eq!(spliced.len(), 257);
        assert!(spliced.checked_slices().is_err());
        let mut want = b"[".to_vec();
        want.extend(b64::encode(&file[5..197]));
        assert_eq!(spliced.to_vec().unwrap(), want);
        // A buffer of another length is refused, never written past its end.
        for n in [256, 258] {
            let mut out = vec![MaybeUninit::uninit(); n];
            let e = spliced.write_into(&mut out).unwrap_err();
            assert!(
                e.to_string().starts_with("`out`: expected 257 bytes"),
                "{e}"
            );
        }
        let mut spliced = spliced;
        assert_eq!(spliced.take_checked_parts().unwrap().concat(), want);
    }
}
