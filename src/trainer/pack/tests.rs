//! The tests of `pack`.

use super::*;
use crate::payload::DTypeChoice;

fn payload(values: &[i64], tokens: usize, start: u64) -> Payload {
    Payload::from_values(
        values,
        Shape::new(tokens, 1, 2),
        start,
        DTypeChoice::Compact,
    )
    .unwrap()
}

#[test]
fn a_groups_samples_share_their_prompt_part_and_pack_as_whole_samples_do() {
    let mut next = crate::test_rng::xorshift(0x9a5);
    for _ in 0..30 {
        let (start, prompt, n) = (next() % 3, 1 + next() % 6, 1 + next() % 4);
        let values = |rows: u64, salt: u64| -> Vec<i64> {
            (0..rows * 2)
                .map(|v| ((v * 7 + salt) % 50) as i64)
                .collect()
        };
        let shared = payload(&values(prompt, 0), prompt as usize, start);
        let own: Vec<Payload> = (0..n)
            .map(|c| {
                let g = next() % 4;
                payload(&values(g, c + 1), g as usize, start + prompt)
            })
            .collect();
        let whole: Vec<Payload> = own
            .iter()
            .map(|o| crate::payload::merge::merge(&shared, o).unwrap())
            .collect();
        let parts: Vec<[&Payload; 2]> = own.iter().map(|o| [&shared, o]).collect();
        let parts: Vec<&[&Payload]> = parts.iter().map(|p| &p[..]).collect();
        let opts = PackOptions {
            pad_each_to_multiple: Some(1 + next() as usize % 4),
            ..PackOptions::default()
        };
        let refs: Vec<&Payload> = whole.iter().collect();
        let want = layout(&refs, &opts, DType::I64, 1 << 20).unwrap();
        let got = layout_parts(&parts, &opts, DType::I64, 1 << 20).unwrap();
        assert_eq!(got, want);
        let (mut a, mut b) = (vec![0i64; want.rows * 2], vec![0i64; want.rows * 2]);
        let (mut ma, mut mb) = (vec![false; want.rows], vec![false; want.rows]);
        pack_into(&refs, &want, &mut a, Some(&mut ma)).unwrap();
        pack_parts_into(&parts, &got, &mut b, Some(&mut mb)).unwrap();
        assert_eq!((a, ma), (b, mb));
    }
}

#[test]
fn a_ranks_share_written_without_the_batch_is_what_shard_takes_from_it() {
    use crate::trainer::shard::{gather, plan, CpSplit, Rank};
    let mut next = crate::test_rng::xorshift(0x5a4e);
    let mut cases = 0;
    while cases < 200 {
        let (layers, cp, tp) = (
            1 + next() as usize % 3,
            1 + next() as usize % 3,
            1 + next() as usize % 2,
        );
        let value = |v: u64| -> i64 {
            if v % 11 == 0 {
                -1
            } else {
                (v % 40) as i64
            }
        };
        let make = |rows: u64, start: u64, salt: u64, missing: bool| -> Payload {
            let width = layers as u64 * 2;
            let values: Vec<i64> = (0..rows * width)
                .map(|v| {
                    if missing && value(v / width + salt) == -1 {
                        -1
                    } else {
                        ((v * 7 + salt) % 40) as i64
                    }
                })
                .collect();
            Payload::from_values(
                &values,
                Shape::new(rows as usize, layers, 2),
                start,
                DTypeChoice::Compact,
            )
            .unwrap()
        };
        let prompt = make(next() % 9, next() % 3, 0, next() % 2 == 0);
        let own: Vec<Payload> = (0..1 + next() % 4)
            .map(|c| make(next() % 5, prompt.stop(), c + 1, next() % 2 == 0))
            .collect();
        let parts: Vec<[&Payload; 2]> = own.iter().map(|o| [&prompt, o]).collect();
        let parts: Vec<&[&Payload]> = parts.iter().map(|p| &p[..]).collect();
        let opts = PackOptions {
            pad_each_to_multiple: Some(2 * cp * tp),
            pad_to_multiple: Some(1 + next() as usize % 5),
            ..PackOptions::default()
        };
        let l = layout_parts(&parts, &opts, DType::I32, 1 << 20).unwrap();
        let mut batch = vec![0i32; l.rows * layers * 2];
        let mut mask = vec![false; l.rows];
        pack_parts_into(&parts, &l, &mut batch, Some(&mut mask)).unwrap();
        let lo = next() as usize % layers;
        let rank = Rank {
            cp_size: cp,
            cp_rank: next() as usize % cp,
            cp_split: if next() % 2 == 0 {
                CpSplit::Zigzag
            } else {
                CpSplit::Contiguous
            },
            tp_size: tp,
            tp_rank: next() as usize % tp,
            layers: Some((lo, lo + 1 + next() as usize % (layers - lo))),
        };
        let Ok(p) = plan(&l.cu_seqlens, l.rows, layers, &rank) else {
            continue;
        };
        let width = p.layers.len() * 2;
        let mut want = vec![0i32; p.num_rows() * width];
        gather(&batch, layers, 2, &p, &mut want);
        let want_mask: Vec<bool> = p
            .rows
            .iter()
            .flat_map(|r| mask[r.clone()].to_vec())
            .collect();
        // A dirty buffer, as one reused from the step before.
        let mut got = vec![-7i32; want.len()];
        let mut got_mask = vec![true; p.num_rows()];
        pack_share_into(&parts, &l, &p, &mut got, Some(&mut got_mask)).unwrap();
        assert_eq!((got, got_mask), (want, want_mask));
        cases += 1;
    }
}

