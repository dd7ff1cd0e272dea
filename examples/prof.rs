use routed_experts::*;
use std::time::Instant;
fn t<R>(name: &str, f: impl Fn() -> R) {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let s = Instant::now();
        std::hint::black_box(f());
        best = best.min(s.elapsed().as_secs_f64());
    }
    println!("{name}: {:.2} ms", best * 1e3);
}
fn main() {
    let n = 32768 * 94 * 8;
    let vals: Vec<u8> = (0..n).map(|i| (i * 7 % 128) as u8).collect();
    let p = Payload::from_values(
        &vals,
        Shape::new(32768, 94, 8),
        0,
        DTypeChoice::Exact(DType::U8),
    )
    .unwrap();
    let wire = sidecar::encode(&p);
    let body = format!(
        "{{\"id\":\"x\",\"choices\":[{{\"index\":0,\"routed_experts\":{}}}]}}",
        String::from_utf8(wire.clone()).unwrap()
    )
    .into_bytes();
    t("memcpy body", || body.to_vec());
    t("memchr quote", || memchr::memchr(b'"', &body[40..]));
    t("memchr2 quote/backslash", || {
        memchr::memchr2(b'"', b'\\', &body[40..])
    });
    t("serde find_routing", || {
        response::find_routing(&body).unwrap().len()
    });
    t("sidecar parse_fields", || {
        sidecar::parse_fields(&wire).unwrap().shape
    });
    t("zeroed alloc+touch", || {
        let mut a = buffer::AlignedBytes::zeroed(n);
        a.as_mut_bytes()[..].fill(1);
        a.len()
    });
    let text = &wire[9..9 + b64::encoded_len(n)];
    let mut out = vec![0u8; n];
    t("b64 decode into warm buf", || {
        let mut o = out.clone();
        b64::decode_into(text, &mut o, "d").unwrap();
        o.len()
    });
    t("b64 check", || b64::check(text, "d").unwrap());
    t("sidecar decode", || {
        sidecar::decode(&wire, 1 << 30).unwrap().num_tokens()
    });
    t("from_response", || {
        response::from_response(&body, 0, &formats::Hints::default(), 1 << 30)
            .unwrap()
            .unwrap()
            .num_tokens()
    });
    out.clear();
}
