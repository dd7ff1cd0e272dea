//! The fuzz targets' bodies, one per entry point of the core. Each takes arbitrary bytes, must
//! never panic, hang or allocate past the limit, and checks what must hold of what it accepts.
//! `cargo fuzz` runs them (fuzz_targets/), and `cargo test` replays every checked-in seed and
//! crash through them (corpus_test.rs), so a crash once found stays a test.

#![allow(dead_code)] // each fuzz target uses one function of this file

use routed_experts::body;
use routed_experts::formats::{self, Format, Hints};
use routed_experts::merge;
use routed_experts::npy;
use routed_experts::response::{self, MergeOptions};
use routed_experts::sidecar;
use routed_experts::trajectory::{Overlap, Pad, Trajectory};
use routed_experts::{DType, DTypeChoice, Payload, Shape};

/// A small limit keeps every run fast, and puts the limit checks themselves under the fuzzer.
pub const LIMIT: usize = 1 << 20;

/// Compact sidecar text: what decodes re-encodes canonically and decodes to the same payload.
pub fn sidecar(data: &[u8]) {
    // Decoding as the text is read gives what checking first and decoding after gives, at two
    // limits (one the size of the data, where the output is exactly full).
    for limit in [LIMIT, data.len() / 4 * 3] {
        let apart = sidecar::parse_fields(data)
            .and_then(|f| sidecar::validate(f, limit))
            .and_then(|t| t.decode());
        same_outcome(
            sidecar::decode(data, limit),
            apart,
            "decoding while reading",
        );
    }
    let Ok(p) = sidecar::decode(data, LIMIT) else {
        return;
    };
    let text = sidecar::encode(&p);
    let back = sidecar::decode(&text, LIMIT).expect("a canonical encoding decodes");
    assert_eq!(back, p);
    assert_eq!(
        sidecar::encode(&back),
        text,
        "canonical text is a fixed point"
    );
    assert_eq!(text.len(), sidecar::encoded_len(&p));
}

/// Two ways to one result: the same payload, or errors with the same message.
fn same_outcome<T: PartialEq + std::fmt::Debug>(
    a: routed_experts::Result<T>,
    b: routed_experts::Result<T>,
    what: &str,
) {
    match (&a, &b) {
        (Ok(x), Ok(y)) => assert_eq!(x, y, "{what}: different results"),
        (Err(x), Err(y)) => assert_eq!(
            format!("{x:?}"),
            format!("{y:?}"),
            "{what}: different errors"
        ),
        _ => panic!("{what}: {a:?} against {b:?}"),
    }
}

/// Hints from the first byte, so every format's decoder gets what it needs to get going.
fn hints(flags: u8) -> Hints {
    Hints {
        start: (flags & 1 != 0).then_some(u64::from(flags >> 5)),
        num_layers: (flags & 2 != 0).then_some(usize::from(flags >> 6) + 1),
        top_k: (flags & 4 != 0).then_some(usize::from((flags >> 3) & 3) + 1),
        dtype: (flags & 8 != 0).then(|| DType::ALL[usize::from(flags >> 4) % DType::ALL.len()]),
    }
}

/// Any text through format detection and its decoder; what decodes survives a round trip
/// through every format that can hold its values.
pub fn formats(data: &[u8]) {
    let Some((&flags, text)) = data.split_first() else {
        return;
    };
    let hints = hints(flags);
    if let Ok(Format::Sglang) = formats::detect(text) {
        // SGLang is chosen only for text that reads as base64 (format.md §3.2).
        assert!(text.len() % 4 == 0, "{text:?} taken for SGLang's base64");
    }
    // A caller's text: empty is refused, a JSON string literal is read inside its quotes, and
    // what it yields is never empty.
    if let Ok(inner) = formats::input_text(text) {
        assert!(!inner.trim_ascii().is_empty(), "{text:?} passed as input");
        let _ = formats::decode_text(&inner, &hints, LIMIT);
    }
    let Ok((_, p)) = formats::decode_text(text, &hints, LIMIT) else {
        return;
    };
    let s = p.shape();
    let back_hints = Hints {
        start: Some(p.start()),
        num_layers: Some(s.layers),
        top_k: Some(s.top_k),
        dtype: None,
    };
    for f in Format::ALL {
        // sglang carries int32 only, nemo int8..int32: an Err says the values do not fit.
        let Ok(text) = formats::encode(&p, f) else {
            continue;
        };
        if f == Format::Sglang && s.layers * s.top_k == 0 {
            continue; // flat values of empty rows say nothing about the number of rows
        }
        if f == Format::Sglang && text.starts_with(formats::NPY_B64_PREFIX) {
            // Flat values whose first bytes spell the .npy magic (a first int32 of 1297436307,
            // never an expert id) are read as vLLM's .npy, as format.md §3.2 says: refused,
            // never decoded as something else.
            let read = formats::decode_text(&text, &back_hints, usize::MAX);
            assert!(
                matches!(read, Err(_) | Ok((Format::VllmNpy, _))),
                "flat values that look like .npy decoded as {read:?}"
            );
            continue;
        }
        // Lists carry no dtype: without one, values past int32 are refused by design.
        let back_hints = Hints {
            dtype: (f == Format::Lists).then_some(p.dtype()),
            ..back_hints
        };
        let (found, back) = formats::decode_text(&text, &back_hints, usize::MAX)
            .unwrap_or_else(|e| panic!("{f:?} encoding of a decoded payload fails: {e}"));
        assert_eq!(found, f);
        assert!(
            back.same_routing(&p),
            "{f:?} round trip changed the routing"
        );
    }
}