#[test]
fn a_share_refuses_buffers_and_plans_other_than_its_own() {
    use crate::trainer::shard::{plan, Rank};
    let a = payload(&[1, 2, 3, 4], 2, 0);
    let l = layout(&[&a], &PackOptions::default(), DType::I32, 1 << 20).unwrap();
    let p = plan(&l.cu_seqlens, l.rows, 1, &Rank::default()).unwrap();
    let parts: [&[&Payload]; 1] = [&[&a]];
    let field = |e: Error| match e.kind() {
        ErrorKind::Field { field, .. } => field.clone(),
        _ => panic!("{e}"),
    };
    let e = pack_share_into(&parts, &l, &p, &mut [0i32; 3], None).unwrap_err();
    assert_eq!(field(e), "dst");
    let e = pack_share_into(&parts, &l, &p, &mut [0i32; 4], Some(&mut [false; 3])).unwrap_err();
    assert_eq!(field(e), "mask");
    let far = Plan {
        rows: std::iter::once(1..3).collect(),
        ..p.clone()
    };
    let e = pack_share_into(&parts, &l, &far, &mut [0i32; 4], None).unwrap_err();
    assert!(e.to_string().contains("rows within the layout's 2"), "{e}");
    let wide = Plan {
        layers: 0..2,
        ..p.clone()
    };
    let e = pack_share_into(&parts, &l, &wide, &mut [0i32; 8], None).unwrap_err();
    assert_eq!(field(e), "plan");
}

#[test]
fn a_missing_row_packs_as_zeros_into_an_unsigned_dtype() {
    let a = payload(&[1, 2, -1, -1, 3, 4], 3, 0);
    let l = layout(&[&a], &PackOptions::default(), DType::U8, 1 << 20).unwrap();
    let (mut dst, mut mask) = (vec![9u8; 6], vec![true; 3]);
    pack_into(&[&a], &l, &mut dst, Some(&mut mask)).unwrap();
    assert_eq!(
        (dst, mask),
        (vec![1, 2, 0, 0, 3, 4], vec![true, false, true])
    );
}

