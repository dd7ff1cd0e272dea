//! vLLM's routing (0.22 and later): base64 of a whole `.npy` file, a JSON string at the choice
//! (or passed through Dynamo's `nvext`). No start: rows `[S, P + G - 1)` for the start `S` asked.
//! The `.npy` header itself is `npy.rs`.

use super::declared::{check_named, Hints, Producer};
use super::npy;
use super::places::{Place, Rule};
use crate::error::{Error, Result};
use crate::kernels::b64;
use crate::kernels::buffer::AlignedBytes;
use crate::payload::Payload;

/// vLLM's producer entry.
pub(super) const PRODUCER: Producer = Producer {
    name: "vllm_npy",
    described: "vLLM's .npy",
    detects,
    decode,
    encode,
    last_resort: false,
    json_string: true,
    writes_at: &[Place::Choice, Place::Nvext],
    rule: |_| Rule::EndsBeforeLastToken,
    ignores_start: Some(
        "vLLM before 0.28 ignores routed_experts_prompt_start on /v1/completions and \
         /v1/chat/completions",
    ),
};

/// How a base64 `.npy` file begins (the magic `\x93NUMPY`): what `detect` reads as vLLM's format.
pub const NPY_B64_PREFIX: &[u8] = b"k05VTVBZ";

fn decode(text: &[u8], hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let len = b64::decoded_len(text, "vllm_npy").map_err(|e| e.context("vllm_npy"))?;
    crate::limits::check(len, max_bytes.saturating_add(4096))?;
    if let Some(p) = in_place(text, len, hints, max_bytes) {
        return Ok(p);
    }
    whole_file(text, len, hints, max_bytes)
}

/// The file decoded as a whole, for what the direct path does not take: the same errors, in
/// the same order, as ever (a bad character anywhere before a bad header).
fn whole_file(text: &[u8], len: usize, hints: &Hints, max_bytes: usize) -> Result<Payload> {
    // Decode the whole file once, then move the data to the front of the same buffer.
    let mut file = AlignedBytes::zeroed(len);
    b64::decode_into(text, file.as_mut_bytes(), "vllm_npy")?;
    let h = npy::parse_header(file.as_bytes())?;
    crate::limits::check_shape(h.shape, h.dtype, max_bytes)?;
    let want = h.shape.nbytes(h.dtype)?;
    let have = len - h.data_offset;
    if have != want {
        return Err(Error::malformed(format!(
            "vllm_npy: expected {want} data bytes for shape {} of {}, got {have}",
            h.shape, h.dtype
        )));
    }
    file.as_mut_bytes().copy_within(h.data_offset.., 0);
    file.truncate(want);
    let p = Payload::new(hints.start.unwrap_or(0), h.shape, h.dtype, file)?;
    check_named(PRODUCER.name, &p.header(), hints)?;
    Ok(p)
}

/// Characters of a `.npy` file's base64 decoded first for its header: 4095 bytes (a whole
/// number of groups), far more than any header vLLM writes (128 bytes).
#[cfg(not(any(test, fuzzing)))]
const NPY_HEAD: usize = 4095;
/// The tests and the fuzzer take a short head, so that small files go through both parts.
#[cfg(any(test, fuzzing))]
const NPY_HEAD: usize = 132;

