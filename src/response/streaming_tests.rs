//! The streaming merge against the whole-event merge (`merge_response_found`): random payloads
//! in both shapes, every way of fitting (and not fitting) the halves, random chunkings, random
//! one-byte mutations; and a large event held in O(piece).

use super::*;
use crate::body::read_body;
use crate::formats::{self, Format, Hints};
use crate::limits::DEFAULT_MAX_BYTES;
use crate::payload::dtype::DType;
use crate::payload::{DTypeChoice, Payload, Shape};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// In `[lo, hi]`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn chance(&mut self, n: u64) -> bool {
        self.next() % n == 0
    }
}

fn payload(
    values: &[i64],
    start: u64,
    rows: usize,
    layers: usize,
    top_k: usize,
    dtype: DType,
) -> Payload {
    Payload::from_values(
        values,
        Shape::new(rows, layers, top_k),
        start,
        DTypeChoice::Exact(dtype),
    )
    .unwrap()
}

/// A compact sidecar's text in one of the key orders and spacings producers write.
fn sidecar_text(p: &Payload, style: u64) -> String {
    let canonical = String::from_utf8(crate::formats::sidecar::encode(p)).unwrap();
    let data = &canonical[9..canonical.find("\",\"shape\"").unwrap()];
    let s = p.shape();
    match style {
        // data first, no spaces (format.md §3.1)
        0 => canonical,
        // Python's json.dumps (the bench)
        1 => format!(
            r#"{{"data": "{data}", "shape": [{}, {}, {}], "start": {}, "dtype": "{}"}}"#,
            s.tokens,
            s.layers,
            s.top_k,
            p.start(),
            p.dtype()
        ),
        // the header first
        _ => format!(
            r#"{{"shape":[{},{},{}],"start":{},"dtype":"{}","data":"{data}"}}"#,
            s.tokens,
            s.layers,
            s.top_k,
            p.start(),
            p.dtype()
        ),
    }
}

fn npy_text(p: &Payload) -> String {
    String::from_utf8(formats::encode_json(p, Format::VllmNpy).unwrap()).unwrap()
}

/// What a whole merge or a streaming one made of an event.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Bytes(Vec<u8>),
    Error(String),
    Fallback,
}

fn whole(prefill: &[u8], event: &[u8], opts: MergeOptions) -> Outcome {
    let routing = read_body(prefill).unwrap();
    match merge_response_found(prefill, &routing, event, opts).and_then(|s| s.to_vec()) {
        Ok(b) => Outcome::Bytes(b),
        Err(e) => Outcome::Error(e.to_string()),
    }
}

/// The event fed in `cuts`' pieces; also the peak bytes the merger held.
fn streamed(
    prefill: &PrefillRows,
    event: &[u8],
    cuts: &[usize],
    opts: StreamOptions,
) -> (Outcome, usize) {
    let (outcome, peak, _) = streamed_in_parts(prefill, event, cuts, opts, 3);
    (outcome, peak)
}

/// [`streamed`], with the rows left to be written as they are sent (`defer_recode`) written
/// `part` bytes at a time (a multiple of 3) where they go; also how many such parts it had.
fn streamed_in_parts(
    prefill: &PrefillRows,
    event: &[u8],
    cuts: &[usize],
    opts: StreamOptions,
    part: usize,
) -> (Outcome, usize, usize) {
    let m = EventMerge::new(prefill, opts);
    let (mut out, mut later) = (Vec::new(), Vec::new());
    let (outcome, peak) = fed(m, event, cuts, &mut out, &mut later);
    let parts = later.len();
    let Outcome::Bytes(_) = outcome else {
        return (outcome, peak, parts);
    };
    let mut sent = Vec::new();
    let mut copied = 0;
    for (at, r) in later {
        sent.extend_from_slice(&out[copied..at]);
        copied = at;
        r.write_in_parts(|| part, &mut sent);
    }
    sent.extend_from_slice(&out[copied..]);
    (Outcome::Bytes(sent), peak, parts)
}

/// The event fed to `m` in `cuts`' pieces, the merged bytes in `out` and the rows left to be
/// written as they are sent in `later` (the outcome's bytes are left empty); the peak held.
fn fed<'p>(
    mut m: EventMerge<'p>,
    event: &[u8],
    cuts: &[usize],
    out: &mut Vec<u8>,
    later: &mut Vec<(usize, Recoded<'p>)>,
) -> (Outcome, usize) {
    let mut at = 0;
    for &cut in cuts.iter().chain(std::iter::once(&event.len())) {
        let cut = cut.clamp(at, event.len());
        let r = m.feed(&event[at..cut], out);
        later.extend(m.take_deferred());
        match r {
            Ok(Step::Streaming(_)) => {}
            Ok(Step::Fallback(held)) => {
                assert!(out.is_empty(), "a fallback after bytes were sent");
                assert_eq!(held, event[..cut], "a fallback hands back every byte fed");
                return (Outcome::Fallback, m.peak_held());
            }
            Err(e) => return (Outcome::Error(e.to_string()), m.peak_held()),
        }
        at = cut;
    }
    let peak = m.peak_held();
    match m.finish(out) {
        Ok(Step::Streaming(_)) => (Outcome::Bytes(Vec::new()), peak),
        Ok(Step::Fallback(held)) => {
            assert!(out.is_empty());
            assert_eq!(held, event);
            (Outcome::Fallback, peak)
        }
        Err(e) => (Outcome::Error(e.to_string()), peak),
    }
}