/// A whole response body: finding routing and decoding each choice never panics, and what is
/// found is where the body says.
pub fn response(data: &[u8]) {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    let read = body::read_prefill(body);
    let sniffed = response::sniff(body); // any bytes: never a panic
                                         // The proxy's read of a body whose base64 runs were found as it arrived, in pieces of a
                                         // size the flags choose: the same read.
    let mut runs = body::Base64Runs::new();
    let piece = 1 + usize::from(flags >> 4) * 3;
    for end in (piece..body.len()).step_by(piece).chain([body.len()]) {
        runs.extend(&body[..end]);
    }
    assert_eq!(
        format!("{:?}", body::read_prefill_scanned(body, Some(&runs))),
        format!("{read:?}"),
        "read with the runs found in pieces of {piece}"
    );
    read_as_it_arrives(body, flags);
    let Ok(found) = body::find_routing(body) else {
        assert!(
            read.is_err(),
            "read_prefill took a body find_routing refuses"
        );
        return;
    };
    group_reads_as_its_choices(body, flags);
    let split = body::read_body(body).is_ok_and(|r| r.prompt.is_some());
    // None means a response without routing, never a mistake read as one.
    let choice = u64::from(flags & 3);
    if let (false, Ok(None)) = (
        split,
        response::from_response(body, choice, &hints(flags), LIMIT),
    ) {
        assert!(
            found.is_empty(),
            "from_response answered None for a body with routing"
        );
    }
    // What a file is, said for any bytes; a response it finds no routing in reads none.
    if let response::Sniffed::Response { routed: false, .. } = sniffed {
        let read = response::from_response(body.trim_ascii(), choice, &hints(flags), LIMIT);
        assert!(
            !matches!(read, Ok(Some(_))),
            "sniff found no routing where from_response did"
        );
    }
    for (i, f) in found.iter().enumerate() {
        assert_eq!(&body[f.span.clone()], f.text);
        let got = response::from_response(body, f.index, &hints(flags), LIMIT);
        // The first value of a choice, decoded as the body is read, is the value decoded after
        // the walk (vLLM 0.21's split rows are joined first, so not compared here).
        if !split && !found[..i].iter().any(|g| g.index == f.index) {
            let after = response::decode_found(f, &hints(flags), LIMIT)
                .map(|(_, p)| Some(p))
                .map_err(|e| e.context(format!("choice {}", f.index)));
            same_outcome(got, after, "from_response");
        }
        // The proxy's sampled look at a value agrees with a look at the decoded payload.
        let sampled = response::suspect_rows(f, &hints(flags), LIMIT, 1, 5);
        if let Ok((_, whole)) = response::decode_found(f, &hints(flags), LIMIT) {
            let mut want = routed_experts::validate::Suspect::default();
            want.add_payload(&whole, 1, 5);
            assert_eq!(sampled, Ok((want, whole.stop())), "sampled rows differ");
        }
    }
    // The proxy's reader: the same routing, and kv_transfer_params as a piece of the body
    // (it refuses only what find_routing takes but is ambiguous: the key twice).
    if let Ok(read) = read {
        let spans: Vec<_> = read.routing.values.iter().map(|f| f.span.clone()).collect();
        assert_eq!(
            spans,
            found.iter().map(|f| f.span.clone()).collect::<Vec<_>>()
        );
        if let Some(kv) = read.kv_transfer_params {
            let inside = body.as_ptr_range();
            assert!(!kv.is_empty() && kv != b"null");
            assert!(inside.contains(&kv.as_ptr()) && kv.as_ptr_range().end <= inside.end);
        }
        for f in &read.routing.values {
            let _ = response::routing_rows(f, &hints(flags), LIMIT);
        }
    }
}

