//! Criterion benches of the pure-Rust core on real payload sizes (Qwen3-235B-A22B, 32k tokens:
//! 94 MoE layers, top_k 8, uint8), beside a copy of the same bytes (the floor any decode pays),
//! and the phases of the two-pass read that the one-pass read replaced (BENCHMARKS.md; the
//! before figures are in docs/benchmark-history.md).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use routed_experts::formats::{self, Format};
use routed_experts::response::{self, MergeOptions};
use routed_experts::trajectory::{Overlap, Trajectory};
use routed_experts::{limits, sidecar, DTypeChoice, Payload, Shape};

const TOKENS: usize = 32 * 1024;
const LIMIT: usize = limits::DEFAULT_MAX_BYTES;

fn rollout(tokens: usize, layers: usize, top_k: usize, experts: u64) -> Payload {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let values: Vec<i64> = (0..tokens * layers * top_k)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % experts) as i64
        })
        .collect();
    let shape = Shape::new(tokens, layers, top_k);
    Payload::from_values(&values, shape, 0, DTypeChoice::NumExperts(experts)).unwrap()
}

fn body(p: &Payload) -> Vec<u8> {
    let mut out = br#"{"id":"cmpl-1","choices":[{"index":0,"text":"x","routed_experts":"#.to_vec();
    out.extend_from_slice(&sidecar::encode(p));
    out.extend_from_slice(br#"}],"usage":{"prompt_tokens":1}}"#);
    out
}

/// A vLLM 0.22+ body: the routing as a base64 `.npy`, and the token counts its rows are checked
/// against (format.md §3.3): rows `[0, prompt + generated - 1)`.
fn npy_body(p: &Payload, prompt: usize, generated: usize) -> Vec<u8> {
    let mut out = br#"{"id":"cmpl-1","choices":[{"index":0,"text":"x","routed_experts":""#.to_vec();
    out.extend_from_slice(&formats::encode(p, Format::VllmNpy).unwrap());
    out.extend_from_slice(
        format!(r#""}}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{generated}}}}}"#)
            .as_bytes(),
    );
    out
}

/// vLLM's P/D pair as the proxy meets it: prefill's body with rows `[0, prompt)`, decode's with
/// rows `[prompt - 1, tokens)` (asked from P - 1), the merge options that say so, and prefill's
/// routing found once.
fn vllm_pair(p: &Payload, prompt: usize) -> (Vec<u8>, Vec<u8>, MergeOptions) {
    let tokens = p.num_tokens();
    let prefill = npy_body(&p.slice(0, prompt as u64).unwrap(), prompt, 1);
    let decode = p.slice(prompt as u64 - 1, tokens as u64).unwrap();
    let decode = npy_body(&decode, prompt, tokens - prompt + 1);
    let mut opts = MergeOptions::new(LIMIT);
    opts.decode_start = Some(prompt as u64 - 1);
    (prefill, decode, opts)
}

fn codec(c: &mut Criterion) {
    let p = rollout(TOKENS, 94, 8, 128);
    let wire = sidecar::encode(&p);
    let decode_body = body(&p);
    let mut g = c.benchmark_group("qwen3-235b-32k");
    g.throughput(Throughput::Bytes(wire.len() as u64));
    g.sample_size(20);
    g.bench_function("memcpy_sidecar", |b| b.iter(|| black_box(&wire).to_vec()));
    // The floor the issue sets decoding against: a copy of the same text into mapped memory.
    let mut mapped = wire.clone();
    g.bench_function("copy_sidecar_into_mapped", |b| {
        b.iter(|| mapped.copy_from_slice(black_box(&wire)))
    });
    g.bench_function("decode_sidecar", |b| {
        b.iter(|| sidecar::decode(black_box(&wire), LIMIT).unwrap())
    });
    // The phases of reading in two passes, as it was done before the one-pass read: the walk
    // that finds the data string's end, then the decode of the text found.
    g.bench_function("phase_walk_only", |b| {
        b.iter(|| sidecar::parse_fields(black_box(&wire)).unwrap())
    });
    let text = sidecar::validate(sidecar::parse_fields(&wire).unwrap(), LIMIT).unwrap();
    g.bench_function("phase_decode_only", |b| {
        b.iter(|| black_box(&text).decode().unwrap())
    });
    g.bench_function("two_pass_walk_then_decode", |b| {
        b.iter(|| {
            let fields = sidecar::parse_fields(black_box(&wire)).unwrap();
            sidecar::validate(fields, LIMIT).unwrap().decode().unwrap()
        })
    });
    g.bench_function("encode_sidecar", |b| {
        b.iter(|| sidecar::encode(black_box(&p)))
    });
    g.bench_function("encode_sidecar_into_mapped", |b| {
        b.iter(|| {
            let out: &mut [u8] = &mut mapped;
            // SAFETY: initialised bytes viewed as MaybeUninit (the same layout); the encoder
            // only stores bytes into them.
            let out = unsafe {
                std::slice::from_raw_parts_mut(
                    out.as_mut_ptr().cast::<std::mem::MaybeUninit<u8>>(),
                    out.len(),
                )
            };
            sidecar::encode_into(black_box(&p), out)
        })
    });
    g.bench_function("from_response", |b| {
        b.iter(|| {
            response::from_response(black_box(&decode_body), 0, &Default::default(), LIMIT).unwrap()
        })
    });
    let npy = npy_body(&p, TOKENS * 3 / 4, TOKENS / 4 + 1);
    g.bench_function("from_response_npy_counted", |b| {
        b.iter(|| response::from_response(black_box(&npy), 0, &Default::default(), LIMIT).unwrap())
    });
    g.finish();
}

fn merge(c: &mut Criterion) {
    let p = rollout(TOKENS, 94, 8, 128);
    let prompt = TOKENS * 3 / 4;
    let prefill_body = body(&p.slice(0, prompt as u64).unwrap());
    // Decode's full sequence with zeroed prompt rows, as a decode server sends it.
    let mut zeroed = p.bytes().to_vec();
    zeroed[..prompt * p.row_bytes()].fill(0);
    let decoded = Payload::new(
        0,
        p.shape(),
        p.dtype(),
        routed_experts::AlignedBytes::from_slice(&zeroed),
    );
    let decoded = decoded.unwrap();
    let decode_body = body(&decoded);
    let mut g = c.benchmark_group("merge-qwen3-235b-32k-prompt-3/4");
    g.throughput(Throughput::Bytes(decode_body.len() as u64));
    g.sample_size(10);
    // The floor for the splice: a copy of both bodies into mapped memory.
    let mut mapped = vec![0u8; prefill_body.len() + decode_body.len()];
    g.bench_function("copy_both_bodies_into_mapped", |b| {
        b.iter(|| {
            let (first, second) = mapped.split_at_mut(prefill_body.len());
            first.copy_from_slice(black_box(&prefill_body));
            second.copy_from_slice(black_box(&decode_body));
        })
    });
    for splice in [true, false] {
        let opts = MergeOptions {
            splice,
            ..MergeOptions::new(LIMIT)
        };
        let name = if splice {
            "merge_response_splice"
        } else {
            "merge_response_general"
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                response::merge_response(black_box(&prefill_body), black_box(&decode_body), opts)
                    .unwrap()
            })
        });
    }
    // vLLM 0.22+ halves (a prefill half generated one token), their rows checked against usage.
    let prefill_npy = npy_body(&p.slice(0, prompt as u64).unwrap(), prompt, 1);
    let decode_npy = npy_body(&decoded, prompt, TOKENS - prompt + 1);
    g.bench_function("merge_response_npy_counted", |b| {
        b.iter(|| {
            let opts = MergeOptions::new(LIMIT);
            response::merge_response(black_box(&prefill_npy), black_box(&decode_npy), opts).unwrap()
        })
    });
    g.finish();
}

