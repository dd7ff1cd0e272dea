//! Criterion benches of the pure-Rust core on real payload sizes, beside a memcpy of the same
//! bytes (the floor any decode has to pay once).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use routed_experts::{limits, sidecar, DTypeChoice, Payload, Shape};

/// Qwen3-235B-A22B, 32k tokens: 94 MoE layers, top_k 8, 128 experts (uint8).
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

fn codec(c: &mut Criterion) {
    let p = rollout(32 * 1024, 94, 8, 128);
    let wire = sidecar::encode(&p);
    let mut g = c.benchmark_group("qwen3-235b-32k");
    g.throughput(Throughput::Bytes(wire.len() as u64));
    g.sample_size(20);
    g.bench_function("decode", |b| {
        b.iter(|| sidecar::decode(black_box(&wire), limits::DEFAULT_MAX_BYTES).unwrap())
    });
    g.bench_function("encode", |b| b.iter(|| sidecar::encode(black_box(&p))));
    g.bench_function("memcpy_sidecar", |b| b.iter(|| black_box(&wire).to_vec()));
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
