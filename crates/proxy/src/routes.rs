//! Exact routes: each path to its handler (completions, `/v1/models`, `/health`, `/metrics`),
//! 404 and 405 for the rest.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};

use super::fault::{push_json_string, Fault};
use super::parts::Outgoing;
use super::pool::{Outcome, Side};
use super::request::Api;

use super::call::upstream_headers;
use super::fault::Blame;
use super::inbound::{completion, upstream_auth};
use super::membership::{change_upstreams, upstream_list};
use super::proxy::{Proxy, Slot};
use super::record::{request_id, tag};
use super::responses::{fault_response, json_response, response, Body};

/// Which routes a listener serves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Routes {
    /// Completions and the operator endpoints.
    All,
    /// Completions only (the operator endpoints are on the admin port).
    Service,
    /// The operator endpoints only.
    Admin,
}

/// `GET /v1/models`, relayed from a decode server (clients call it first).
async fn models(proxy: &Arc<Proxy>, req: Request<Incoming>) -> Response<Body> {
    let id = request_id(&req);
    // The same rules as a completion: the upstream key in place of the client's, a slot
    // under --max-in-flight, the request timeout.
    let headers = upstream_headers(&id, upstream_auth(proxy, &req));
    let Some(_slot) = Slot::take(proxy) else {
        let mut response = fault_response(&proxy.in_flight_fault());
        tag(&mut response, &id);
        return response;
    };
    let answer = async {
        let lease = proxy.lease(Side::Decode, None).await?;
        let u = std::sync::Arc::clone(&lease.upstream);
        let result = proxy
            .upstreams
            .call(
                Method::GET,
                u.target.uri("/v1/models"),
                &headers,
                Bytes::new(),
                None,
            )
            .await;
        let result = match result {
            Ok(r) => {
                let status = r.status();
                let mut share = proxy.budget.share();
                let limit = proxy.config.max_upstream_bytes;
                let deadline = tokio::time::Instant::now() + proxy.config.read_timeout;
                let ceiling = proxy.budget.limit();
                proxy
                    .upstreams
                    .read_body(r, limit, &mut share, ceiling, deadline)
                    .await
                    .map(|b| (status, Outgoing::new(b, Some(share), None)))
            }
            Err(e) => Err(e),
        };
        let outcome = match &result {
            Ok((s, _)) => Outcome::of_status(s.as_u16()),
            Err(_) => Outcome::Failed,
        };
        let url = u.url.clone();
        proxy.release(Side::Decode, lease, outcome);
        result.map_err(|e| proxy.call_fault(Side::Decode, &url, e))
    };
    let answer = tokio::time::timeout(proxy.config.request_timeout, answer);
    let mut response = match answer.await {
        Ok(Ok((status, body))) => json_response(status.as_u16(), body),
        Ok(Err(fault)) => fault_response(&fault),
        Err(_) => fault_response(&proxy.request_timeout_fault()),
    };
    tag(&mut response, &id);
    response
}

