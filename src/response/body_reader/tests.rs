use super::*;
use crate::formats::{encode_json, Format};
use crate::limits::DEFAULT_MAX_BYTES;
use crate::payload::{DTypeChoice, Payload, Shape};
use crate::response::group::tests::{self as group_tests, body};
use crate::test_rng::xorshift;

/// Rows `[start, stop)` of 3 layers, top 2: alike in every choice before `prompt`.
fn rows(start: u64, stop: u64, prompt: u64, choice: u64) -> Payload {
    let values: Vec<i64> = (start..stop)
        .flat_map(|t| {
            let salt = if t >= prompt { 31 * (choice + 1) } else { 0 };
            (0..6).map(move |j| ((t * 7 + j + salt) % 250) as i64)
        })
        .collect();
    let shape = Shape::new((stop - start) as usize, 3, 2);
    Payload::from_values(&values, shape, start, DTypeChoice::Compact).unwrap()
}

/// A shared-prompt answer of `n` choices over `prompt` tokens, 3 generated each.
fn shared_answer(prompt: u64, n: u64) -> Vec<u8> {
    group_tests::shared_answer(rows, prompt, n)
}

/// `body` fed in chunks cut at `cuts`, read as a group; what the reader held before (text,
/// decoded).
fn read_in(body: &[u8], cuts: &[usize], decode_from: usize) -> ((usize, usize), Result<Group>) {
    let mut r = BodyReader::decoding_from(decode_from, DEFAULT_MAX_BYTES);
    let mut at = 0;
    for &c in cuts.iter().chain([&body.len()]) {
        let c = c.clamp(at, body.len());
        r.feed(&body[at..c]);
        at = c;
    }
    let held = (r.text_bytes(), r.decoded_bytes());
    (held, r.group(&Hints::default(), DEFAULT_MAX_BYTES))
}

/// The reader's answer is `group_from_response`'s: the same parts, or the same error.
fn same_as_whole(body: &[u8], got: &Result<Group>) {
    let want = group_from_response(body, &Hints::default(), DEFAULT_MAX_BYTES);
    match (got, &want) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("reader {got:?}, whole body {want:?}"),
    }
}

#[test]
fn a_shared_answer_is_held_decoded_and_reads_as_the_whole_body() {
    let answer = shared_answer(40, 4);
    for step in [1, 2, 3, 5, 64, 1000, answer.len()] {
        let cuts: Vec<usize> = (step..answer.len()).step_by(step).collect();
        let ((text, decoded), got) = read_in(&answer, &cuts, 16);
        same_as_whole(&answer, &got);
        let g = got.unwrap();
        assert_eq!(g.shared.as_ref().map(Payload::stop), Some(40));
        // Read from the held text (its decoded bytes viewed), not again from the whole text.
        assert!(g.shared.unwrap().into_data().is_shared(), "step {step}");
        // The prompt's rows (40 x 6 bytes) and each choice's own (3 x 6) are held decoded.
        assert_eq!(decoded, 40 * 6 + 4 * 3 * 6, "step {step}");
        // Their text (320 and 24 characters) is not: each is a placeholder of 2 bytes.
        assert_eq!(text, answer.len() - (320 + 4 * 24) + 5 * 2, "step {step}");
    }
}

