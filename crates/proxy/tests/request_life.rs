//! The proxy's request life, end to end in one process: stand-in prefill and decode engines
//! (hyper servers answering as vLLM 0.32 does in P/D, as `routed_experts.stand_in_engine`
//! does in Python) behind a real `Server`, and a client. A change to the proxy is tested here
//! without building the Python extension.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use routed_experts::formats::encode_json;
use routed_experts::{from_response, DTypeChoice, Format, Hints, Payload, Shape};
use routed_experts_proxy::config::StreamRouting;
use routed_experts_proxy::{Config, Server, Stop};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const LAYERS: usize = 3;
const TOP_K: usize = 2;
/// Tokens per KV block: decode receives the prompt's whole blocks but the last position's.
const BLOCK: usize = 16;

/// The routing a monolithic engine would record at `pos`: distinct, nonzero, below 256.
fn truth(pos: usize) -> Vec<i64> {
    (0..LAYERS * TOP_K)
        .map(|i| ((pos * 7 + i * 3) % 250 + 1) as i64)
        .collect()
}

/// Rows `[start, stop)` of the truth as vLLM writes them: base64 of the rows' `.npy` file (a
/// JSON string; no start in it).
fn npy_routing(start: usize, stop: usize) -> Value {
    let values: Vec<i64> = (start..stop).flat_map(truth).collect();
    let shape = Shape::new(stop - start, LAYERS, TOP_K);
    let p = Payload::from_values(&values, shape, start as u64, DTypeChoice::Compact).unwrap();
    serde_json::from_slice(&encode_json(&p, Format::VllmNpy).unwrap()).unwrap()
}

/// How a stand-in engine answers.
#[derive(Clone, Copy, PartialEq)]
enum Engine {
    /// A working engine (prefill or decode, by the request's `kv_transfer_params`).
    Working,
    /// A prefill that returns no routing.
    NoRouting,
    /// An engine that fails with a 500.
    Crashes,
}

/// What a request asks, wherever its endpoint keeps it: (whether it is a generate request,
/// prompt length, tokens to generate, routing start).
fn asked(req: &Value) -> (bool, usize, usize, usize) {
    let generate = req.get("token_ids").is_some();
    let (prompt, limits) = match generate {
        true => (&req["token_ids"], &req["sampling_params"]),
        false => (&req["prompt"], req),
    };
    let count = |v: &Value, default: u64| v.as_u64().unwrap_or(default) as usize;
    (
        generate,
        prompt.as_array().map_or(0, Vec::len),
        count(&limits["max_tokens"], 4),
        count(&limits["routed_experts_prompt_start"], 0),
    )
}

/// vLLM 0.32's answer: prefill rows `[S, P)` with the `kv_transfer_params` decode needs;
/// decode rows `[S, P + G - 1)`, or a 500 when asked for rows of KV it received (a real one
/// dies); streams carry routing on generate's finishing event only, none on completions.
fn answer(engine: Engine, body: &[u8]) -> Response<Full<Bytes>> {
    let reply = |status: u16, kind: &'static str, text: String| {
        let mut r = Response::new(Full::new(Bytes::from(text)));
        *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
        r.headers_mut()
            .insert("content-type", kind.parse().unwrap());
        r
    };
    let json_reply = |status: u16, v: Value| reply(status, "application/json", v.to_string());
    if engine == Engine::Crashes {
        return json_reply(500, json!({"error": "engine crashed"}));
    }
    let req: Value = serde_json::from_slice(body).unwrap();
    let (generate, prompt, generated, start) = asked(&req);
    let kv = &req["kv_transfer_params"];
    if kv["do_remote_decode"] == json!(true) {
        let mut choice = json!({"index": 0, "text": "x", "finish_reason": "length"});
        if engine != Engine::NoRouting {
            choice["routed_experts"] = npy_routing(start, prompt);
        }
        let kv = json!({"do_remote_prefill": true, "remote_engine_id": "p1",
                        "remote_block_ids": [3]});
        return json_reply(
            200,
            json!({"id": "p", "choices": [choice], "kv_transfer_params": kv}),
        );
    }
    if kv["do_remote_prefill"] != json!(true) || !kv["remote_engine_id"].is_string() {
        let error = json!({"error": "decode needs prefill's kv_transfer_params"});
        return json_reply(400, error);
    }
    let received = (prompt - 1) / BLOCK * BLOCK;
    if start < received {
        let error = format!(
            "routing asked from {start}; positions before {received} came over \
                             the KV connector (a real vLLM 0.32 decode engine dies)"
        );
        return json_reply(500, json!({"error": error}));
    }
    let rows = npy_routing(start, prompt + generated - 1);
    if req["stream"] == json!(true) {
        let mut text = String::new();
        for i in 0..generated {
            let last = i == generated - 1;
            let mut chunk = json!({"id": "d", "choices": [{"index": 0, "text": " tok",
                                   "finish_reason": if last { json!("length") } else { Value::Null }}]});
            if generate {
                let value = if last { rows.clone() } else { Value::Null };
                chunk["choices"][0]["routed_experts"] = value;
            }
            text.push_str(&format!("data: {chunk}\n\n"));
        }
        text.push_str("data: [DONE]\n\n");
        return reply(200, "text/event-stream", text);
    }
    let choice =
        json!({"index": 0, "text": " tok", "finish_reason": "length", "routed_experts": rows});
    json_reply(200, json!({"id": "d", "choices": [choice]}))
}