/// Two bodies (split at the first 0xff, which valid UTF-8 never holds): the splice path and the
/// decode/concat/encode path agree byte for byte, or both refuse.
pub fn merge_response(data: &[u8]) {
    let Some(cut) = data.iter().position(|&b| b == 0xff) else {
        return;
    };
    let (prefill, decode) = (&data[..cut], &data[cut + 1..]);
    let opts = MergeOptions::new(LIMIT);
    let spliced = response::merge_response(prefill, decode, opts);
    let general = response::merge_response(
        prefill,
        decode,
        MergeOptions {
            splice: false,
            ..opts
        },
    );
    // What a server writes out unassembled (the proxy): the same bytes, or the same refusal;
    // and with the prefill routing found first, the same again.
    let pieces = response::merge_response_pieces(prefill, decode, opts);
    let unassembled = pieces
        .as_ref()
        .map_err(|e| e.clone())
        .and_then(|p| p.checked_slices().map(|s| s.concat()));
    assert_eq!(
        unassembled.is_ok(),
        spliced.is_ok(),
        "checked_slices disagrees with to_vec"
    );
    if let (Ok(u), Ok(a)) = (&unassembled, &spliced) {
        assert_eq!(u, a, "checked_slices and to_vec differ");
        // (A decode body without routing merges without reading the prefill body at all, so
        // that one need not parse.)
        if let Ok(found) = body::read_body(prefill) {
            let again = response::merge_response_found(prefill, &found, decode, opts)
                .and_then(|p| p.to_vec())
                .expect("the same merge with the routing given");
            assert_eq!(&again, a, "merge_response_found differs");
        }
    }
    // What the proxy sends: the text encoded again from other text left to be written as the
    // body is sent, in pieces; the same bytes, or the same refusal, compact and kept.
    for base in [
        opts,
        MergeOptions {
            keep_format: true,
            ..opts
        },
    ] {
        let deferred = MergeOptions {
            defer_recode: true,
            ..base
        };
        let sent = response::merge_response_pieces(prefill, decode, deferred)
            .and_then(|mut p| sent_in_pieces(&mut p));
        let whole = response::merge_response(prefill, decode, base);
        assert_eq!(
            sent.as_ref().map_err(ToString::to_string),
            whole.as_ref().map_err(ToString::to_string),
            "deferred and assembled merges differ"
        );
    }
    shared_prompt(prefill, decode, opts, spliced.as_ref().ok());
    match (&spliced, &general) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b, "splice and general merges differ");
            // The merged body still parses, with the routing where decode had it.
            let merged = body::find_routing(a).expect("a merged body parses");
            let before = body::find_routing(decode).expect("decode parsed before");
            assert_eq!(merged.len(), before.len());
        }
        (Err(_), Err(_)) => {}
        _ => panic!("splice {spliced:?} but general {general:?}"),
    }
    // Written in the decode value's format: vLLM's `.npy` halves merged on their text
    // (copied where it lines up) against decoded, merged and encoded: the same bytes, or a
    // refusal both ways, word for word where the compact merges' refusals are (a compact
    // sidecar's splice may find another of several flaws first).
    let keep = MergeOptions {
        keep_format: true,
        ..opts
    };
    let kept = response::merge_response(prefill, decode, keep);
    let decoded = response::merge_response(
        prefill,
        decode,
        MergeOptions {
            splice: false,
            ..keep
        },
    );
    match (&kept, &decoded) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "kept-format text and decoded merges differ"),
        (Err(a), Err(b)) => {
            let same = |x: &Result<Vec<u8>, _>, y: &Result<Vec<u8>, _>| {
                x.as_ref().err().map(ToString::to_string)
                    == y.as_ref().err().map(ToString::to_string)
            };
            if same(&spliced, &general) {
                assert_eq!(a.to_string(), b.to_string(), "different refusals");
            }
        }
        _ => panic!("kept-format text {kept:?} but decoded {decoded:?}"),
    }
}

/// A body fed to a `BodyReader` in pieces of a size the flags choose, its `data` strings
/// decoded from a few characters on: the group `group_from_response` reads, or its error.
fn read_as_it_arrives(body: &[u8], flags: u8) {
    let piece = 1 + usize::from(flags >> 3) * 5;
    let mut reader = response::BodyReader::decoding_from(4 + usize::from(flags & 7) * 3, LIMIT);
    for at in (0..body.len()).step_by(piece) {
        reader.feed(&body[at..body.len().min(at + piece)]);
    }
    // What it holds is what it was fed, but for placeholders (a few bytes where 4+ went).
    assert!(reader.text_bytes() + reader.decoded_bytes() <= body.len() * 3 / 2 + 64);
    let got = reader.group(&hints(flags), LIMIT);
    let want = response::group_from_response(body, &hints(flags), LIMIT);
    same_outcome(got, want, "the body read as it arrived");
}

/// A group read once (`group_from_response`): each choice's parts join to what
/// `from_response` reads of it, wherever both read the body.
fn group_reads_as_its_choices(body: &[u8], flags: u8) {
    let Ok(group) = response::group_from_response(body, &hints(flags), LIMIT) else {
        return;
    };
    for c in &group.choices {
        let whole = match (&group.shared, c.shares) {
            (Some(s), true) => merge::concat(
                s.start(),
                &[(s, 0, s.num_tokens()), (&c.own, 0, c.own.num_tokens())],
            )
            .expect("a choice's parts join"),
            _ => c.own.clone(),
        };
        if let Ok(Some(read)) = response::from_response(body, c.index, &hints(flags), LIMIT) {
            assert!(
                read.same_routing(&whole),
                "choice {} of the group differs from from_response",
                c.index
            );
        }
    }
}