/// A `.npy` file of `len` bytes in base64 `text`, decoded straight into the payload's memory:
/// the header from the first groups, then the data where it belongs (no zeroing, no move to the
/// front, the decode split among the cores). `None` for anything it does not take (a header
/// past `NPY_HEAD`, any error), which the whole-file path then reads, for its errors.
fn in_place(text: &[u8], len: usize, hints: &Hints, max_bytes: usize) -> Option<Payload> {
    let head_len = len.min(NPY_HEAD);
    let head = b64::decode_range(text, 0, head_len).ok()?;
    let h = npy::parse_header(&head).ok()?;
    crate::limits::check_shape(h.shape, h.dtype, max_bytes).ok()?;
    let want = h.shape.nbytes(h.dtype).ok()?;
    if len.checked_sub(h.data_offset)? != want {
        return None;
    }
    let in_head = &head[h.data_offset..];
    // The groups after the head's (it ends on a group unless it is the whole file).
    let rest = if head_len == len {
        &[][..]
    } else {
        &text[head_len / 3 * 4..]
    };
    let mut decoded = false;
    // SAFETY: the closure reports `want` bytes written only when all of them were: the
    // header's share copied, the rest decoded whole (`decode_uninit` returned true).
    let data = unsafe {
        AlignedBytes::written_up_to(want, |out| {
            if out.len() < want {
                return 0;
            }
            let (first, second) = out[..want].split_at_mut(in_head.len());
            b64::write_uninit(first, in_head);
            decoded = b64::decode_uninit(rest, second);
            if decoded {
                want
            } else {
                0
            }
        })
    };
    if !decoded {
        return None;
    }
    let p = Payload::new(hints.start.unwrap_or(0), h.shape, h.dtype, data).ok()?;
    check_named(PRODUCER.name, &p.header(), hints).ok()?;
    Some(p)
}

fn detects(text: &[u8]) -> bool {
    text.starts_with(NPY_B64_PREFIX)
}

fn encode(p: &Payload) -> Result<Vec<u8>> {
    let mut file = npy::write_header(p.dtype(), p.shape());
    file.extend_from_slice(p.bytes());
    Ok(b64::encode(&file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::payload::dtype::DType;
    use crate::payload::{DTypeChoice, Shape};

    /// The direct `.npy` path takes only what the whole-file path reads the same way, and the
    /// files it passes on keep their old errors: sound and flawed files, header and data.
    #[test]
    fn npy_in_place_agrees_with_the_whole_file() {
        let mut next = crate::test_rng::xorshift(0x1234_5678_9abc_def1u64);
        let flaws: [&[u8]; 7] = [b"*", b"=", b" ", b"A", b"/", b"    ", b"A==="];
        let (mut direct, mut sound) = (0, 0);
        for tokens in [0usize, 1, 2, 3, 5, 17, 40, 100] {
            for dtype in DType::ALL {
                let values: Vec<i64> = (0..tokens * 6).map(|_| (next() % 100) as i64).collect();
                let p = Payload::from_values(
                    &values,
                    Shape::new(tokens, 3, 2),
                    0,
                    DTypeChoice::Exact(dtype),
                )
                .unwrap();
                let text = encode(&p).unwrap();
                for trial in 0..12 {
                    let mut t = text.clone();
                    if trial > 0 {
                        let at = next() as usize % t.len();
                        let pick = next() as usize % flaws.len();
                        let replaced = if pick >= 5 { at..at } else { at..at + 1 };
                        t.splice(replaced, flaws[pick].iter().copied());
                    }
                    let Ok(len) = b64::decoded_len(&t, "vllm_npy") else {
                        continue;
                    };
                    let whole = whole_file(&t, len, &Hints::default(), DEFAULT_MAX_BYTES);
                    sound += usize::from(whole.is_ok());
                    if let Some(q) = in_place(&t, len, &Hints::default(), DEFAULT_MAX_BYTES) {
                        direct += 1;
                        assert_eq!(
                            Some(&q),
                            whole.as_ref().ok(),
                            "{:?}",
                            String::from_utf8_lossy(&t)
                        );
                    }
                    let got = decode(&t, &Hints::default(), DEFAULT_MAX_BYTES);
                    assert_eq!(format!("{got:?}"), format!("{whole:?}"));
                }
                assert!(in_place(
                    &text,
                    b64::decoded_len(&text, "x").unwrap(),
                    &Hints::default(),
                    DEFAULT_MAX_BYTES
                )
                .is_some());
            }
        }
        // Both paths ran: most sound files went the direct way.
        assert!(
            direct > 100 && direct <= sound,
            "{direct} direct of {sound} sound"
        );
    }
}
