//! Servers added and removed while the proxy runs: `POST` and `DELETE /upstreams` on the admin
//! port, and the upstreams file re-read on SIGHUP. A request under way holds its server, so a
//! server removed finishes what it is serving; a session moves only if its server left.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::Request;

use super::config::ConfigError;
use super::fault::{Blame, Fault};
use super::pool::{Changed, Side};
use super::proxy::Proxy;
use super::responses::{fault_response, json_response, Body};

/// The largest body `/upstreams` reads: one side and one URL.
const MAX_CHANGE_BYTES: usize = 64 << 10;
/// How long that body may take to arrive.
const CHANGE_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// `GET /upstreams`: each side's servers, in order, and its policy.
pub(crate) fn upstream_list(proxy: &Proxy) -> hyper::Response<Body> {
    let side = |pool: &super::pool::Pool| serde_json::json!({"policy": pool.policy.name(), "servers": pool.urls()});
    let doc = serde_json::json!({
        "prefill": side(&proxy.prefill),
        "decode": side(&proxy.decode),
    });
    json_response(
        200,
        Bytes::from(serde_json::to_vec(&doc).unwrap_or_default()),
    )
}

/// `POST /upstreams` (`add`) or `DELETE /upstreams` with `{"side": "prefill"|"decode",
/// "url": "http://HOST:PORT"}`: 200 with `{"changed": bool}` (false: it was already there,
/// or not there), 400 for a bad body, 409 for the side's last server.
pub(crate) async fn change_upstreams(
    proxy: &Proxy,
    req: Request<Incoming>,
    add: bool,
) -> hyper::Response<Body> {
    match read_change(req).await.and_then(|(side, url)| {
        let pool = proxy.pool(side);
        let changed = if add {
            pool.add(&url)
        } else {
            pool.remove(&url)
        };
        let changed = changed.map_err(|e| {
            let status = if add { 400 } else { 409 };
            Fault::new(Blame::Client, status, e.message)
        })?;
        if changed {
            let url = url.trim_end_matches('/');
            let verb = if add { "added to" } else { "removed from" };
            log::warn!(target: "routed_experts::proxy",
                    "{} server {url} {verb} the list (admin endpoint)", side.name());
            proxy.metrics.list_changed(side, url, add);
        }
        Ok(changed)
    }) {
        Ok(changed) => {
            let doc = serde_json::json!({"changed": changed});
            json_response(200, Bytes::from(doc.to_string()))
        }
        Err(fault) => fault_response(&fault),
    }
}

async fn read_change(req: Request<Incoming>) -> Result<(Side, String), Fault> {
    let bad = |why: String| Fault::new(Blame::Client, 400, why);
    let body = Limited::new(req.into_body(), MAX_CHANGE_BYTES).collect();
    let body = match tokio::time::timeout(CHANGE_BODY_TIMEOUT, body).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => return Err(bad(format!("the body could not be read: {e}"))),
        Err(_) => {
            return Err(Fault::new(
                Blame::Client,
                408,
                "the body did not arrive in time",
            ))
        }
    };
    let expected = r#"expected {"side": "prefill" or "decode", "url": "http://HOST:PORT"}"#;
    let doc: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("{expected}: {e}")))?;
    let fields = doc.as_object().filter(|o| o.len() == 2);
    let text = |name: &str| fields.and_then(|o| o.get(name)).and_then(|v| v.as_str());
    let (Some(side), Some(url)) = (text("side"), text("url")) else {
        return Err(bad(format!(
            "{expected}, got {}",
            shorten(&doc.to_string())
        )));
    };
    let side = Side::parse(side).ok_or_else(|| {
        bad(format!(
            r#"side: expected "prefill" or "decode", got {:?}"#,
            shorten(side)
        ))
    })?;
    Ok((side, url.to_string()))
}

/// Make both lists the upstreams file's (what SIGHUP does): all or nothing, so a file
/// half-written or with one bad line changes nothing. `Ok(None)` without a file.
pub(crate) fn reload_upstreams_file(proxy: &Proxy) -> Result<Option<[Changed; 2]>, ConfigError> {
    let Some(path) = &proxy.config.upstreams_file else {
        return Ok(None);
    };
    let at = |e: String| {
        ConfigError::new(
            "upstreams_file",
            format!("upstreams_file {}: {e}", path.display()),
        )
    };
    let (prefill, decode) = proxy.config.upstream_lists()?;
    for (side, urls) in [(Side::Prefill, &prefill), (Side::Decode, &decode)] {
        if urls.is_empty() {
            return Err(at(format!(
                "no {} server (the lists are unchanged)",
                side.name()
            )));
        }
    }
    let mut changes = [Changed::default(), Changed::default()];
    for (i, (side, urls)) in [(Side::Prefill, prefill), (Side::Decode, decode)]
        .into_iter()
        .enumerate()
    {
        // Cannot fail: every URL parsed and the list is not empty.
        let changed = proxy.pool(side).replace(&urls).map_err(|e| at(e.message))?;
        for (urls, added) in [(&changed.added, true), (&changed.removed, false)] {
            for url in urls {
                proxy.metrics.list_changed(side, url, added);
            }
        }
        changes[i] = changed;
    }
    Ok(Some(changes))
}

/// At most 80 characters of `text`, for an error message.
fn shorten(text: &str) -> String {
    text.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn with_file(text: &str) -> (Proxy, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!(
            "rx-upstreams-{}-{:p}.txt",
            std::process::id(),
            &text
        ));
        std::fs::write(&path, text).unwrap();
        let config = Config {
            upstreams_file: Some(path.clone()),
            ..Config::default()
        };
        (Proxy::new(config).unwrap(), path)
    }

    #[test]
    fn a_reload_takes_the_files_lists_whole_or_changes_nothing() {
        let (p, path) = with_file("prefill http://127.0.0.1:1\ndecode http://127.0.0.1:2\n");
        std::fs::write(
            &path,
            "prefill http://127.0.0.1:1\nprefill http://127.0.0.1:3 # new\ndecode http://127.0.0.1:4\n",
        )
        .unwrap();
        let [prefill, decode] = reload_upstreams_file(&p).unwrap().unwrap();
        assert_eq!(prefill.added, ["http://127.0.0.1:3"]);
        assert!(prefill.removed.is_empty());
        assert_eq!(
            (decode.added, decode.removed),
            (
                vec!["http://127.0.0.1:4".to_string()],
                vec!["http://127.0.0.1:2".to_string()]
            )
        );
        // A file with a bad line, or a side without servers, changes nothing.
        for bad in [
            "prefill http://127.0.0.1:1\ndecode nonsense\n",
            "prefill http://127.0.0.1:1\n",
        ] {
            std::fs::write(&path, bad).unwrap();
            let e = reload_upstreams_file(&p).unwrap_err();
            assert_eq!(e.setting, "upstreams_file");
            assert!(
                e.message.contains("line 2") || e.message.contains("no decode"),
                "{e}"
            );
            assert_eq!(p.decode.urls(), ["http://127.0.0.1:4"]);
        }
        std::fs::remove_file(&path).unwrap();
        assert_eq!(shorten(&"x".repeat(200)).len(), 80);
    }
}