/// The shared-prompt answer (format.md §4.1) of the same halves: sent in pieces or assembled,
/// spliced or decoded, the same bytes or refusals; and where the per-choice merge `per_choice`
/// went through too, each of its choices reads back as that merge's does.
fn shared_prompt(prefill: &[u8], decode: &[u8], opts: MergeOptions, per_choice: Option<&Vec<u8>>) {
    let shared = MergeOptions {
        shared_prompt: true,
        ..opts
    };
    let whole = response::merge_response(prefill, decode, shared);
    let general = response::merge_response(
        prefill,
        decode,
        MergeOptions {
            splice: false,
            ..shared
        },
    );
    let sent = response::merge_response_pieces(
        prefill,
        decode,
        MergeOptions {
            defer_recode: true,
            ..shared
        },
    )
    .and_then(|mut p| sent_in_pieces(&mut p));
    let text =
        |r: &routed_experts::Result<Vec<u8>>| r.as_ref().map_err(ToString::to_string).cloned();
    assert_eq!(
        text(&sent),
        text(&whole),
        "shared: deferred and assembled differ"
    );
    assert_eq!(
        whole.is_ok(),
        general.is_ok(),
        "shared: splice and general disagree"
    );
    let (Ok(answer), Some(per_choice)) = (&whole, per_choice) else {
        return;
    };
    if let Ok(g) = &general {
        assert_eq!(g, answer, "shared: splice and general differ");
    }
    let Ok(found) = body::read_body(per_choice) else {
        return;
    };
    for index in found.values.iter().map(|f| f.index) {
        let read = |b: &[u8]| response::from_response(b, index, &Hints::default(), LIMIT);
        if let Ok(Some(a)) = read(per_choice) {
            let b = read(answer).expect("a choice one answer reads, the other reads");
            let b = b.expect("a choice with routing in one answer has it in the other");
            assert!(
                a.same_routing(&b) && a.start() == b.start(),
                "choice {index} reads differently"
            );
        }
    }
}

/// The streaming merge of one event (`EventMerge`), fed in the pieces the input's tail says,
/// against the whole-event merge of the same text: the same bytes or an error both ways, or a
/// fallback that hands back every byte fed before any was sent. Input: prefill body `0xff`
/// decode event [`0xff` piece lengths, one byte each, and a flags byte first]; kept in the
/// engine's format when the part after the event is of even length.
pub fn stream_merge(data: &[u8]) {
    use routed_experts::response::{DataFirst, EventMerge, PrefillRows, Step, StreamOptions};
    let mut parts = data.splitn(3, |&b| b == 0xff);
    let (Some(prefill), Some(event)) = (parts.next(), parts.next()) else {
        return;
    };
    let spec = parts.next().unwrap_or(&[]);
    let Ok(found) = body::read_body(prefill) else {
        return;
    };
    let flags = spec.first().copied().unwrap_or(0);
    let mut merge = MergeOptions::new(LIMIT);
    merge.decode_start = (flags & 1 != 0).then_some(u64::from(flags >> 4));
    merge.hints = hints(flags >> 1);
    // The engine's format kept (the proxy's `routing_format` "engine") for an even count of
    // piece lengths.
    merge.keep_format = spec.len() % 2 == 0;
    // Prefill's rows left to be written as they are sent (the proxy's streams) for half the
    // counts, written back in parts of 3 to 15 bytes.
    merge.defer_recode = spec.len() % 4 >= 2;
    let part = 3 * (1 + usize::from(flags % 5));
    let data_first = if flags & 8 != 0 {
        DataFirst::Expect(u64::from(flags >> 4))
    } else {
        DataFirst::Fallback
    };
    let opts = StreamOptions {
        merge,
        data_first,
        max_held: 1 << 16,
    };
    let whole =
        response::merge_response_found(prefill, &found, event, merge).and_then(|s| s.to_vec());
    let rows = PrefillRows::new(&found, &merge);
    let mut m = EventMerge::new(&rows, opts);
    let (mut out, mut at, mut later) = (Vec::new(), 0, Vec::new());
    let cuts = spec.iter().skip(1).map(|&n| usize::from(n) + 1);
    let mut streamed = None;
    for n in cuts.chain(std::iter::once(event.len())) {
        let end = (at + n).min(event.len());
        let fed = m.feed(&event[at..end], &mut out);
        later.extend(m.take_deferred());
        assert!(later.is_empty() || merge.defer_recode);
        match fed {
            Ok(Step::Streaming(_)) => {}
            Ok(Step::Fallback(held)) => {
                assert!(out.is_empty(), "a fallback after bytes were sent");
                assert_eq!(held, event[..end], "a fallback hands back every byte fed");
                return;
            }
            Err(e) => {
                streamed = Some(Err(e));
                break;
            }
        }
        at = end;
        if at == event.len() {
            break;
        }
    }
    let streamed = match streamed {
        Some(r) => r,
        None => match m.finish(&mut out) {
            Ok(Step::Streaming(_)) => Ok(sent_with(&out, later, part)),
            Ok(Step::Fallback(held)) => {
                assert!(
                    out.is_empty() && held == event,
                    "a fallback at the end hands back all"
                );
                return;
            }
            Err(e) => Err(e),
        },
    };
    match (&whole, &streamed) {
        (Ok(a), Ok(b)) => assert!(a == b, "the streamed merge differs from the whole merge"),
        (Err(_), Err(_)) => {}
        // DataFirst::Expect's policy: a data-first sidecar stating another start is refused.
        (Ok(_), Err(e))
            if matches!(data_first, DataFirst::Expect(_))
                && e.to_string().contains("but its data came first") => {}
        _ => panic!("whole {whole:?} but streamed {streamed:?}"),
    }
}