#[test]
fn decoded_rows_are_views_of_the_readers_bytes() {
    // As the merge writes it, and with white space about every value (as `json.dumps` and
    // pretty printers write it): the walk of the held text takes the decoded bytes either way.
    let answer = shared_answer(40, 2);
    let spaced = String::from_utf8(answer.clone())
        .unwrap()
        .replace("\":", "\" :\n ")
        .replace(',', " ,\t");
    for body in [answer, spaced.into_bytes()] {
        let mut r = BodyReader::decoding_from(16, DEFAULT_MAX_BYTES);
        r.feed(&body);
        let g = r.group(&Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        assert!(g
            .choices
            .iter()
            .all(|c| c.own.clone().into_data().is_shared()));
        assert!(
            g.shared.unwrap().into_data().is_shared(),
            "no copy of the prompt's rows"
        );
    }
}

#[test]
fn every_format_and_every_cut_reads_as_the_whole_body() {
    let prompt = 12;
    let values: Vec<Payload> = (0..3).map(|c| rows(0, prompt + 3, prompt, c)).collect();
    let mut next = xorshift(7);
    for format in [Format::Compact, Format::VllmNpy, Format::Lists] {
        let b = body(&values, format, Some(prompt));
        for _ in 0..40 {
            let mut cuts: Vec<usize> = (0..4).map(|_| next() as usize % b.len()).collect();
            cuts.sort_unstable();
            let (_, got) = read_in(&b, &cuts, 8);
            same_as_whole(&b, &got);
            assert!(got.is_ok(), "{format:?}");
        }
    }
}

#[test]
fn text_that_is_not_strict_base64_is_read_as_sent() {
    let answer = String::from_utf8(shared_answer(40, 2)).unwrap();
    let data_at = answer.find(r#""data":""#).unwrap() + 8;
    let mut cases: Vec<String> = Vec::new();
    // An escape, white space, padding inside, a bad letter, a non-canonical last quantum, a
    // length that is not a whole quantum: each anywhere in the first value.
    for at in [data_at, data_at + 5, data_at + 20, data_at + 60] {
        for bad in ["\\/", " ", "=", "A=", "-", "\\u0041", "\u{1}0"] {
            let mut s = answer.clone();
            s.insert_str(at, bad);
            cases.push(s);
        }
    }
    let end = data_at + answer[data_at..].find('"').unwrap();
    let mut s = answer.clone();
    s.replace_range(end - 2..end, "B="); // padding bits not zero
    cases.push(s);
    cases.push(answer[..end].to_string()); // the body ends inside the string
    cases.push(answer[..data_at + 30].to_string());
    let mut next = xorshift(11);
    for case in &cases {
        let b = case.as_bytes();
        for _ in 0..6 {
            let mut cuts: Vec<usize> = (0..3).map(|_| next() as usize % b.len()).collect();
            cuts.sort_unstable();
            let (_, got) = read_in(b, &cuts, 16);
            same_as_whole(b, &got);
        }
    }
}

#[test]
fn a_placeholder_cannot_be_posed_as_by_text() {
    // A short `data` string that reads as a placeholder would: the body is read from its text.
    let answer = String::from_utf8(shared_answer(40, 2)).unwrap();
    let posed = answer.replacen(r#""data":""#, "\"data\":\"\u{1}0\",\"x\":\"", 1);
    let (_, got) = read_in(posed.as_bytes(), &[], 16);
    same_as_whole(posed.as_bytes(), &got);
    assert!(got.is_err());
}

#[test]
fn equal_strings_share_one_placeholder_and_differing_ones_do_not() {
    // Two places one producer writes the same routing to (Dynamo's nvext pair).
    let v = String::from_utf8(encode_json(&rows(0, 30, 30, 0), Format::Compact).unwrap()).unwrap();
    let w = String::from_utf8(encode_json(&rows(0, 30, 3, 1), Format::Compact).unwrap()).unwrap();
    for (a, b) in [(&v, &v), (&v, &w)] {
        let text = format!(
            r#"{{"choices":[{{"index":0}}],"nvext":{{"routed_experts":{a},"engine_data":{{"routed_experts":{b}}}}}}}"#
        );
        let (_, got) = read_in(text.as_bytes(), &[7, 100], 16);
        same_as_whole(text.as_bytes(), &got);
        assert_eq!(got.is_ok(), a == b, "{got:?}");
    }
}

#[test]
fn strings_made_to_share_a_key_are_compared_a_bounded_number_of_times() {
    // Distinct strings of one length before an equal pair (Dynamo's nvext pair): with every
    // hash equal, past `SAME_KEY_MAX` of them the pair may not share a placeholder, and the
    // body is read from its whole text instead, to the same answer.
    let text = |rows: &Payload| String::from_utf8(encode_json(rows, Format::Compact).unwrap());
    let v = text(&rows(0, 30, 30, 0)).unwrap();
    for distinct in [2, SAME_KEY_MAX + 3] {
        let pad: Vec<String> = (1..=distinct as u64)
            .map(|c| text(&rows(0, 30, 3, c)).unwrap())
            .collect();
        let body = format!(
            r#"{{"choices":[{{"index":0}}],"pad":[{}],"nvext":{{"routed_experts":{v},"engine_data":{{"routed_experts":{v}}}}}}}"#,
            pad.join(",")
        );
        for colliding in [false, true] {
            let mut r = BodyReader::decoding_from(16, DEFAULT_MAX_BYTES);
            r.colliding = colliding;
            r.feed(body.as_bytes());
            assert!(r.decoded_bytes() > 0);
            let whole_read = colliding && distinct > SAME_KEY_MAX;
            assert_eq!(
                r.read_as_text, whole_read,
                "{distinct} distinct, {colliding}"
            );
            assert!(r.by_content.values().all(|ids| ids.len() <= SAME_KEY_MAX));
            let got = r.group(&Hints::default(), DEFAULT_MAX_BYTES);
            same_as_whole(body.as_bytes(), &got);
            assert!(got.is_ok(), "{got:?}");
        }
    }
}

#[test]
fn a_string_past_the_limit_stays_text_and_gives_the_limits_error() {
    let answer = shared_answer(40, 2);
    let mut r = BodyReader::decoding_from(16, 100);
    r.feed(&answer);
    assert!(r.decoded_bytes() < 100);
    let got = r.group(&Hints::default(), 100);
    let want = group_from_response(&answer, &Hints::default(), 100);
    assert_eq!(got.unwrap_err().to_string(), want.unwrap_err().to_string());
}

#[test]
fn random_bodies_and_mutations_read_as_the_whole_body() {
    let mut next = xorshift(3);
    let answer = shared_answer(25, 3);
    for _ in 0..300 {
        let mut b = answer.clone();
        for _ in 0..(next() % 3) {
            let at = next() as usize % b.len();
            b[at] = b"AZaz09+/=\"\\ {}[],:x\x01"[next() as usize % 20];
        }
        let mut cuts: Vec<usize> = (0..(next() % 6))
            .map(|_| next() as usize % b.len())
            .collect();
        cuts.sort_unstable();
        let (_, got) = read_in(&b, &cuts, 4 + next() as usize % 40);
        same_as_whole(&b, &got);
    }
}