/// One stream event of vLLM's shape (`.npy`, a 1,024-token prompt, decode's rows from P - 1 to
/// 32k) merged whole, and merged as it passes in 256 KiB pieces (the proxy's streaming merge),
/// beside a copy of the event.
fn stream_merge(c: &mut Criterion) {
    use routed_experts::response::{DataFirst, EventMerge, PrefillRows, Step, StreamOptions};
    let (prefill, event, opts) = vllm_pair(&rollout(TOKENS, 94, 8, 128), 1024);
    let found = routed_experts::read_body(&prefill).unwrap();
    let mut g = c.benchmark_group("stream-event-vllm-npy-qwen3-235b-32k");
    g.throughput(Throughput::Bytes(event.len() as u64));
    g.sample_size(10);
    g.bench_function("memcpy_event", |b| b.iter(|| black_box(&event).to_vec()));
    g.bench_function("merge_whole_event", |b| {
        b.iter(|| {
            response::merge_response_found(&prefill, &found, black_box(&event), opts)
                .and_then(|s| s.to_vec())
                .unwrap()
        })
    });
    // The pieces as a server would write them on (`keep`: to compare, once).
    let streamed = |keep: bool| {
        let rows = PrefillRows::new(&found, &opts);
        let stream = StreamOptions {
            merge: opts,
            data_first: DataFirst::Fallback,
            max_held: 1 << 20,
        };
        let mut m = EventMerge::new(&rows, stream);
        let (mut out, mut all, mut sent) = (Vec::new(), Vec::new(), 0);
        for piece in black_box(&event).chunks(256 << 10) {
            assert!(matches!(
                m.feed(piece, &mut out).unwrap(),
                Step::Streaming(_)
            ));
            sent += out.len();
            if keep {
                all.extend_from_slice(&out);
            }
            out.clear(); // written on, then let go
        }
        assert!(matches!(m.finish(&mut out).unwrap(), Step::Streaming(_)));
        all.extend_from_slice(&out);
        (sent + out.len(), all)
    };
    let whole = response::merge_response_found(&prefill, &found, &event, opts)
        .and_then(|s| s.to_vec())
        .unwrap();
    assert!(
        streamed(true).1 == whole,
        "the streamed merge differs from the whole merge"
    );
    g.bench_function("merge_as_it_passes_256k_pieces", |b| {
        b.iter(|| streamed(false).0)
    });
    g.finish();
}