pub(crate) async fn route(
    proxy: Arc<Proxy>,
    req: Request<Incoming>,
    routes: Routes,
) -> Response<Body> {
    let path = req.uri().path();
    let method = req.method().clone();
    // Exact routes: a path that merely ends like one (`/admin/v1/completions`,
    // `/etc/passwd/metrics`) is a 404, so an ingress's path rules cannot be walked around.
    if let Some((endpoint, api)) = Api::of(path).filter(|_| routes != Routes::Admin) {
        if method != Method::POST {
            proxy.metrics.request(endpoint, 405, Blame::Client.name());
            return not_allowed(format!("{endpoint} takes POST"), "POST");
        }
        return completion(&proxy, req, endpoint, api).await;
    }
    if path == "/upstreams" && routes != Routes::Service {
        return upstreams(&proxy, req, routes).await;
    }
    let operator = matches!(path, "/health" | "/metrics");
    let known = match routes {
        Routes::All => operator || matches!(path, "/v1/models" | "/healthcheck"),
        Routes::Service => matches!(path, "/v1/models" | "/healthcheck"),
        Routes::Admin => operator || path == "/healthcheck",
    };
    if !known {
        // Counted under one label: a client's paths never become metric labels.
        proxy.metrics.request("other", 404, Blame::Client.name());
        let mut shown = String::new();
        push_json_string(&mut shown, &path.chars().take(200).collect::<String>());
        return fault_response(&Fault::new(
            Blame::Client,
            404,
            format!("no {method} {shown}"),
        ));
    }
    if method != Method::GET && method != Method::HEAD {
        proxy.metrics.request("other", 405, Blame::Client.name());
        return not_allowed(format!("{path} takes GET"), "GET, HEAD");
    }
    match path {
        "/v1/models" => models(&proxy, req).await,
        "/healthcheck" => json_response(200, Bytes::from_static(br#"{"status":"ok"}"#)),
        "/health" => health(&proxy),
        _ => response(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            Bytes::from(proxy.metrics.render()),
        ),
    }
}

/// `/upstreams`: read anywhere the operator endpoints are served; changed only on the admin
/// port, which clients cannot reach.
async fn upstreams(proxy: &Proxy, req: Request<Incoming>, routes: Routes) -> Response<Body> {
    let method = req.method().clone();
    let change = method == Method::POST || method == Method::DELETE;
    if method == Method::GET || method == Method::HEAD {
        return upstream_list(proxy);
    }
    if change && routes == Routes::Admin {
        return change_upstreams(proxy, req, method == Method::POST).await;
    }
    proxy.metrics.request("other", 405, Blame::Client.name());
    if change {
        return not_allowed(
            "/upstreams is changed on the admin port only (--admin-port)".into(),
            "GET, HEAD",
        );
    }
    let allow = if routes == Routes::Admin {
        "GET, HEAD, POST, DELETE"
    } else {
        "GET, HEAD"
    };
    not_allowed(format!("/upstreams takes {allow}"), allow)
}

pub(crate) fn not_allowed(message: String, allow: &'static str) -> Response<Body> {
    fault_response(&Fault {
        allow: Some(allow),
        ..Fault::new(Blame::Client, 405, message)
    })
}

/// Each upstream's passive health; 503 when a side has no server in rotation.
pub(crate) fn health(proxy: &Proxy) -> Response<Body> {
    let ok = proxy.prefill.any_healthy() && proxy.decode.any_healthy();
    let side = |pool: &super::pool::Pool| {
        serde_json::Value::Array(
            pool.status()
                .iter()
                .map(|s| {
                    serde_json::json!({
                        "url": s.url,
                        "healthy": s.healthy,
                        "consecutive_failures": s.consecutive_failures,
                        "retry_in_s": (s.retry_in * 1000.0).round() / 1000.0,
                        "in_flight": s.in_flight,
                    })
                })
                .collect(),
        )
    };
    let doc = serde_json::json!({
        "status": if ok { "ok" } else { "unavailable" },
        "in_flight": proxy.in_flight.load(Ordering::Relaxed),
        "connections_limit": proxy.config.max_connections,
        "buffered_bytes": proxy.budget.used(),
        // Bytes held against --max-buffered-bytes: at the limit, replies wait or fail fast.
        "buffered_limit": proxy.budget.limit(),
        // Large replies waiting, in order, for room in the budget.
        "waiting_for_budget": proxy.budget.queued(),
        "prefill": side(&proxy.prefill),
        "decode": side(&proxy.decode),
        "policies": {"prefill": proxy.prefill.policy.name(), "decode": proxy.decode.policy.name()},
    });
    let body = serde_json::to_vec(&doc).unwrap_or_default();
    json_response(if ok { 200 } else { 503 }, Bytes::from(body))
}

#[cfg(test)]
mod tests {
    use crate::server::Stop;
    use crate::test_server::{status, unreachable_config, Running};

    /// The status line of each `(method, path)` asked of a proxy on one port (no admin port:
    /// every route there).
    fn statuses(asks: &[(&str, &str)]) -> Vec<String> {
        let proxy = Running::start(unreachable_config(), false);
        let out = asks
            .iter()
            .map(|(method, path)| status(proxy.addr, method, path))
            .collect();
        proxy.stop(Stop::Now).unwrap();
        out
    }

    #[test]
    fn routes_are_exact_and_a_wrong_method_is_a_405() {
        let got = statuses(&[
            ("GET", "/health"),
            ("GET", "/upstreams"),
            ("GET", "/v1/completions"),
            ("GET", "/v1/completions/"),
            ("GET", "/nowhere"),
        ]);
        assert!(got[0].contains(" 200"), "{got:?}");
        assert!(got[1].contains(" 200"), "{got:?}");
        assert!(got[2].contains(" 405"), "{got:?}");
        assert!(got[3].contains(" 404"), "{got:?}");
        assert!(got[4].contains(" 404"), "{got:?}");
    }
}
