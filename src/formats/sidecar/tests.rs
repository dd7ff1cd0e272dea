//! The tests of `sidecar`.

use super::*;

const LIMIT: usize = limits::DEFAULT_MAX_BYTES;

#[test]
fn spec_worked_example() {
    let text = br#"{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}"#;
    let p = decode(text, LIMIT).unwrap();
    assert_eq!(p.bytes(), &[10, 11, 20, 21, 30, 31]);
    assert_eq!(encode(&p), text.to_vec());
    let u16 = br#"{"data":"LAEHAA==","shape":[1,1,2],"start":0,"dtype":"uint16"}"#;
    assert_eq!(decode(u16, LIMIT).unwrap().values::<u16>(), &[300, 7]);
}

#[test]
fn escapes_defaults_and_extra_keys() {
    let p = decode(
        br#"{"x":[1,{"y":2}],"data":"Cgs\/FA==","shape":[2,1,2]}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(
        (p.start(), p.dtype(), p.bytes()),
        (0, DType::U8, &[10, 11, 63, 20][..])
    );
}

#[test]
fn errors_name_the_field() {
    let cases: &[(&[u8], &str)] = &[
        (br#"{"data":"CgsUFR4f","shape":[3,1]}"#, "`shape`"),
        (
            br#"{"data":"CgsUFR4f","shape":[4,1,2]}"#,
            "8 bytes for shape [4, 1, 2] of uint8",
        ),
        (
            br#"{"data":"CgsUFR4f","shape":[3,1,2],"start":-1}"#,
            "`start`",
        ),
        (
            br#"{"data":"CgsUFR4f","shape":[3,1,2],"dtype":7}"#,
            "`dtype`",
        ),
        (br#"{"data":5,"shape":[3,1,2]}"#, "got a number"),
        (br#"{"shape":[3,1,2]}"#, "no `data` key"),
        (br#"[1]"#, "got an array"),
        (b"", "empty input"),
        (
            br#"{"data":"","shape":[18446744073709551615,2,2]}"#,
            "overflows",
        ),
    ];
    for (text, needle) in cases {
        let e = decode(text, LIMIT).unwrap_err();
        assert!(e.kind().is_malformed_input(), "{e:?}");
        assert!(e.to_string().contains(needle), "{e} lacks {needle}");
    }
}

/// Decoding as the text is read gives what checking first and decoding after gives: the
/// same payload, or the same error, for sound and flawed documents alike.
#[test]
fn decoding_while_reading_changes_no_result_and_no_error() {
    let mut next = crate::test_rng::xorshift(0x2545_f491_4f6c_dd1du64);
    let flaws: [&[u8]; 9] = [
        b"\"",
        b"\\",
        b"\\/",
        b"=",
        b" ",
        b"\n",
        b"\xc3\xa9",
        b"*",
        b"Q",
    ];
    for tokens in 0..60usize {
        let dtype = DType::ALL[tokens % DType::ALL.len()];
        let shape = Shape::new(tokens, 2, 3);
        let bytes: Vec<u8> = (0..shape.nbytes(dtype).unwrap())
            .map(|_| next() as u8)
            .collect();
        let text = b64::encode(&bytes);
        let docs = [
            format!(
                r#"{{"data":"{}","shape":[{tokens},2,3],"dtype":"{dtype}"}}"#,
                String::from_utf8_lossy(&text)
            ),
            format!(
                r#"{{"dtype":"{dtype}","shape":[{tokens},2,3],"data":"{}"}}"#,
                String::from_utf8_lossy(&text)
            ),
        ];
        for doc in docs {
            let doc = doc.into_bytes();
            let at_data = doc.windows(8).position(|w| w == b"\"data\":\"").unwrap() + 8;
            for trial in 0..5 {
                let mut flawed = doc.clone();
                if trial > 0 {
                    let at = at_data + next() as usize % (text.len() + 2);
                    let flaw = flaws[next() as usize % flaws.len()];
                    flawed.splice(at..at + 1, flaw.iter().copied());
                }
                for limit in [LIMIT, bytes.len(), bytes.len().saturating_sub(1)] {
                    let fused = decode(&flawed, limit);
                    let apart = parse_fields(&flawed)
                        .and_then(|f| validate(f, limit))
                        .and_then(|t| t.decode());
                    match (&fused, &apart) {
                        (Ok(a), Ok(b)) => assert_eq!(a, b),
                        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                        _ => panic!(
                            "{fused:?} vs {apart:?} for {:?}",
                            String::from_utf8_lossy(&flawed)
                        ),
                    }
                }
            }
        }
    }
}

#[test]
fn limit_is_checked_before_allocating() {
    let text = br#"{"data":"CgsUFR4f","shape":[3,1,2]}"#;
    assert!(decode(text, 5)
        .unwrap_err()
        .to_string()
        .contains("[3, 1, 2] of uint8 declares 6 bytes"));
    assert!(decode(text, 6).is_ok());
}