/// A plain vLLM P/D pair of the proxy bench's shape (`bench-proxy --bodies vllm`: Qwen3-30B-A3B,
/// 8,192 tokens, a 7,681-token prompt, decode's 512 rows from P - 1): the whole merge beside one
/// pass of the streaming merge over the whole body, and a copy of the merged body.
fn plain_merge(c: &mut Criterion) {
    use routed_experts::response::{DataFirst, EventMerge, PrefillRows, Step, StreamOptions};
    let (prefill, decode, opts) = vllm_pair(&rollout(8192, 48, 8, 128), 8192 - 512 + 1);
    let found = routed_experts::read_body(&prefill).unwrap();
    let whole = response::merge_response_found(&prefill, &found, &decode, opts)
        .and_then(|s| s.to_vec())
        .unwrap();
    let one_pass = || {
        let rows = PrefillRows::new(&found, &opts);
        let stream = StreamOptions {
            merge: opts,
            data_first: DataFirst::Fallback,
            max_held: usize::MAX,
        };
        let mut m = EventMerge::new(&rows, stream);
        let mut out = Vec::with_capacity(whole.len());
        assert!(matches!(
            m.feed(black_box(&decode), &mut out).unwrap(),
            Step::Streaming(_)
        ));
        assert!(matches!(m.finish(&mut out).unwrap(), Step::Streaming(_)));
        out
    };
    assert!(one_pass() == whole, "one pass differs from the whole merge");
    let mut g = c.benchmark_group("plain-vllm-npy-qwen3-30b-8k");
    g.throughput(Throughput::Bytes(whole.len() as u64));
    g.sample_size(20);
    g.bench_function("memcpy_merged", |b| b.iter(|| black_box(&whole).to_vec()));
    g.bench_function("merge_whole_pieces", |b| {
        b.iter(|| {
            response::merge_response_found(&prefill, &found, black_box(&decode), opts).unwrap()
        })
    });
    g.bench_function("merge_one_pass", |b| b.iter(one_pass));
    // The proxy's `routing_format = "engine"`: vLLM's `.npy` kept, its text copied.
    let kept = MergeOptions {
        keep_format: true,
        ..opts
    };
    g.bench_function("merge_whole_pieces_kept_npy", |b| {
        b.iter(|| {
            response::merge_response_found(&prefill, &found, black_box(&decode), kept).unwrap()
        })
    });
    g.finish();
}

fn stitch(c: &mut Criterion) {
    let p = rollout(TOKENS, 94, 8, 128);
    let turns: Vec<Payload> = (0..64)
        .map(|i| {
            let (lo, hi) = ((i * TOKENS / 64) as u64, ((i + 1) * TOKENS / 64) as u64);
            p.slice(lo.saturating_sub(1), hi).unwrap()
        })
        .collect();
    let mut g = c.benchmark_group("stitch-64-turns-qwen3-235b-32k");
    g.throughput(Throughput::Bytes(p.bytes().len() as u64));
    g.sample_size(10);
    g.bench_function("trajectory_append", |b| {
        b.iter(|| {
            let mut t = Trajectory::new();
            for turn in &turns {
                t.append(turn, Overlap::Keep, usize::MAX).unwrap();
            }
            t.len()
        })
    });
    g.finish();
}

/// Replay quality on the same rollout: agreement against a copy in which every tenth router
/// picked one other expert (past the model's 128, so never already in the row), and the load.
/// The ids are random with repeats (about a fifth of the rows repeat one), which takes the
/// slower sorting path; `routed-experts bench --quality` measures valid top-k rows.
fn quality(c: &mut Criterion) {
    let p = rollout(TOKENS, 94, 8, 128);
    let mut values: Vec<i64> = (0..p.num_tokens() * 94 * 8)
        .map(|i| p.value_at(i))
        .collect();
    for router in (0..p.num_tokens() * 94).step_by(10) {
        values[router * 8] = 128 + (router % 100) as i64;
    }
    let shape = Shape::new(TOKENS, 94, 8);
    let q = Payload::from_values(&values, shape, 0, DTypeChoice::Exact(p.dtype())).unwrap();
    let mut g = c.benchmark_group("qwen3-235b-32k-quality");
    g.throughput(Throughput::Bytes(2 * p.bytes().len() as u64));
    g.sample_size(20);
    g.bench_function("memcpy_both_inputs", |b| {
        let mut dst = vec![0u8; 2 * p.bytes().len()];
        b.iter(|| {
            let (x, y) = dst.split_at_mut(p.bytes().len());
            x.copy_from_slice(black_box(p.bytes()));
            y.copy_from_slice(black_box(q.bytes()));
        })
    });
    g.bench_function("agreement", |b| {
        b.iter(|| routed_experts::agreement(black_box(&p), black_box(&q)).unwrap())
    });
    g.bench_function("expert_load", |b| {
        b.iter(|| {
            let mut load = routed_experts::ExpertLoad::new(94, 256, LIMIT).unwrap();
            load.add(black_box(&p)).unwrap();
            load
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    codec,
    merge,
    stream_merge,
    plain_merge,
    stitch,
    quality
);
criterion_main!(benches);