/// `out` with each deferred part's text written in at its place, `part` bytes at a time.
fn sent_with(out: &[u8], later: Vec<(usize, response::Recoded<'_>)>, part: usize) -> Vec<u8> {
    let (mut sent, mut copied) = (Vec::new(), 0);
    for (at, r) in later {
        assert!(
            at >= copied && at <= out.len(),
            "a deferred part's place is out of order"
        );
        sent.extend_from_slice(&out[copied..at]);
        copied = at;
        write_in_parts(&r, || part, &mut sent);
    }
    sent.extend_from_slice(&out[copied..]);
    sent
}

/// `.npy` headers: what parses is a 3-d integer array whose re-written header parses the same.
pub fn npy_header(data: &[u8]) {
    let Ok(h) = npy::parse_header(data) else {
        return;
    };
    assert!(h.data_offset <= data.len());
    let again = npy::parse_header(&npy::write_header(h.dtype, h.shape)).expect("np.save header");
    assert_eq!((again.dtype, again.shape), (h.dtype, h.shape));
}

/// A reference model of a trajectory: the value rows by absolute position, as format.md §5 says.
#[derive(Default)]
struct Model {
    start: u64,
    rows: Vec<Vec<i64>>,
}

/// Appends, truncations and trainer handoffs decoded from the bytes, checked against `Model`.
pub fn trajectory(data: &[u8]) {
    let Some((&geometry, mut ops)) = data.split_first() else {
        return;
    };
    let (layers, top_k) = (
        usize::from(geometry & 1) + 1,
        usize::from((geometry >> 1) & 1) + 1,
    );
    let width = layers * top_k;
    let mut t = Trajectory::new();
    let mut model: Option<Model> = None;
    while let [op, a, b, rest @ ..] = ops {
        ops = rest;
        match op % 4 {
            0 | 1 => {
                // Append `b % 8` rows at position `a % 16` with values from the following bytes.
                let tokens = usize::from(b % 8);
                let Some((values, rest)) = ops.split_at_checked(tokens * width) else {
                    return;
                };
                ops = rest;
                let wide = op & 0x80 != 0; // values past uint8 exercise promotion
                let values: Vec<i64> = values
                    .iter()
                    .map(|&v| i64::from(v) * if wide { 300 } else { 1 })
                    .collect();
                let shape = Shape::new(tokens, layers, top_k);
                let start = u64::from(a % 16);
                let p = Payload::from_values(&values, shape, start, DTypeChoice::Compact).unwrap();
                let overlap =
                    [Overlap::Keep, Overlap::Replace, Overlap::Check][usize::from(op >> 2) % 3];
                let got = t.append(&p, overlap, LIMIT);
                let want = model_append(&mut model, start, &values, width, overlap);
                assert_eq!(got.is_ok(), want, "append at {start}: {got:?}");
            }
            2 => {
                let stop = u64::from(a % 24);
                let got = t.truncate(stop);
                let ok = match model.as_mut() {
                    Some(m) if stop >= m.start && stop <= m.start + m.rows.len() as u64 => {
                        m.rows.truncate((stop - m.start) as usize);
                        true
                    }
                    _ => false,
                };
                assert_eq!(got.is_ok(), ok);
            }
            _ => {
                let (n, max_missing) = (usize::from(a % 24), usize::from(b % 4));
                let pad = if op & 0x80 != 0 {
                    Pad::Zero
                } else {
                    Pad::Repeat
                };
                let got = t.to_training(n, pad, max_missing, LIMIT);
                if let Ok(p) = &got {
                    let m = model
                        .as_ref()
                        .expect("training rows of an empty trajectory");
                    assert_eq!((m.start, p.num_tokens()), (0, n));
                    for (i, row) in m.rows.iter().take(n).enumerate() {
                        for (j, &v) in row.iter().enumerate() {
                            assert_eq!(p.value_at(i * width + j), v);
                        }
                    }
                }
            }
        }
        check_model(&t, model.as_ref(), width);
    }
}

/// format.md §5 by the letter, on plain vectors. Returns whether the append is accepted.
fn model_append(
    model: &mut Option<Model>,
    start: u64,
    values: &[i64],
    width: usize,
    overlap: Overlap,
) -> bool {
    let new: Vec<Vec<i64>> = values.chunks(width).map(<[i64]>::to_vec).collect();
    let Some(m) = model.as_mut() else {
        *model = Some(Model { start, rows: new });
        return true;
    };
    let stop = m.start + m.rows.len() as u64;
    if start < m.start || start > stop {
        return false;
    }
    let at = (start - m.start) as usize;
    let overlapping = new.len().min(m.rows.len() - at);
    if overlap == Overlap::Check && m.rows[at..at + overlapping] != new[..overlapping] {
        return false;
    }
    if overlap == Overlap::Replace {
        m.rows[at..at + overlapping].clone_from_slice(&new[..overlapping]);
    }
    m.rows.extend_from_slice(&new[overlapping..]);
    true
}

fn check_model(t: &Trajectory, model: Option<&Model>, width: usize) {
    let Some(m) = model else {
        assert!(t.payload().is_none());
        return;
    };
    let p = t
        .payload()
        .expect("a trajectory that took a payload holds rows");
    assert_eq!((p.start(), p.num_tokens()), (m.start, m.rows.len()));
    for (i, row) in m.rows.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            assert_eq!(p.value_at(i * width + j), v, "row {i}");
        }
    }
    // The merge of the first row with the rest is the whole, wherever it is cut.
    if p.num_tokens() >= 2 {
        let head = p.slice(p.start(), p.start() + 1).unwrap();
        let tail = p.slice(p.start() + 1, p.stop()).unwrap();
        assert!(merge::merge(&head, &tail).unwrap().same_routing(p));
    }
}

