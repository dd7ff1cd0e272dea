//! The tests of `b64`.

use super::*;

#[test]
fn two_slices_encode_as_their_join() {
    // Every split of every length up to 3 groups: the straddling group may be missing,
    // short, or end the text (padding), and `b` may start on any group boundary.
    let bytes: Vec<u8> = (0u8..12)
        .map(|i| i.wrapping_mul(97).wrapping_add(13))
        .collect();
    for n in 0..=bytes.len() {
        for cut in 0..=n {
            let (a, b) = bytes[..n].split_at(cut);
            let joined = filled_vec(encoded_len(n), |out| encode_joined_into(a, b, out));
            assert_eq!(joined, encode(&bytes[..n]), "{cut} of {n}");
        }
    }
}

#[test]
fn round_trip_and_errors() {
    // Up to 200 bytes: split among threads under test (`parallel::MIN_BYTES_PER_THREAD`).
    for n in (0..20).chain([47, 48, 49, 100, 200]) {
        let bytes: Vec<u8> = (0..n as u8).map(|b| b.wrapping_mul(37)).collect();
        let text = encode(&bytes);
        let mut one = vec![MaybeUninit::new(0); text.len()];
        encode_part(&bytes, &mut one);
        assert_eq!(text, bytes_of(&one));
        let mut back = vec![0; decoded_len(&text, "data").unwrap()];
        decode_into(&text, &mut back, "data").unwrap();
        assert_eq!(back, bytes);
    }
    assert!(decoded_len(b"abc", "data").is_err());
    let text = encode(b"abcdefghij");
    for start in 0..10 {
        for end in start..=10 {
            assert_eq!(
                decode_range(&text, start, end).unwrap(),
                b"abcdefghij"[start..end].to_vec()
            );
        }
    }
    // Padding inside the text is refused, not decoded to a short group (and never sliced).
    for (start, end) in [(0, 1), (1, 2), (2, 3), (0, 3)] {
        assert!(decode_range(b"AA==BA==", start, end).is_err());
    }
    assert_eq!(decode_range(b"AAADBA==", 2, 4).unwrap(), vec![3, 4]);
    let mut out = [0u8; 3];
    let e = decode_into(b"ab*d", &mut out, "data")
        .unwrap_err()
        .to_string();
    assert!(e.contains("'*' at offset 2"), "{e}");
}

/// The bytes of `v`, every one of which the test initialised (`MaybeUninit::new`) before
/// the code under test may have overwritten it.
fn bytes_of(v: &[MaybeUninit<u8>]) -> Vec<u8> {
    // SAFETY: every element was made initialised, and writes only ever store bytes.
    v.iter().map(|b| unsafe { b.assume_init() }).collect()
}

/// What `decode_string_content` must agree with: find the string's end, then decode it.
fn scan_then_decode(text: &[u8], room: usize) -> Option<(usize, Vec<u8>)> {
    let end = crate::kernels::strscan::find_special(text).filter(|&i| text[i] == b'"')?;
    let content = &text[..end];
    if !content.iter().all(|&c| is_alphabet(c) || c == b'=') {
        return None;
    }
    let n = decoded_len(content, "data").ok().filter(|&n| n <= room)?;
    let mut out = vec![0; n];
    decode_into(content, &mut out, "data").ok()?;
    Some((end, out))
}

#[test]
fn streamed_decoding_agrees_with_a_scan_then_a_decode() {
    let mut next = crate::test_rng::xorshift(0x9e37_79b9_7f4a_7c15u64);
    // Across the sequential steps, the threads' steps and the last piece (8-character steps
    // under test), with every kind of flaw at every place, and outputs too small.
    for len in 0..200usize {
        let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        let mut doc = encode(&bytes);
        doc.extend_from_slice(b"\",\"shape\":[1,1,1]}");
        let end = doc.len() - 18;
        // Each replaces a character; the last two are inserted, keeping the length a
        // multiple of 4 (white space the decoder skips, padding in the middle).
        let flaws: [&[u8]; 10] = [
            b"\"", b"\\", b"=", b" ", b"\n", b"\xc3", b"*", b"A", b"    ", b"A===",
        ];
        for trial in 0..8 {
            let mut text = doc.clone();
            if trial > 0 && end > 0 {
                let at = next() as usize % end;
                let pick = next() as usize % flaws.len();
                let replaced = if pick >= 8 { at..at } else { at..at + 1 };
                text.splice(replaced, flaws[pick].iter().copied());
            }
            let exact = scan_then_decode(&text, usize::MAX).map_or(0, |(_, d)| d.len());
            for room in [exact, exact.saturating_sub(1), exact + 5, 0] {
                let mut out = vec![MaybeUninit::new(0xAA); room];
                let got = decode_string_content(&text, &mut out);
                match (got, scan_then_decode(&text, room)) {
                    (Streamed::Decoded { end, written }, Some((want_end, want))) => {
                        assert_eq!(end, want_end);
                        let out = bytes_of(&out[..written]);
                        assert_eq!(out, want, "{:?}", String::from_utf8_lossy(&text));
                    }
                    (Streamed::Stopped { plain }, None) => {
                        assert!(text[..plain].iter().all(|&c| is_alphabet(c)));
                    }
                    (got, want) => panic!(
                        "{got:?} where a scan then a decode gives {want:?}: {:?} room {room}",
                        String::from_utf8_lossy(&text)
                    ),
                }
            }
        }
    }
}