/// A stand-in engine on a loopback port; counts the requests it served.
async fn engine(kind: Engine, served: Arc<AtomicUsize>) -> String {
    serve_engine(kind, None, move |_| {
        served.fetch_add(1, Ordering::SeqCst);
    })
    .await
}

/// A working stand-in engine that records each request's `session_id` as it arrives and
/// answers only while `gate` is open.
async fn recording_engine(
    gate: &tokio::sync::watch::Sender<bool>,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let url = serve_engine(Engine::Working, Some(gate.subscribe()), move |body| {
        let req: Value = serde_json::from_slice(body).unwrap();
        if let Some(id) = req["session_id"].as_str() {
            log.lock().unwrap().push(id.to_string());
        }
    })
    .await;
    (url, seen)
}

async fn serve_engine(
    kind: Engine,
    gate: Option<tokio::sync::watch::Receiver<bool>>,
    on_request: impl Fn(&[u8]) + Send + Sync + 'static,
) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let on_request = Arc::new(on_request);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (on_request, gate) = (Arc::clone(&on_request), gate.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let (on_request, mut gate) = (Arc::clone(&on_request), gate.clone());
                    async move {
                        if req.uri().path() == "/health" {
                            // The proxy's probe at start, as a real engine answers it; not a
                            // request served.
                            return Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())));
                        }
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        on_request(&body);
                        if let Some(gate) = gate.as_mut() {
                            let _ = gate.wait_for(|open| *open).await;
                        }
                        Ok::<_, Infallible>(answer(kind, &body))
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// The proxy in front of `prefill` and `decode`, serving on a thread of its own until dropped.
struct Running {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    stopper: routed_experts_proxy::Stopper,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    fn start(prefill: String, decode: String) -> Running {
        Running::start_many(vec![prefill], vec![decode])
    }

    fn start_many(prefill: Vec<String>, decode: Vec<String>) -> Running {
        let config = Config {
            prefill,
            decode,
            read_timeout: std::time::Duration::from_secs(30),
            ..Config::default()
        };
        Running::start_config(config, false)
    }