/// Two routings and a num_experts decoded from the bytes: `agreement` and `ExpertLoad` checked
/// against plain reference computations (multisets by sorting, counts by position), including
/// which inputs they refuse.
pub fn quality(data: &[u8]) {
    let &[geometry, starts, sizes, mode, experts, ref values @ ..] = data else {
        return;
    };
    let (layers_a, top_k) = (usize::from(geometry & 3), usize::from((geometry >> 2) & 3));
    // Usually the same layers on both sides; sometimes not, which must be refused.
    let layers_b = if geometry & 0x10 != 0 {
        usize::from((geometry >> 5) & 3)
    } else {
        layers_a
    };
    let (start_a, start_b) = (u64::from(starts & 15), u64::from(starts >> 4));
    let (tokens_a, tokens_b) = (usize::from(sizes & 15), usize::from(sizes >> 4));
    // Values: byte - 2 (so -1 sentinels and other negatives occur), times 300 or 40000 for ids
    // past uint8 and past the agreement's bit masks.
    let scale = [1i64, 1, 300, 40_000][usize::from(mode & 3)];
    let mut bytes = values
        .iter()
        .map(|&v| (i64::from(v) - 2) * if v < 2 { 1 } else { scale });
    let mut take = |n: usize| -> Option<Vec<i64>> { (0..n).map(|_| bytes.next()).collect() };
    let (Some(va), Some(vb)) = (
        take(tokens_a * layers_a * top_k),
        take(tokens_b * layers_b * top_k),
    ) else {
        return;
    };
    let choice = if mode & 4 != 0 {
        DTypeChoice::Exact(DType::I64)
    } else {
        DTypeChoice::Compact
    };
    let a = Payload::from_values(&va, Shape::new(tokens_a, layers_a, top_k), start_a, choice);
    let b = Payload::from_values(&vb, Shape::new(tokens_b, layers_b, top_k), start_b, choice);
    let (Ok(a), Ok(b)) = (a, b) else {
        return;
    };
    check_agreement(&a, &va, &b, &vb);
    // num_experts: small (ids past it are refused), or huge (the table bound is refused).
    let num_experts = if mode & 8 != 0 {
        usize::MAX >> (experts % 8)
    } else {
        usize::from(experts)
    };
    check_expert_load(&[(&a, &va), (&b, &vb)], num_experts);
}

fn missing(row: &[i64]) -> bool {
    !row.is_empty() && row.iter().all(|&v| v == -1)
}

fn check_agreement(a: &Payload, va: &[i64], b: &Payload, vb: &[i64]) {
    let got = routed_experts::agreement(a, b);
    let (layers, k) = (a.num_layers(), a.top_k());
    let (start, stop) = (a.start().max(b.start()), a.stop().min(b.stop()));
    if layers != b.num_layers() || k != b.top_k() || layers == 0 || k == 0 || start >= stop {
        assert!(
            got.is_err(),
            "shapes or positions that cannot be compared: {got:?}"
        );
        return;
    }
    let row = layers * k;
    let (mut exact, mut overlap) = (vec![0u64; layers], vec![0u64; layers]);
    let (mut compared, mut excluded, mut negative) = (0, 0, false);
    for pos in start..stop {
        let ra = &va[(pos - a.start()) as usize * row..][..row];
        let rb = &vb[(pos - b.start()) as usize * row..][..row];
        if missing(ra) || missing(rb) {
            excluded += 1;
            continue;
        }
        compared += 1;
        negative |= ra.iter().chain(rb).any(|&v| v < 0);
        for l in 0..layers {
            let (mut x, mut y) = (ra[l * k..][..k].to_vec(), rb[l * k..][..k].to_vec());
            x.sort_unstable();
            y.sort_unstable();
            exact[l] += u64::from(x == y);
            for v in x {
                if let Some(i) = y.iter().position(|&w| w == v) {
                    y.remove(i);
                    overlap[l] += 1;
                }
            }
        }
    }
    if negative {
        assert!(
            got.is_err(),
            "a negative id outside a missing row is refused"
        );
        return;
    }
    let got = got.expect("comparable routings");
    assert_eq!((got.compared_rows, got.excluded_rows), (compared, excluded));
    // A layer zero on both sides in every compared row (top_k > 1) has no router.
    let zero = |v: &[i64], p: &Payload, l: usize| {
        (start..stop).all(|pos| {
            let r = &v[(pos - p.start()) as usize * row..][..row];
            missing(r) || r[l * k..][..k].iter().all(|&x| x == 0)
        })
    };
    let rows_compared = compared > 0;
    let none: Vec<bool> = (0..layers)
        .map(|l| k > 1 && rows_compared && exact[l] == compared && zero(va, a, l) && zero(vb, b, l))
        .collect();
    assert_eq!(got.no_router, none, "layers with no router");
    assert_eq!(
        (&got.exact_per_layer, &got.overlap_per_layer),
        (&exact, &overlap)
    );
}