/// Random cut points: one-byte pieces, small ones, or a few large ones.
fn chunking(rng: &mut Rng, len: usize) -> Vec<usize> {
    let mut cuts = Vec::new();
    let mode = rng.range(0, 3);
    let mut at = 0;
    while at < len {
        at += match mode {
            0 => 1,
            1 => rng.range(1, 8) as usize,
            2 => rng.range(1, 200) as usize,
            _ => rng.range(1, len as u64) as usize,
        };
        cuts.push(at.min(len));
    }
    cuts
}

struct Case {
    prefill: Vec<u8>,
    event: Vec<u8>,
    opts: StreamOptions,
    what: String,
}

fn make_case(rng: &mut Rng) -> Case {
    let layers = rng.range(1, 4) as usize;
    let top_k = rng.range(1, 3) as usize;
    let dtype = if rng.chance(2) { DType::U8 } else { DType::U16 };
    let total = rng.range(1, 200);
    let max = if dtype == DType::U8 { 255 } else { 65535 };
    let truth: Vec<i64> = (0..total as usize * layers * top_k)
        .map(|_| rng.range(0, max) as i64)
        .collect();
    let row = layers * top_k;
    let rows = |from: u64, to: u64| truth[from as usize * row..to as usize * row].to_vec();
    let p_start = if rng.chance(4) {
        rng.range(0, total - 1)
    } else {
        0
    };
    let p_end = rng.range(p_start, total);
    // Mostly halves that merge; sometimes a gap, a decode that ends early, another dtype.
    let d_start = match rng.range(0, 9) {
        0 => rng.range(p_end, total), // a gap unless p_end
        1 => rng.range(0, total),
        _ => rng.range(p_start, p_end),
    };
    let d_end = if rng.chance(10) {
        rng.range(d_start, total)
    } else {
        total
    };
    let d_dtype = if rng.chance(12) { DType::U16 } else { dtype };
    let mut d_values = rows(d_start, d_end);
    if rng.chance(2) {
        // Prompt rows zeroed, as a decode server that did not compute them sends.
        let zeroed = (p_end.saturating_sub(d_start).min(d_end - d_start)) as usize * row;
        d_values[..zeroed].iter_mut().for_each(|v| *v = 0);
    }
    let prefill = payload(
        &rows(p_start, p_end),
        p_start,
        (p_end - p_start) as usize,
        layers,
        top_k,
        dtype,
    );
    let decode = payload(
        &d_values,
        d_start,
        (d_end - d_start) as usize,
        layers,
        top_k,
        d_dtype,
    );

    let prefill_npy = rng.chance(3);
    let p_value = if prefill_npy {
        npy_text(&prefill)
    } else {
        sidecar_text(&prefill, 0)
    };
    let prefill_body = format!(
        r#"{{"id":"p","choices":[{{"index":0,"text":"x","routed_experts":{p_value}}}],"usage":{{"prompt_tokens":{p_end},"completion_tokens":1}}}}"#
    );
    let shape = rng.range(0, 3); // 0: .npy, 1-3: sidecar styles
    let d_value = if shape == 0 {
        npy_text(&decode)
    } else {
        sidecar_text(&decode, shape - 1)
    };
    let usage = match rng.range(0, 3) {
        0 => "null".to_string(),
        1 => format!(
            r#"{{"prompt_tokens":{p_end},"completion_tokens":{}}}"#,
            d_end + 1 - p_end.min(d_end)
        ),
        _ => format!(
            r#"{{"prompt_tokens":{},"completion_tokens":{}}}"#,
            rng.range(0, 300),
            rng.range(0, 300)
        ),
    };
    let index = if rng.chance(6) {
        String::new()
    } else {
        r#""index":0,"#.to_string()
    };
    let event = format!(
        r#"{{"id":"cmpl-d","object":"text_completion","choices":[{{{index}"text":" tok","logprobs":null,"finish_reason":"length","routed_experts":{d_value},"stop_reason":null}}],"usage":{usage}}}"#
    ) + "\n";
    let expect = if rng.chance(5) {
        rng.range(0, total)
    } else {
        d_start
    };
    let mut merge = MergeOptions::new(DEFAULT_MAX_BYTES);
    merge.hints = Hints {
        start: prefill_npy.then_some(p_start),
        ..Hints::default()
    };
    merge.decode_start = Some(d_start);
    merge.keep_format = rng.chance(2);
    let data_first = if rng.chance(4) {
        DataFirst::Fallback
    } else {
        DataFirst::Expect(expect)
    };
    Case {
        prefill: prefill_body.into_bytes(),
        event: event.into_bytes(),
        opts: StreamOptions { merge, data_first, max_held: 1 << 20 },
        what: format!(
            "L{layers} K{top_k} {dtype}/{d_dtype} prefill [{p_start},{p_end}) {} decode [{d_start},{d_end}) shape {shape} {data_first:?} keep_format {}",
            if prefill_npy { "npy" } else { "compact" },
            merge.keep_format
        ),
    }
}