#[test]
fn parts_that_do_not_follow_each_other_are_refused_by_sample_and_part() {
    let prompt = payload(&[1, 2, 3, 4], 2, 0);
    let later = payload(&[5, 6], 1, 3);
    let inside = payload(&[5, 6], 1, 1);
    let wide =
        Payload::from_values(&[1, 2, 3, 4], Shape::new(1, 2, 2), 2, DTypeChoice::Compact).unwrap();
    let o = PackOptions::default();
    let e = layout_parts(&[&[&prompt, &later]], &o, DType::I32, 1 << 20).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Gap { stop: 2, start: 3 }),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("sample 0, part 1 starts at position 3"),
        "{e}"
    );
    let e = layout_parts(&[&[&prompt], &[&prompt, &inside]], &o, DType::I32, 1 << 20);
    assert!(e.unwrap_err().to_string().contains("sample 1, part 1"));
    let e = layout_parts(&[&[&prompt, &wide]], &o, DType::I32, 1 << 20).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{e}");
    let e = layout_parts(&[&[&prompt], &[]], &o, DType::I32, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("sample 1 with none"), "{e}");
}

#[test]
fn samples_land_at_their_positions_padded_and_masked() {
    let a = payload(&[1, 2, 3, 4, -1, -1], 3, 1); // positions 1..4, the last missing
    let b = payload(&[5, 6], 1, 0);
    let opts = PackOptions {
        num_tokens: Some(vec![5, 2]),
        pad_each_to_multiple: Some(3),
        pad_to_multiple: Some(4),
    };
    let l = layout(&[&a, &b], &opts, DType::I32, 1 << 20).unwrap();
    assert_eq!((l.rows, l.cu_seqlens.clone()), (12, vec![0, 6, 9]));
    let mut dst = vec![0i32; l.rows * 2];
    let mut mask = vec![false; l.rows];
    pack_into(&[&a, &b], &l, &mut dst, Some(&mut mask)).unwrap();
    assert_eq!(&dst[..14], &[0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 5, 6]);
    let on: Vec<usize> = (0..12).filter(|&i| mask[i]).collect();
    assert_eq!(on, [1, 2, 6]);
}

#[test]
fn a_delta_without_num_tokens_sits_at_its_positions_never_at_0() {
    // Rows of positions 3 and 4: the sample is positions 0..5, the first three masked.
    let delta = payload(&[1, 2, 3, 4], 2, 3);
    let l = layout(&[&delta], &PackOptions::default(), DType::I32, 1 << 20).unwrap();
    assert_eq!((l.rows, l.cu_seqlens.clone()), (5, vec![0, 5]));
    let mut dst = vec![0i32; 10];
    let mut mask = vec![false; 5];
    pack_into(&[&delta], &l, &mut dst, Some(&mut mask)).unwrap();
    assert_eq!(dst, [0, 0, 0, 0, 0, 0, 1, 2, 3, 4]);
    assert_eq!(mask, [false, false, false, true, true]);
}

#[test]
fn routing_past_num_tokens_and_half_missing_rows_are_errors() {
    let a = payload(&[1, 2, 3, 4], 2, 3);
    let opts = PackOptions {
        num_tokens: Some(vec![4]),
        ..PackOptions::default()
    };
    let e = layout(&[&a], &opts, DType::I32, 1 << 20).unwrap_err();
    assert!(e
        .to_string()
        .contains("covers positions 3..5, past its num_tokens of 4"));
    let bad = payload(&[1, -1], 1, 0);
    let l = layout(&[&bad], &PackOptions::default(), DType::I32, 1 << 20).unwrap();
    let e = pack_into(&[&bad], &l, &mut [0i32; 2], None).unwrap_err();
    // Buffers and samples other than the layout's are refused, never sliced past their end.
    let other = payload(&[1, 2, 3, 4, 5, 6], 3, 0);
    for (samples, dst, mask, field) in [
        (vec![&bad], 3, None, "dst"),
        (vec![&bad], 2, Some(3), "mask"),
        (vec![&bad, &bad], 2, None, "samples"),
        (vec![&other], 2, None, "samples"),
    ] {
        let mut mask = mask.map(|n| vec![false; n]);
        let got = pack_into(&samples, &l, &mut vec![0i32; dst], mask.as_deref_mut());
        let e = got.unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Field { field: f, .. } if f == field),
            "{e}"
        );
    }
    assert!(e.to_string().contains("-1 in layer 0 beside real ids"));
    let counts = PackOptions {
        num_tokens: Some(vec![1, 2]),
        ..PackOptions::default()
    };
    let e = layout(&[&bad], &counts, DType::I32, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("one count per sample (1)"));
}