fn check_expert_load(routings: &[(&Payload, &Vec<i64>)], num_experts: usize) {
    let layers = routings[0].0.num_layers();
    let load = routed_experts::ExpertLoad::new(layers, num_experts, LIMIT);
    let table_fits = num_experts > 0
        && layers > 0
        && layers
            .checked_mul(num_experts)
            .and_then(|c| c.checked_mul(8))
            .is_some_and(|b| b <= LIMIT);
    let Ok(mut load) = load else {
        assert!(!table_fits, "a table within the limit is made");
        return;
    };
    assert!(table_fits);
    let mut want = vec![0u64; layers * num_experts];
    for (p, values) in routings {
        let before = load.counts().to_vec();
        let got = load.add(p);
        let row = p.num_layers() * p.top_k();
        let bad = p.num_layers() != layers
            || (row > 0
                && values.chunks_exact(row).any(|r| {
                    !missing(r) && r.iter().any(|&v| v < 0 || v as u64 >= num_experts as u64)
                }));
        if bad {
            assert!(got.is_err(), "bad ids or layers are refused");
            assert_eq!(
                load.counts(),
                &before[..],
                "a refused payload counts nothing"
            );
            continue;
        }
        got.expect("ids in range");
        let counted: Vec<&[i64]> = values
            .chunks_exact(row.max(1))
            .filter(|r| row > 0 && !missing(r))
            .collect();
        // A layer zero throughout this payload's counted rows (top_k > 1) has no router.
        let k = p.top_k();
        let dense = |l: usize| {
            k > 1
                && !counted.is_empty()
                && counted
                    .iter()
                    .all(|r| r[l * k..][..k].iter().all(|&v| v == 0))
        };
        for r in &counted {
            for (i, &v) in r.iter().enumerate() {
                if !dense(i / k) {
                    want[(i / k) * num_experts + v as usize] += 1;
                }
            }
        }
        assert_eq!(load.counts(), &want[..]);
    }
}

/// A JSON object's fields, each as its raw text.
fn raw_fields(json: &[u8]) -> std::collections::BTreeMap<String, Box<serde_json::value::RawValue>> {
    serde_json::from_slice(json).expect("a JSON object")
}

/// One field of `raw_fields`, parsed (null when absent).
fn field(
    fields: &std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>,
    key: &str,
) -> serde_json::Value {
    fields.get(key).map_or(serde_json::Value::Null, |r| {
        serde_json::from_str(r.get()).expect("a field the proxy wrote")
    })
}

/// A client body and a decode stream (split at the first 0xff): what the proxy accepts from a
/// client it rewrites into JSON objects for prefill and decode with the protocol's fields set,
/// and a decode stream merged in any chunking gives the same bytes (or the same refusal).
pub fn proxy(data: &[u8]) {
    use routed_experts_proxy::{Api, ClientBody, StreamError, StreamMerger};
    let (client, stream) = match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    for (_, api) in Api::PATHS {
        let Ok(body) = ClientBody::parse(client, api) else {
            continue;
        };
        // Fields are read one by one: the client's own values pass byte for byte, and JSON
        // allows numbers (`2e5550`) that serde_json's f64 cannot hold.
        let p = raw_fields(&body.prefill_request());
        assert_eq!(field(&p, "stream"), false);
        let limits = match api {
            Api::Generate => raw_fields(p["sampling_params"].get().as_bytes()),
            _ => p.clone(),
        };
        assert_eq!(field(&limits, "max_tokens"), 1);
        assert!(field(&p, "kv_transfer_params")["do_remote_decode"] == true);
        let d = raw_fields(&body.decode_request(Some(b"{\"k\":1}"), Some(7)));
        assert_eq!(field(&d, "kv_transfer_params")["k"], 1);
    }
    const PREFILL: &[u8] = br#"{"choices":[{"index":0,"routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}}]}"#;
    let prefill = bytes::Bytes::from_static(PREFILL);
    let found = body::read_body(&prefill).expect("a valid prefill body");
    let run = |chunks: &[&[u8]]| -> Result<Vec<u8>, String> {
        let mut m = StreamMerger::new(&prefill, &found, MergeOptions::new(LIMIT), 4096);
        let mut out = Vec::new();
        let mut fed = || -> Result<(), StreamError> {
            for c in chunks {
                m.feed(bytes::Bytes::copy_from_slice(c), &mut out)?;
            }
            m.finish(&mut out)
        };
        match fed() {
            Ok(()) => Ok(out.concat()),
            Err(StreamError::Merge(e)) => Err(e.to_string()),
            Err(e) => Err(format!("{e:?}")),
        }
    };
    let whole = run(&[stream]);
    let cut = stream
        .first()
        .map_or(0, |&b| b as usize % (stream.len() + 1));
    let (a, b) = stream.split_at(cut);
    let (b, c) = b.split_at(b.len() / 2);
    assert_eq!(
        run(&[a, b, c]),
        whole,
        "a stream merged in pieces differs from the whole"
    );
    // Arbitrary chunkings: lengths 1 to 64 drawn from the stream's own first bytes (so the
    // fuzzer steers where events, lines and escapes are cut), and one byte at a time.
    let lengths: Vec<usize> = stream
        .iter()
        .take(16)
        .map(|&b| 1 + b as usize % 64)
        .collect();
    if !lengths.is_empty() {
        let mut chunks = Vec::new();
        let mut rest = stream;
        for len in lengths.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (head, tail) = rest.split_at((*len).min(rest.len()));
            chunks.push(head);
            rest = tail;
        }
        assert_eq!(
            run(&chunks),
            whole,
            "a stream merged in chunks differs from the whole"
        );
    }
    if stream.len() <= 2048 {
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(
            run(&bytes),
            whole,
            "a stream merged a byte at a time differs from the whole"
        );
    }
}