const MUTANTS: &[u8] = b"\"\\=A/+}{],:0 9-.ez\x01\xff";

#[test]
fn streaming_equals_the_whole_merge() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let cases: usize = std::env::var("PROP_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500);
    let (mut same, mut errors, mut fallbacks, mut expected_refusals) = (0, 0, 0, 0);
    let mut kept = 0; // of `same`, merged in the engine's format (`.npy` text kept)
    let mut deferred = 0; // chunkings whose prefill rows were left to be written as sent
    let mut divergences = Vec::new();
    for n in 0..cases {
        let mut case = make_case(&mut rng);
        let mutated = rng.chance(3);
        if mutated {
            let at = rng.range(0, case.event.len() as u64 - 1) as usize;
            case.event[at] = MUTANTS[rng.range(0, MUTANTS.len() as u64 - 1) as usize];
        }
        // Half the cases leave prefill's rows to be written as they are sent, in parts of
        // random lengths (drawn apart, so the cases are those drawn without them).
        let mut side = Rng(0x2545_f491_4f6c_dd1d ^ (n as u64 + 1));
        case.opts.merge.defer_recode = side.chance(2);
        let routing = read_body(&case.prefill).unwrap();
        let rows = PrefillRows::new(&routing, &case.opts.merge);
        let want = whole(&case.prefill, &case.event, case.opts.merge);
        for _ in 0..3 {
            let cuts = chunking(&mut rng, case.event.len());
            let part = 3 * side.range(1, 6) as usize;
            let (got, _, parts) = streamed_in_parts(&rows, &case.event, &cuts, case.opts, part);
            assert!(parts == 0 || case.opts.merge.defer_recode);
            deferred += usize::from(parts > 0);
            match (&want, &got) {
                (_, Outcome::Fallback) => fallbacks += 1,
                (Outcome::Bytes(a), Outcome::Bytes(b)) if a == b => {
                    same += 1;
                    kept += usize::from(case.opts.merge.keep_format);
                }
                (Outcome::Error(_), Outcome::Error(_)) => errors += 1,
                // The policy DataFirst::Expect chose: a sidecar stating another start or
                // dtype than expected, data first, is refused where the whole merge merges it.
                (Outcome::Bytes(_), Outcome::Error(e)) if e.contains("but its data came first") => {
                    expected_refusals += 1
                }
                _ => divergences.push(format!(
                    "case {n} ({}{}), cuts {:?}:\n  whole: {}\n  streamed: {}\n  event: {}",
                    case.what,
                    if mutated { ", mutated" } else { "" },
                    &cuts[..cuts.len().min(8)],
                    brief(&want),
                    brief(&got),
                    String::from_utf8_lossy(&case.event[..case.event.len().min(400)])
                )),
            }
        }
    }
    eprintln!(
        "{cases} cases x 3 chunkings: {same} identical bytes ({kept} kept as .npy, {deferred} \
         with rows written as sent), {errors} errors both ways, {fallbacks} fallbacks, \
         {expected_refusals} refusals by the data-first policy, {} divergences",
        divergences.len()
    );
    assert!(
        divergences.is_empty(),
        "{}",
        divergences[..divergences.len().min(5)].join("\n")
    );
    // Half the cases keep the engine's format, in which only `.npy` values stream.
    assert!(same > cases * 3 / 4, "too few merges streamed: {same}");
    assert!(
        kept > cases / 10,
        "too few merges streamed as .npy text: {kept}"
    );
    assert!(
        deferred > cases / 4,
        "too few merges with rows written as sent: {deferred}"
    );
}

fn brief(o: &Outcome) -> String {
    match o {
        Outcome::Bytes(b) => format!(
            "{} bytes: {}",
            b.len(),
            String::from_utf8_lossy(&b[..b.len().min(300)])
        ),
        Outcome::Error(e) => format!("error: {e}"),
        Outcome::Fallback => "fallback".into(),
    }
}

