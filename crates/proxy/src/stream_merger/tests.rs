//! The tests of `stream_merger`.

use super::*;
use routed_experts::DEFAULT_MAX_BYTES;

const PREFILL: &[u8] = br#"{"choices":[{"index":0,"routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}}]}"#;
const STREAM: &[u8] = b"data: {\"choices\":[{\"index\":0,\"text\":\"h\"}]}\n\n\
data: {\"choices\":[{\"index\":0,\"text\":\"i\",\"routed_experts\":{\"data\":\"Hh8oKQ==\",\"shape\":[2,1,2],\"start\":2,\"dtype\":\"uint8\"}}]}\n\n\
: a comment\n\ndata: [DONE]\n\n";

fn run(chunks: &[&[u8]], max_line: usize) -> Result<Vec<u8>, StreamError> {
    let prefill = Bytes::from_static(PREFILL);
    let found = routed_experts::read_body(&prefill).unwrap();
    let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    let mut m = StreamMerger::new(&prefill, &found, opts, max_line);
    let mut out = Vec::new();
    for c in chunks {
        m.feed(Bytes::copy_from_slice(c), &mut out)?;
    }
    m.finish(&mut out)?;
    assert!(m.merged);
    Ok(out.concat())
}

#[test]
fn any_chunking_gives_the_same_merged_stream() {
    let whole = run(&[STREAM], 1 << 20).unwrap();
    let text = String::from_utf8(whole.clone()).unwrap();
    assert!(
        text.contains(r#""data":"CgsUFR4fKCk=","shape":[4,1,2],"start":0"#),
        "{text}"
    );
    assert!(text.starts_with("data: {\"choices\":[{\"index\":0,\"text\":\"h\"}]}\n\n"));
    assert!(text.ends_with(": a comment\n\ndata: [DONE]\n\n"));
    for a in 0..STREAM.len() {
        for b in (a..STREAM.len()).step_by(7) {
            let got = run(&[&STREAM[..a], &STREAM[a..b], &STREAM[b..]], 1 << 20).unwrap();
            assert_eq!(got, whole, "split at {a}, {b}");
        }
    }
}

#[test]
fn an_event_in_one_byte_chunks_is_held_in_few_pieces_and_merges_the_same() {
    // A long routing event, one byte at a time, with a large chunk in the middle of it.
    let pad = "x".repeat(200_000);
    let event = format!(
        "data: {{\"pad\":\"{pad}\",{}",
        std::str::from_utf8(&STREAM[51..]).unwrap() // the routing event after `data: {`
    );
    let prefill = Bytes::from_static(PREFILL);
    let found = routed_experts::read_body(&prefill).unwrap();
    let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    let mut m = StreamMerger::new(&prefill, &found, opts, 1 << 20);
    let (mut out, bytes) = (Vec::new(), event.as_bytes());
    let (head, rest) = bytes.split_at(100_000);
    let (big, tail) = rest.split_at(50_000);
    for b in head {
        m.feed(Bytes::copy_from_slice(&[*b]), &mut out).unwrap();
    }
    m.feed(Bytes::copy_from_slice(big), &mut out).unwrap();
    // About its size held, in a piece per 64 KiB of small chunks (not one per byte).
    assert_eq!(m.buffered(), 150_000);
    assert!(m.partial.len() <= 4, "{} pieces", m.partial.len());
    for b in tail {
        m.feed(Bytes::copy_from_slice(&[*b]), &mut out).unwrap();
    }
    m.finish(&mut out).unwrap();
    assert!(m.merged);
    let got = String::from_utf8(out.concat()).unwrap();
    let merged = r#""data":"CgsUFR4fKCk=","shape":[4,1,2],"start":0"#;
    assert!(got.starts_with(&format!("data: {{\"pad\":\"{pad}\",")));
    assert!(got.contains(merged) && got.ends_with(": a comment\n\ndata: [DONE]\n\n"));
}

#[test]
fn a_line_past_the_large_size_is_held_in_one_buffer_and_passes_the_same() {
    let pad = vec![b'x'; OWN_PAGES_ABOVE + 100_000];
    let mut line = b": ".to_vec();
    line.extend_from_slice(&pad);
    line.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    let prefill = Bytes::from_static(PREFILL);
    let found = routed_experts::read_body(&prefill).unwrap();
    let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    let mut m = StreamMerger::new(&prefill, &found, opts, 64 << 20);
    let mut out = Vec::new();
    let cut = line.len() - 20;
    for piece in line[..cut].chunks(300_000) {
        m.feed(Bytes::copy_from_slice(piece), &mut out).unwrap();
    }
    assert!(m.partial.is_empty() && !m.joined.is_empty()); // one buffer, no pieces
    assert_eq!(m.buffered(), cut);
    m.feed(Bytes::copy_from_slice(&line[cut..]), &mut out)
        .unwrap();
    assert_eq!(m.buffered(), 0);
    assert!(m.finish(&mut out).is_err()); // prefill had routing and no event carried it
                                          // Everything but the `[DONE]`: the caller's error event ends the stream.
    assert_eq!(out.concat(), line[..line.len() - b"data: [DONE]\n\n".len()]);
}

#[test]
fn long_events_without_routing_pass_as_they_came() {
    let text = format!("data: {}\n\n", "x".repeat(100_000));
    let json = format!("data: {{\"t\":\"{}\"}}\n\n", "x".repeat(100_000));
    let stream = format!("{text}{json}{}", std::str::from_utf8(STREAM).unwrap());
    let merged = run(&[stream.as_bytes()], 1 << 20).unwrap();
    assert!(merged.starts_with(format!("{text}{json}").as_bytes()));
}

#[test]
fn a_cut_stream_a_long_line_and_missing_routing_are_errors() {
    let cut = &STREAM[..STREAM.len() - 14];
    assert!(matches!(run(&[cut], 1 << 20), Err(StreamError::NoDone)));
    assert!(matches!(
        run(&[STREAM], 100),
        Err(StreamError::LineTooLong(100))
    ));
    let prefill = Bytes::from_static(PREFILL);
    let found = routed_experts::read_body(&prefill).unwrap();
    let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    let mut m = StreamMerger::new(&prefill, &found, opts, 1 << 20);
    let mut out = Vec::new();
    m.feed(
        Bytes::from_static(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"),
        &mut out,
    )
    .unwrap();
    let Err(StreamError::Merge(e)) = m.finish(&mut out) else {
        panic!("a stream without routing passed")
    };
    assert!(
        e.to_string().contains("missing routing on the decode side"),
        "{e}"
    );
    // It says what the client can do instead (issue 55), and stays the same kind.
    assert!(
        e.to_string()
            .contains("run the proxy with --stream-routing buffered")
            && e.to_string().contains("ask without \"stream\"")
            && e.to_string().contains("or stream /inference/v1/generate"),
        "{e}"
    );
    assert_eq!(
        e.kind(),
        &routed_experts::ErrorKind::MissingRouting(routed_experts::Half::Decode)
    );
    // vLLM 0.32 streams no routing on /v1/completions: the `[DONE]` it sent is held back, so
    // the error event the relay writes next is not after it (clients stop at `[DONE]`).
    assert_eq!(out.concat(), b"data: {\"choices\":[]}\n\n");
}

#[test]
fn done_is_sent_only_by_a_finish_that_passes() {
    let prefill = Bytes::from_static(PREFILL);
    let found = routed_experts::read_body(&prefill).unwrap();
    let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    let mut m = StreamMerger::new(&prefill, &found, opts, 1 << 20);
    let mut out = Vec::new();
    m.feed(Bytes::from_static(STREAM), &mut out).unwrap();
    assert!(m.done());
    assert!(
        !out.concat().ends_with(b"[DONE]\n\n"),
        "sent before the checks"
    );
    m.finish(&mut out).unwrap();
    assert!(out.concat().ends_with(b"\n\ndata: [DONE]\n\n"));
}

/// A vLLM-shaped routing event past [`STREAM_ABOVE`]: `.npy` rows from P - 1, as
/// vLLM 0.32 sends them when asked from P - 1.
fn long_npy_stream() -> (Bytes, Vec<u8>, MergeOptions) {
    use routed_experts::{formats::encode_json, DType, DTypeChoice, Format, Payload, Shape};
    let (tokens, layers, top_k, prompt) = (12_000usize, 94usize, 8usize, 700usize);
    let row = layers * top_k;
    let ids: Vec<i64> = (0..tokens * row).map(|i| (i * 7 % 127) as i64).collect();
    let npy = |from: usize, to: usize| {
        let shape = Shape::new(to - from, layers, top_k);
        let p = Payload::from_values(
            &ids[from * row..to * row],
            shape,
            from as u64,
            DTypeChoice::Exact(DType::U8),
        )
        .unwrap();
        String::from_utf8(encode_json(&p, Format::VllmNpy).unwrap()).unwrap()
    };
    let prefill = format!(
        r#"{{"choices":[{{"index":0,"text":"x","routed_experts":{}}}]}}"#,
        npy(0, prompt)
    );
    let stream = format!(
            "data: {{\"choices\":[{{\"index\":0,\"text\":\"h\"}}]}}\n\n\
             data: {{\"choices\":[{{\"index\":0,\"text\":\"i\",\"routed_experts\":{}}}],\"usage\":null}}\n\n\
             data: [DONE]\n\n",
            npy(prompt - 1, tokens)
        );
    let mut opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    opts.decode_start = Some(prompt as u64 - 1);
    (Bytes::from(prefill), stream.into_bytes(), opts)
}

#[test]
fn a_long_event_merges_as_it_passes_to_the_bytes_of_the_whole_merge() {
    let (prefill, stream, opts) = long_npy_stream();
    // Answered compact, and in the engine's format (`.npy` text, `routing_format` engine).
    for keep_format in [false, true] {
        long_event_merges_as_it_passes(
            &prefill,
            &stream,
            MergeOptions {
                keep_format,
                ..opts
            },
        );
    }
}

fn long_event_merges_as_it_passes(prefill: &Bytes, stream: &[u8], opts: MergeOptions) {
    assert!(stream.len() > STREAM_ABOVE + (1 << 20));
    let found = routed_experts::read_body(prefill).unwrap();
    // `defer`: prefill's rows left to be written as they are sent, taken after each feed
    // as the relay takes them.
    let run = |piece: usize, streaming: bool, defer: bool| {
        let rows = OnceLock::new();
        let mut m = StreamMerger::new(prefill, &found, opts, 64 << 20);
        if streaming {
            m = m.streaming(&rows);
        }
        if defer {
            m = m.defer_rows();
        }
        let (mut out, mut most_held, mut excess, mut pieces) = (Vec::new(), 0, 0, 0);
        for c in stream.chunks(piece) {
            m.feed(Bytes::copy_from_slice(c), &mut out).unwrap();
            most_held = most_held.max(m.buffered());
            excess += m.take_output_excess();
            while let Some(p) = m.next_pending() {
                pieces += 1;
                out.push(p.unwrap());
            }
        }
        // What it sent beyond what it took in: prefill's rows, about 700 x 752 bytes in
        // base64 (705 KB), when the event streams, unless they are written as they are
        // sent (then pieces of at most 256 KiB); a whole merge's output is not counted so.
        match (streaming, defer) {
            (true, false) => assert!((600_000..1_000_000).contains(&excess), "{excess}"),
            (true, true) => {
                assert!(excess < 4096, "{excess}");
                // Prefill's rows (705 KB of text) came in pieces of at most 256 KiB.
                assert!(pieces >= 3, "{pieces}");
            }
            (false, _) => assert_eq!(excess, 0),
        }
        m.finish(&mut out).unwrap();
        assert!(m.merged);
        // Prefill's `.npy` rows are read from its text as they are sent: none held.
        assert_eq!(
            rows.get().map(PrefillRows::held_bytes),
            streaming.then_some(0)
        );
        (out.concat(), most_held, m.merged_bytes)
    };
    let (whole, held_whole, bytes_whole) = run(1 << 20, false, false);
    let npy_text = [
        &br#""routed_experts":""#[..],
        routed_experts::formats::NPY_B64_PREFIX,
    ]
    .concat();
    assert_eq!(
        whole.windows(npy_text.len()).any(|w| w == npy_text),
        opts.keep_format
    );
    assert!(held_whole > STREAM_ABOVE); // the whole event, held
                                        // Merged whole with the re-encoded rows written as they are sent: the same bytes.
    let (deferred, _, bytes) = run(1 << 20, false, true);
    assert!(
        deferred == whole,
        "the whole merge with its rows written as sent differs"
    );
    assert_eq!(bytes, bytes_whole);
    for (piece, defer) in [4095, 256 << 10, 1 << 20, 3_000_001]
        .into_iter()
        .flat_map(|p| [(p, false), (p, true)])
    {
        let (streamed, held, bytes) = run(piece, true, defer);
        assert!(
            streamed == whole,
            "pieces of {piece} (deferred: {defer}): the merged stream differs"
        );
        assert_eq!(bytes, bytes_whole);
        // Up to the size at which it begins to stream, then O(piece); with the rows
        // written as they are sent, what that first size merged to waits behind them
        // until the caller takes it.
        let waits = if defer { STREAM_ABOVE + (64 << 10) } else { 0 };
        assert!(
            held < STREAM_ABOVE + 2 * piece + waits,
            "pieces of {piece}: {held} held"
        );
    }
}

#[test]
fn a_long_event_broken_after_its_merge_began_ends_without_its_closing_bytes_or_done() {
    let (prefill, mut stream, opts) = long_npy_stream();
    let found = routed_experts::read_body(&prefill).unwrap();
    let at = STREAM_ABOVE + (1 << 20); // inside the routing data, after the merge began
    assert!(stream[at].is_ascii_alphanumeric());
    stream[at] = b'-';
    let rows = OnceLock::new();
    let mut m = StreamMerger::new(&prefill, &found, opts, 64 << 20).streaming(&rows);
    let mut out = Vec::new();
    let mut failed = None;
    for c in stream.chunks(256 << 10) {
        if let Err(e) = m.feed(Bytes::copy_from_slice(c), &mut out) {
            failed = Some(e);
            break;
        }
    }
    let Some(StreamError::Merge(e)) = failed else {
        panic!("a broken event passed")
    };
    assert!(e.to_string().contains("data"), "{e}");
    let sent = out.concat();
    assert!(sent.len() > STREAM_ABOVE); // it had begun to stream
    assert!(!sent.ends_with(b"\n") && !sent.ends_with(b"}")); // a half line, never JSON
    assert!(memmem::find(&sent, b"[DONE]").is_none());
}

#[test]
fn a_long_compact_sidecar_with_data_first_is_merged_whole() {
    // Its start comes after its rows: handed back before a byte is sent, merged whole.
    let rows_cell = OnceLock::new();
    let data = "A".repeat(STREAM_ABOVE + 8); // 0-valued rows: 4 characters make 3 bytes
    let n = data.len() / 4 * 3 / 2; // tokens of 1 layer, top_k 2
    let event = format!(
            "data: {{\"choices\":[{{\"index\":0,\"routed_experts\":{{\"data\":\"{data}\",\"shape\":[{n},1,2],\"start\":0,\"dtype\":\"uint8\"}}}}]}}\n\ndata: [DONE]\n\n"
        );
    let prefill = Bytes::from_static(PREFILL);
    let found = routed_experts::read_body(&prefill).unwrap();
    let opts = MergeOptions::new(DEFAULT_MAX_BYTES);
    let run = |streaming: bool| {
        let mut m = StreamMerger::new(&prefill, &found, opts, 64 << 20);
        if streaming {
            m = m.streaming(&rows_cell);
        }
        let mut out = Vec::new();
        for c in event.as_bytes().chunks(1 << 20) {
            m.feed(Bytes::copy_from_slice(c), &mut out).unwrap();
        }
        m.finish(&mut out).unwrap();
        out.concat()
    };
    assert!(run(true) == run(false));
}