/// An upstream's reply as the proxy reads it whole (`routed_experts_proxy::direct`): its head
/// parsed from the input fed in pieces (the first byte sets their size) is the head parsed
/// whole, and a chunked body after it decodes to the same bytes in those pieces as in one,
/// or is refused both ways; nothing is taken past the limits on heads and chunk metadata.
pub fn upstream_reply(data: &[u8]) {
    use routed_experts_proxy::direct::{parse_head, Dechunk, Framing, Step, MAX_HEAD_BYTES};
    let Some((&first, text)) = data.split_first() else {
        return;
    };
    let piece = usize::from(first % 64) + 1;
    let whole = parse_head(text);
    // In pieces: the head is found once its last byte is there, the same as whole.
    let mut seen = 0;
    let in_pieces = loop {
        seen = (seen + piece).min(text.len());
        match parse_head(&text[..seen]) {
            Ok(None) if seen < text.len() => continue,
            other => break other,
        }
    };
    match (&whole, &in_pieces) {
        (Ok(Some(a)), Ok(Some(b))) => assert_eq!(a, b),
        (Ok(None), Ok(None)) | (Err(_), Err(_)) => {}
        // A prefix may be refused where the whole is not only for its size.
        (_, Err(e)) => assert!(e.contains("over"), "{e}"),
        (a, b) => panic!("whole {a:?}, in pieces {b:?}"),
    }
    if let Ok(Some((h, used))) = &whole {
        assert!(*used <= text.len() && *used <= MAX_HEAD_BYTES);
        // A body that runs to the close never leaves its connection for another request.
        assert!(h.framing != Framing::Close || !h.keep_alive);
    }
    // The body (after a head, else the whole input) dechunked in pieces and at once.
    let body = match &whole {
        Ok(Some((_, used))) => &text[*used..],
        _ => text,
    };
    let dechunk = |piece: usize| -> Result<(Vec<u8>, bool), String> {
        let mut d = Dechunk::default();
        let mut input = bytes::BytesMut::new();
        let (mut out, mut rest) = (Vec::new(), body);
        loop {
            match d.next(&mut input)? {
                Step::Data(b) => {
                    assert!(!b.is_empty());
                    out.extend_from_slice(&b);
                }
                Step::End => return Ok((out, true)),
                Step::More if rest.is_empty() => return Ok((out, false)),
                Step::More => {
                    let n = piece.min(rest.len());
                    input.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
            }
        }
    };
    let (a, b) = (dechunk(body.len().max(1)), dechunk(piece));
    match (&a, &b) {
        (Ok(x), Ok(y)) => assert_eq!(x, y),
        (Err(_), Err(_)) => {}
        // Refused in pieces, only for metadata that grew past its bound before data came.
        (Ok(_), Err(e)) | (Err(e), Ok(_)) => {
            assert!(e.contains("without data"), "{a:?} / {b:?}")
        }
    }
}

/// `r`'s whole text appended to `out` in parts of the lengths `size` gives (multiples of 3),
/// which never fails (a merge makes it of text found to be base64).
fn write_in_parts(r: &response::Recoded<'_>, mut size: impl FnMut() -> usize, out: &mut Vec<u8>) {
    let (n, mut at) = (r.bytes().len(), 0);
    while at < n {
        let k = size().min(n - at);
        r.write_part(at, k, out)
            .expect("a merge's recoded text always writes");
        at += k;
    }
}

/// A merged body as the proxy sends it: its recoded text written in pieces of 3, 6, 9, ...
/// bytes' worth in turn, which never fails (the merge made it of text found to be base64).
fn sent_in_pieces(spliced: &mut response::Spliced<'_>) -> routed_experts::Result<Vec<u8>> {
    let mut out = Vec::new();
    for part in spliced.take_checked_recoded_parts()? {
        match part {
            response::Part::Bytes(b) => out.extend_from_slice(&b),
            response::Part::Recoded(r) => {
                let mut k = 0;
                write_in_parts(
                    &r,
                    || {
                        k = k % 30 + 3;
                        k
                    },
                    &mut out,
                );
            }
        }
    }
    Ok(out)
}