    fn start_config(config: Config, admin: bool) -> Running {
        let admin = admin.then(|| "127.0.0.1:0".parse().unwrap());
        let server = Server::bind(config, "127.0.0.1:0".parse().unwrap(), admin).unwrap();
        let addr = server.local_addr().unwrap();
        let admin = server.admin_addr();
        let stopper = server.stopper();
        let thread = std::thread::spawn(move || server.run(false).unwrap());
        Running {
            addr,
            admin,
            stopper,
            thread: Some(thread),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stopper.stop(Stop::Now);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The proxy in front of one working prefill and one working decode engine.
async fn working_proxy() -> Running {
    let (p, d) = counters();
    Running::start(
        engine(Engine::Working, p).await,
        engine(Engine::Working, d).await,
    )
}

/// A stream's `data:` payloads, in order.
fn data_lines(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect()
}

/// A request's status and whole body.
async fn send(req: Request<Full<Bytes>>) -> (u16, Vec<u8>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let r = client.request(req).await.unwrap();
    let status = r.status().as_u16();
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    (status, bytes.to_vec())
}

async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, Vec<u8>) {
    call(hyper::Method::POST, addr, path, body).await
}

async fn call(method: hyper::Method, addr: SocketAddr, path: &str, body: &str) -> (u16, Vec<u8>) {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    send(req).await
}

/// Long enough for whole KV blocks: decode asked for their rows would die.
const PROMPT: usize = 40;
const GENERATED: usize = 5;

fn completion(stream: bool) -> String {
    let prompt: Vec<usize> = (0..PROMPT).collect();
    json!({"model": "moe", "prompt": prompt, "max_tokens": GENERATED, "stream": stream}).to_string()
}

fn generate(stream: bool) -> String {
    let ids: Vec<usize> = (0..PROMPT).collect();
    json!({"token_ids": ids, "sampling_params": {"max_tokens": GENERATED}, "stream": stream})
        .to_string()
}

/// The routing in a body (or a stream event's JSON) equals the truth for every position.
fn assert_truth(json: &[u8]) {
    let p = from_response(json, 0, &Hints::default(), 1 << 20)
        .unwrap()
        .expect("routing in choice 0");
    assert_eq!((p.start(), p.num_tokens()), (0, PROMPT + GENERATED - 1));
    let want: Vec<u8> = (0..p.num_tokens())
        .flat_map(truth)
        .map(|v| v as u8)
        .collect();
    assert_eq!(p.values::<u8>(), &want[..]);
}

fn error_side(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap();
    v["error"]["side"].as_str().unwrap().to_string()
}

fn counters() -> (Arc<AtomicUsize>, Arc<AtomicUsize>) {
    (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_completion_merges_prefill_and_decode_to_the_truth() {
    let (p, d) = counters();
    let proxy = Running::start(
        engine(Engine::Working, Arc::clone(&p)).await,
        engine(Engine::Working, Arc::clone(&d)).await,
    );
    let (status, body) = post(proxy.addr, "/v1/completions", &completion(false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_truth(&body);
    assert_eq!((p.load(Ordering::SeqCst), d.load(Ordering::SeqCst)), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_relays_every_event_and_merges_the_routing_event() {
    let proxy = working_proxy().await;
    // vLLM 0.32 streams routing on generate only, the whole value on the finishing event.
    let (status, body) = post(proxy.addr, "/inference/v1/generate", &generate(true)).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    let events = data_lines(&text);
    assert_eq!(events.len(), GENERATED + 1, "{text}");
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let routed: Vec<&&str> = events
        .iter()
        .filter(|e| e.contains("\"routed_experts\":\"") || e.contains("\"shape\""))
        .collect();
    assert_eq!(routed.len(), 1, "{text}");
    assert!(routed[0].contains("\"finish_reason\":\"length\""));
    assert_truth(routed[0].as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completions_stream_is_answered_from_a_plain_decode_and_ends_with_its_routing() {
    // vLLM 0.32 sends no routing on completions streams: by default (`stream_routing`
    // buffered) decode is asked plainly and its merged answer goes out as the stream, the
    // content first, then the finishing chunk with the routing, then [DONE].
    let proxy = working_proxy().await;
    let (status, body) = post(proxy.addr, "/v1/completions", &completion(true)).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    let events = data_lines(&text);
    assert_eq!(events.len(), 3, "{text}");
    assert_eq!(events[2], "[DONE]");
    assert!(events[0].contains("\"finish_reason\":null"), "{text}");
    assert!(events[1].contains("\"finish_reason\":\"length\""), "{text}");
    assert_truth(events[1].as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_completions_stream_without_routing_ends_in_an_error_never_in_done() {
    // `stream_routing` relay: decode's own stream, which from vLLM 0.32 carries no routing on
    // completions. The client gets every token, then the proxy's error as the last event
    // (naming the setting that would have given it the routing), and no [DONE] it would stop
    // reading at.
    let (p, d) = counters();
    let config = Config {
        prefill: vec![engine(Engine::Working, p).await],
        decode: vec![engine(Engine::Working, d).await],
        stream_routing: StreamRouting::Relay,
        ..Config::default()
    };
    let proxy = Running::start_config(config, false);
    let (status, body) = post(proxy.addr, "/v1/completions", &completion(true)).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    let events = data_lines(&text);
    assert_eq!(events.len(), GENERATED + 1, "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    assert!(
        events[GENERATED].contains("missing routing on the decode side")
            && events[GENERATED].contains("--stream-routing buffered"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_is_asked_only_for_rows_it_computed() {
    // The engine answers 500 for rows of KV it received, as a real vLLM 0.32 dies: a 200
    // here, with the client's start below the received blocks, shows the proxy asked for
    // the prompt's last position on.
    let proxy = working_proxy().await;
    for start in [0u64, 3, 31] {
        let mut body: Value = serde_json::from_str(&completion(false)).unwrap();
        body["routed_experts_prompt_start"] = json!(start);
        let (status, reply) = post(proxy.addr, "/v1/completions", &body.to_string()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
        let hints = Hints {
            start: Some(start),
            ..Hints::default()
        };
        let p = from_response(&reply, 0, &hints, 1 << 20).unwrap().unwrap();
        assert_eq!(
            (p.start(), p.stop()),
            (start, (PROMPT + GENERATED - 1) as u64)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_decode_is_a_502_that_blames_decode() {
    let (p, d) = counters();
    let proxy = Running::start(
        engine(Engine::Working, p).await,
        engine(Engine::Crashes, d).await,
    );
    for stream in [false, true] {
        let (status, body) = post(proxy.addr, "/v1/completions", &completion(stream)).await;
        assert_eq!((status, error_side(&body).as_str()), (502, "decode"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_missing_on_prefill_is_a_502_that_blames_prefill_never_a_200() {
    let (p, d) = counters();
    let proxy = Running::start(
        engine(Engine::NoRouting, p).await,
        engine(Engine::Working, d).await,
    );
    // Without prefill's routing the proxy cannot tell the prompt's length, so decode is asked
    // from the client's start: one past the received blocks here, which decode computed.
    let mut body: Value = serde_json::from_str(&completion(false)).unwrap();
    body["routed_experts_prompt_start"] = json!(PROMPT - 1);
    let (status, body) = post(proxy.addr, "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_side(&body), "prefill");
    assert!(String::from_utf8_lossy(&body).contains("missing routing on the prefill side"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_prefill_is_a_502_that_blames_prefill() {
    // A port bound and never listened on, held to the end of the test: connections to it
    // are refused, and nothing else can take it meanwhile.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let closed = format!("http://{}", held.local_addr().unwrap());
    let (_, d) = counters();
    let proxy = Running::start(closed, engine(Engine::Working, Arc::clone(&d)).await);
    let (status, body) = post(proxy.addr, "/v1/completions", &completion(false)).await;
    assert_eq!((status, error_side(&body).as_str()), (502, "prefill"));
    assert_eq!(
        d.load(Ordering::SeqCst),
        0,
        "decode is never called without prefill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_client_body_is_a_400_that_reaches_no_server() {
    let (p, d) = counters();
    let proxy = Running::start(
        engine(Engine::Working, Arc::clone(&p)).await,
        engine(Engine::Working, Arc::clone(&d)).await,
    );
    for bad in ["{", "[1, 2]", r#"{"prompt": [1], "stream": "yes"}"#] {
        let (status, body) = post(proxy.addr, "/v1/completions", bad).await;
        assert_eq!(
            (status, error_side(&body).as_str()),
            (400, "client"),
            "{bad}"
        );
    }
    assert_eq!((p.load(Ordering::SeqCst), d.load(Ordering::SeqCst)), (0, 0));
}

async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let req = Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, body) = send(req).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_unknown_paths_and_wrong_methods_and_state_the_build() {
    let proxy = working_proxy().await;
    assert_eq!(get(proxy.addr, "/etc/passwd").await.0, 404);
    assert_eq!(get(proxy.addr, "/v1/completions").await.0, 405);
    assert_eq!(post(proxy.addr, "/health", "{}").await.0, 405);
    let (status, text) = get(proxy.addr, "/metrics").await;
    assert_eq!(status, 200);
    let line = |endpoint: &str, code: u16| {
        format!(
            "routed_experts_proxy_requests_total{{endpoint=\"{endpoint}\",side=\"client\",\
             status=\"{code}\"}} 1"
        )
    };
    assert!(text.contains(&line("other", 404)), "{text}");
    assert!(text.contains(&line("/v1/completions", 405)), "{text}");
    assert!(text.contains(&line("other", 405)), "{text}");
    assert!(
        !text.contains("passwd"),
        "a client's path never becomes a label"
    );
    let version = env!("CARGO_PKG_VERSION");
    assert!(text.contains(&format!(
        "routed_experts_proxy_build_info{{version=\"{version}\"}} 1"
    )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_meet_the_same_prefill_server_and_sessions_spread() {
    let served: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let mut prefills = Vec::new();
    for s in &served {
        prefills.push(engine(Engine::Working, Arc::clone(s)).await);
    }
    let (_, d) = counters();
    let proxy = Running::start_many(prefills, vec![engine(Engine::Working, d).await]);
    let with_session = |id: &str| {
        let mut body: Value = serde_json::from_str(&completion(false)).unwrap();
        body["session_id"] = json!(id);
        body.to_string()
    };
    let counts = || {
        served
            .iter()
            .map(|s| s.load(Ordering::SeqCst))
            .collect::<Vec<_>>()
    };
    // Six turns of one session: all on one prefill server.
    for _ in 0..6 {
        let (status, body) = post(proxy.addr, "/v1/completions", &with_session("rollout-7")).await;
        assert_eq!(status, 200);
        assert_truth(&body);
    }
    let after_one = counts();
    assert_eq!(
        after_one.iter().filter(|&&n| n == 6).count(),
        1,
        "{after_one:?}"
    );
    // Thirty sessions of one turn each: spread over every server.
    for i in 0..30 {
        let (status, _) = post(
            proxy.addr,
            "/v1/completions",
            &with_session(&format!("s{i}")),
        )
        .await;
        assert_eq!(status, 200);
    }
    let spread: Vec<usize> = counts()
        .iter()
        .zip(&after_one)
        .map(|(a, b)| a - b)
        .collect();
    assert!(spread.iter().all(|&n| n > 0), "{spread:?}");
}

/// Given where each session's request is held, the change to make to `/upstreams`.
type ChangeFor = Box<dyn FnOnce(&[usize]) -> (hyper::Method, String) + Send>;

/// Where each session's request went since the recorders were last cleared: the index of the
/// recorder that saw it.
fn placement(recorders: &[Arc<Mutex<Vec<String>>>], sessions: &[String]) -> Vec<usize> {
    sessions
        .iter()
        .map(|id| {
            let mut at = recorders
                .iter()
                .enumerate()
                .filter(|(_, r)| r.lock().unwrap().contains(id))
                .map(|(i, _)| i);
            let i = at.next().expect("every session was served");
            assert!(
                at.next().is_none(),
                "one session's one turn was served twice"
            );
            i
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_added_and_removed_under_load_lose_no_request_and_move_only_their_sessions() {
    let (gate, _) = tokio::sync::watch::channel(true);
    let mut urls = Vec::new();
    let mut recorders = Vec::new();
    for _ in 0..4 {
        let (url, seen) = recording_engine(&gate).await;
        urls.push(url);
        recorders.push(seen);
    }
    let (_, d) = counters();
    let config = Config {
        prefill: urls[..3].to_vec(),
        decode: vec![engine(Engine::Working, d).await],
        read_timeout: std::time::Duration::from_secs(30),
        ..Config::default()
    };
    let proxy = Running::start_config(config, true);
    let admin = proxy.admin.unwrap();
    let sessions: Vec<String> = (0..24).map(|i| format!("rollout-{i}")).collect();
    let body = |id: &str| {
        let mut body: Value = serde_json::from_str(&completion(false)).unwrap();
        body["session_id"] = json!(id);
        body.to_string()
    };
    let (gate, recorders, sessions, proxy_ref, body) =
        (&gate, &recorders, &sessions, &proxy, &body);
    // One turn per session, one at a time (no load, so each goes to its first server).
    let turn = || async {
        for r in recorders {
            r.lock().unwrap().clear();
        }
        for id in sessions {
            let (status, reply) = post(proxy_ref.addr, "/v1/completions", &body(id)).await;
            assert_eq!(status, 200);
            assert_truth(&reply);
        }
    };
    // A turn of every session at once, held at the engines while the change `change_for` picks
    // (from where each session's request is held) is made; returns that placement.
    let under_load = |change_for: ChangeFor| async move {
        for r in recorders {
            r.lock().unwrap().clear();
        }
        gate.send_replace(false);
        let arrived = || {
            recorders
                .iter()
                .map(|r| r.lock().unwrap().len())
                .sum::<usize>()
        };
        let before = arrived();
        let addr = proxy_ref.addr;
        let requests: Vec<_> = sessions
            .iter()
            .map(|id| {
                let b = body(id);
                tokio::spawn(async move { post(addr, "/v1/completions", &b).await })
            })
            .collect();
        let wait = async {
            while arrived() < before + sessions.len() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(20), wait)
            .await
            .unwrap();
        let held = placement(recorders, sessions);
        let (method, change) = change_for(&held);
        let (status, reply) = call(method, admin, "/upstreams", &change).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
        assert_eq!(reply, br#"{"changed":true}"#);
        gate.send_replace(true);
        for r in requests {
            let (status, reply) = r.await.unwrap();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
            assert_truth(&reply);
        }
        held
    };
    turn().await;
    // A server removed while it holds requests: they finish there; afterwards only its
    // sessions move (a session stays where its last request went).
    let change = |url: &str| json!({"side": "prefill", "url": url}).to_string();
    let removed = Arc::new(Mutex::new(0));
    let chosen = Arc::clone(&removed);
    let urls_held = urls.clone();
    let held = under_load(Box::new(move |held: &[usize]| {
        let busiest = (0..3)
            .max_by_key(|s| held.iter().filter(|&&f| f == *s).count())
            .unwrap();
        *chosen.lock().unwrap() = busiest;
        (hyper::Method::DELETE, change(&urls_held[busiest]))
    }))
    .await;
    let removed = *removed.lock().unwrap();
    turn().await;
    let after_removal = placement(recorders, sessions);
    for (h, a) in held.iter().zip(&after_removal) {
        if *h == removed {
            assert_ne!(*a, removed, "a session of the removed server stayed on it");
        } else {
            assert_eq!(a, h, "a session moved though its server stayed");
        }
    }
    // A server added under load moves no session: each stays with its cached prefix.
    let added = change(&urls[3]);
    let held = under_load(Box::new(move |_: &[usize]| (hyper::Method::POST, added))).await;
    turn().await;
    assert_eq!(placement(recorders, sessions), held);
    // The list, the metrics and the refusals say what happened.
    let (_, list) = get(admin, "/upstreams").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["prefill"]["servers"].as_array().unwrap().len(), 3);
    assert_eq!(list["prefill"]["policy"], "session");
    let (_, metrics) = get(admin, "/metrics").await;
    for change in ["added", "removed"] {
        let line = format!(
            "routed_experts_proxy_upstream_list_changes_total{{change=\"{change}\",side=\"prefill\"}} 1"
        );
        assert!(metrics.contains(&line), "{metrics}");
    }
    assert!(metrics.contains("choice=\"session\",side=\"prefill\""));
    let only = json!({"side": "decode", "url": list["decode"]["servers"][0]}).to_string();
    let (status, reply) = call(hyper::Method::DELETE, admin, "/upstreams", &only).await;
    assert_eq!(status, 409, "the last decode server stays");
    assert!(String::from_utf8_lossy(&reply).contains("last decode server"));
    let (status, reply) = call(
        hyper::Method::POST,
        admin,
        "/upstreams",
        r#"{"side":"both","url":"http://a:1"}"#,
    )
    .await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&reply).contains("side: expected"));
    // Clients cannot change the list (no admin routes on the service port).
    assert_eq!(
        call(
            hyper::Method::POST,
            proxy.addr,
            "/upstreams",
            &change(&urls[0])
        )
        .await
        .0,
        404
    );
}