/// A vLLM-shaped event of 8 MiB (`.npy`, decode's rows from P - 1) fed in 64 KiB pieces: the
/// whole merge's bytes, with the merger's own buffers O(piece), never the event.
#[test]
fn a_large_event_is_merged_in_o_piece() {
    const PIECE: usize = 64 << 10;
    let (tokens, layers, top_k) = (11_000usize, 94usize, 8usize);
    let mut rng = Rng(11);
    let row = layers * top_k;
    let t: Vec<i64> = (0..tokens * row)
        .map(|_| (rng.next() % 128) as i64)
        .collect();
    let prompt = 1024;
    let prefill = payload(&t[..prompt * row], 0, prompt, layers, top_k, DType::U8);
    let decode = payload(
        &t[(prompt - 1) * row..],
        prompt as u64 - 1,
        tokens - prompt + 1,
        layers,
        top_k,
        DType::U8,
    );
    let prefill_body = format!(
        r#"{{"id":"cmpl-p","choices":[{{"index":0,"text":"x","routed_experts":{}}}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":1}}}}"#,
        npy_text(&prefill)
    );
    let event = format!(
        r#"{{"id":"cmpl-d","choices":[{{"index":0,"text":" tok","routed_experts":{}}}],"usage":null}}"#,
        npy_text(&decode)
    ) + "\n";
    assert!(event.len() > 8 << 20);
    let mut merge = MergeOptions::new(DEFAULT_MAX_BYTES);
    merge.decode_start = Some(prompt as u64 - 1);
    let opts = StreamOptions {
        merge,
        data_first: DataFirst::Fallback,
        max_held: 1 << 20,
    };
    let routing = read_body(prefill_body.as_bytes()).unwrap();
    let rows = PrefillRows::new(&routing, &merge);
    assert_eq!(rows.held_bytes(), 0); // prefill's rows are read from its text as they are sent
    let cuts: Vec<usize> = (1..)
        .map(|i| i * PIECE)
        .take_while(|&c| c < event.len())
        .collect();
    let (got, peak) = streamed(&rows, event.as_bytes(), &cuts, opts);
    assert_eq!(got, whole(prefill_body.as_bytes(), event.as_bytes(), merge));
    assert!(peak < 2 * PIECE, "held {peak}");
    // Prefill's rows left to be written as they are sent: the merge writes none of their text
    // itself (all but a group or two at each end), and the bytes sent are the same.
    let deferred = StreamOptions {
        merge: MergeOptions {
            defer_recode: true,
            ..merge
        },
        ..opts
    };
    let (mut out, mut later) = (Vec::new(), Vec::new());
    let m = EventMerge::new(&rows, deferred);
    let (outcome, _) = fed(m, event.as_bytes(), &cuts, &mut out, &mut later);
    assert_eq!(outcome, Outcome::Bytes(Vec::new()));
    let prompt_text = prompt * row / 3 * 4;
    assert_eq!(later.len(), 1);
    assert!(later[0].1.len() > prompt_text - 8, "{}", later[0].1.len());
    let Outcome::Bytes(want) = whole(prefill_body.as_bytes(), event.as_bytes(), merge) else {
        panic!("the whole merge failed");
    };
    assert_eq!(out.len() + later[0].1.len(), want.len());
    let (got, _, _) = streamed_in_parts(&rows, event.as_bytes(), &cuts, deferred, 3 << 16);
    assert_eq!(got, Outcome::Bytes(want));
    // Kept as `.npy` text (the proxy's `routing_format` "engine"): the same, in `.npy` text.
    let kept = MergeOptions {
        keep_format: true,
        ..merge
    };
    let (got, peak) = streamed(
        &rows,
        event.as_bytes(),
        &cuts,
        StreamOptions {
            merge: kept,
            ..opts
        },
    );
    let want = whole(prefill_body.as_bytes(), event.as_bytes(), kept);
    let marker = [
        &b"\"routed_experts\":\""[..],
        crate::formats::NPY_B64_PREFIX,
    ]
    .concat();
    let is_npy = |b: &[u8]| b.windows(marker.len()).any(|w| w == marker);
    assert!(matches!(&want, Outcome::Bytes(b) if is_npy(b)));
    assert_eq!(got, want);
    assert!(peak < 2 * PIECE, "held {peak}");
    // A compact sidecar whose data comes first: its start is known only after its rows, so
    // the policy the proxy uses hands the event back (exact, no saving).
    let sidecar_event = format!(
        r#"{{"choices":[{{"index":0,"routed_experts":{}}}]}}"#,
        sidecar_text(&decode, 0)
    );
    let (got, _) = streamed(&rows, sidecar_event.as_bytes(), &cuts, opts);
    assert_eq!(got, Outcome::Fallback);
}
