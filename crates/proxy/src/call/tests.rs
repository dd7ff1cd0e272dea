//! The tests of `call`.

use super::*;

#[test]
fn mime_types_are_matched_without_parameters_or_case() {
    let json = HeaderValue::from_static("Application/JSON; charset=utf-8");
    assert!(is_mime(Some(&json), "application/json"));
    assert!(!is_mime(Some(&json), "text/event-stream"));
    assert!(!is_mime(None, "application/json"));
}

#[test]
fn upstreams_are_asked_for_identity_json_with_the_request_id_and_auth() {
    let h = upstream_headers("req-1", Some(HeaderValue::from_static("Bearer k")));
    let get = |k: &str| h.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
    assert_eq!(get("accept-encoding").unwrap(), "identity");
    assert_eq!(get("content-type").unwrap(), "application/json");
    assert_eq!(get("x-request-id").unwrap(), "req-1");
    assert_eq!(get("authorization").unwrap(), "Bearer k");
    // An id that is no header value is left out, not sent broken.
    let h = upstream_headers("bad\nid", None);
    assert!(h
        .iter()
        .all(|(n, _)| *n != "x-request-id" && *n != "authorization"));
}

#[test]
fn the_prompt_is_the_count_prefill_states_else_where_its_rows_end() {
    let routing = r#"{"data":"AQIDBAUG","shape":[3,1,2],"start":0,"dtype":"uint8"}"#;
    let counted = format!(
        r#"{{"choices":[{{"index":0,"routed_experts":{routing}}}],"usage":{{"prompt_tokens":3,"completion_tokens":1}}}}"#
    );
    let max = routed_experts::DEFAULT_MAX_BYTES;
    assert_eq!(
        prefill_prompt(counted.as_bytes(), None, None, max)
            .unwrap()
            .1,
        Some(3)
    );
    let uncounted = format!(r#"{{"choices":[{{"index":0,"routed_experts":{routing}}}]}}"#);
    assert_eq!(
        prefill_prompt(uncounted.as_bytes(), None, None, max)
            .unwrap()
            .1,
        Some(3)
    );
    let none = br#"{"choices":[{"index":0,"text":"x"}]}"#;
    assert_eq!(prefill_prompt(none, None, None, max).unwrap().1, None);
    // No routing (a server started without it), but its count: decode still starts there.
    let counted_only =
            br#"{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":7,"completion_tokens":1}}"#;
    assert_eq!(
        prefill_prompt(counted_only, None, None, max).unwrap().1,
        Some(7)
    );
    let ids_only = br#"{"choices":[{"index":0,"text":"x","prompt_token_ids":[1,2]}]}"#;
    assert_eq!(
        prefill_prompt(ids_only, None, None, max).unwrap().1,
        Some(2)
    );
    assert!(prefill_prompt(b"{", None, None, max).is_err());
}
