//! The tests of `request`.

use super::*;

fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap()
}

#[test]
fn prefill_and_decode_requests_keep_every_other_field_as_sent() {
    let client = br#"{"model":"m","prompt":[1,2],"max_tokens":9,"min_tokens":3,"stream":true,
                 "stream_options":{"include_usage":true},"big":123456789012345678901234567890,
                 "routed_experts_prompt_start":2}"#;
    let body = ClientBody::parse(client, Api::Completions).unwrap();
    assert!(body.stream && body.start == Some(2));
    let p = body.prefill_request();
    let text = std::str::from_utf8(&p).unwrap();
    assert!(text.starts_with(r#"{"model":"m","prompt":[1,2],"max_tokens":1,"stream":false"#));
    assert!(text.contains("123456789012345678901234567890")); // not rounded to a float
    let v = json(&p);
    assert!(v.get("min_tokens").is_none() && v.get("stream_options").is_none());
    assert!(v.get("max_completion_tokens").is_none());
    assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
    let chat = ClientBody::parse(client, Api::Chat).unwrap();
    assert_eq!(json(&chat.prefill_request())["max_completion_tokens"], 1);
    // A group's prompt is computed once: prefill asked for one choice, decode for all.
    let group = br#"{"prompt":"x","n":16,"max_tokens":8}"#;
    let group = ClientBody::parse(group, Api::Completions).unwrap();
    assert_eq!(json(&group.prefill_request())["n"], 1);
    assert_eq!(json(&group.decode_request(None, None))["n"], 16);
    assert!(json(&body.prefill_request()).get("n").is_none());
    // The answer's shape is the proxy's to write: neither engine is asked about it.
    let shared = br#"{"prompt":"x","n":2,"routed_experts_prompt_routing":"shared"}"#;
    let shared = ClientBody::parse(shared, Api::Completions).unwrap();
    assert_eq!(shared.prompt_routing, Some(PromptRouting::Shared));
    for sent in [
        shared.prefill_request(),
        shared.decode_request(None, Some(3)),
    ] {
        assert!(json(&sent).get(PROMPT_ROUTING).is_none());
    }
    assert_eq!(body.prompt_routing, None);

    assert!(body.include_usage && body.api() == Api::Completions);
    let plain = json(&body.plain_decode_request(None, Some(2)));
    assert_eq!(plain["stream"], false);
    assert!(plain.get("stream_options").is_none());
    assert_eq!(plain["routed_experts_prompt_start"], 2);
    for (options, usage) in [
        (r#""stream":true"#, false),
        (
            r#""stream":true,"stream_options":{"include_usage":false}"#,
            false,
        ),
        (r#""stream":true,"stream_options":[1]"#, false),
        (
            r#""stream":false,"stream_options":{"include_usage":true}"#,
            false,
        ),
    ] {
        let b = ClientBody::parse(format!("{{{options}}}").as_bytes(), Api::Chat).unwrap();
        assert_eq!(b.include_usage, usage, "{options}");
    }

    let d = body.decode_request(Some(br#"{"remote_host":"h"}"#), None);
    let v = json(&d);
    assert_eq!(v["kv_transfer_params"]["remote_host"], "h");
    assert_eq!(
        (v["max_tokens"].clone(), v["min_tokens"].clone()),
        (9.into(), 3.into())
    );
    let empty = ClientBody::parse(b"{}", Api::Completions).unwrap();
    assert_eq!(
        empty.decode_request(Some(b"{}"), None),
        br#"{"kv_transfer_params":{}}"#
    );
    assert_eq!(
        empty.decode_request(None, None),
        br#"{"kv_transfer_params":null}"#
    );
    // A client's own transfer parameters reach neither side.
    let forged = br#"{"prompt":"x","kv_transfer_params":{"remote_host":"10.66.66.66"},
            "ec_transfer_params":{"remote_host":"10.66.66.66"}}"#;
    let forged = ClientBody::parse(forged, Api::Completions).unwrap();
    for sent in [forged.decode_request(None, None), forged.prefill_request()] {
        let text = std::str::from_utf8(&sent).unwrap();
        assert!(!text.contains("10.66.66.66"), "{text}");
        assert!(json(&sent).get("ec_transfer_params").is_none());
    }
    assert_eq!(
        json(&forged.decode_request(None, None))["kv_transfer_params"],
        serde_json::Value::Null
    );
}

#[test]
fn client_mistakes_name_the_field() {
    for (body, param) in [
        (
            &br#"{"routed_experts_prompt_start":-1}"#[..],
            Some("routed_experts_prompt_start"),
        ),
        (
            br#"{"routed_experts_prompt_start":"3"}"#,
            Some("routed_experts_prompt_start"),
        ),
        (
            br#"{"routed_experts_prompt_start":2.5}"#,
            Some("routed_experts_prompt_start"),
        ),
        (
            br#"{"routed_experts_prompt_start":true}"#,
            Some("routed_experts_prompt_start"),
        ),
        (br#"{"stream":1}"#, Some("stream")),
        (
            br#"{"routed_experts_prompt_routing":"once"}"#,
            Some(PROMPT_ROUTING),
        ),
        (
            br#"{"routed_experts_prompt_routing":true}"#,
            Some(PROMPT_ROUTING),
        ),
        (b"[1]", None),
        (b"{not json", None),
        (br#"{"t":NaN}"#, None),
        (b"{\"a\":\"\xff\"}", None),
    ] {
        let e = ClientBody::parse(body, Api::Completions).unwrap_err();
        assert_eq!(
            (e.status, e.side, e.param),
            (400, Blame::Client, param),
            "{e:?}"
        );
    }
    let deep = format!("{{\"x\":{}{}}}", "[".repeat(300), "]".repeat(300));
    let e = ClientBody::parse(deep.as_bytes(), Api::Chat).unwrap_err();
    assert!(
        e.message.contains("cannot be written back as JSON"),
        "{}",
        e.message
    );
    let ok = format!("{{\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
    assert!(ClientBody::parse(ok.as_bytes(), Api::Generate).is_ok());
    assert_eq!(nesting(br#"{"s":"[[[{\"]"}"#), 1);
}

#[test]
fn decode_is_asked_for_rows_from_the_prompts_last_position() {
    assert_eq!(decode_start(70, None), 69);
    assert_eq!(decode_start(70, Some(3)), 69);
    assert_eq!(decode_start(70, Some(69)), 69);
    assert_eq!(decode_start(1, None), 0);
    let c = br#"{"prompt":"x","routed_experts_prompt_start":3,"n":2}"#;
    let d = json(
        &ClientBody::parse(c, Api::Completions)
            .unwrap()
            .decode_request(None, Some(69)),
    );
    assert_eq!(
        (d["routed_experts_prompt_start"].clone(), d["n"].clone()),
        (69.into(), 2.into())
    );
    let d = json(
        &ClientBody::parse(br#"{"messages":[]}"#, Api::Chat)
            .unwrap()
            .decode_request(None, Some(9)),
    );
    assert_eq!(d["routed_experts_prompt_start"], 9);
    let g = br#"{"token_ids":[1],"sampling_params":{"max_tokens":4}}"#;
    let d = json(
        &ClientBody::parse(g, Api::Generate)
            .unwrap()
            .decode_request(None, Some(69)),
    );
    assert_eq!(d["sampling_params"]["routed_experts_prompt_start"], 69);
    assert_eq!(d["sampling_params"]["max_tokens"], 4);
    assert!(d.get("routed_experts_prompt_start").is_none());
    let g = ClientBody::parse(br#"{"token_ids":[1]}"#, Api::Generate).unwrap();
    let d = json(&g.decode_request(None, Some(5)));
    assert_eq!(d["sampling_params"]["routed_experts_prompt_start"], 5);
    // Without a start the client's fields go as they came.
    let d = json(
        &ClientBody::parse(c, Api::Completions)
            .unwrap()
            .decode_request(None, None),
    );
    assert_eq!(d["routed_experts_prompt_start"], 3);
}

#[test]
fn generate_requests_carry_their_limits_and_start_in_sampling_params() {
    let text = br#"{"token_ids":[1,2,3],"sampling_params":{"temperature":0.5,"max_tokens":9,
            "min_tokens":2,"routed_experts_prompt_start":1},"stream":true,
            "stream_options":{"include_usage":true}}"#;
    let body = ClientBody::parse(text, Api::Generate).unwrap();
    assert!(body.stream && body.start == Some(1));
    let p = json(&body.prefill_request());
    assert_eq!(p["sampling_params"]["max_tokens"], 1);
    assert_eq!(p["sampling_params"]["temperature"], 0.5);
    assert_eq!(p["sampling_params"]["routed_experts_prompt_start"], 1);
    assert!(p["sampling_params"].get("min_tokens").is_none());
    assert!(p["sampling_params"].get("n").is_none());
    let group = br#"{"token_ids":[1,2],"sampling_params":{"n":4,"max_tokens":3}}"#;
    let group = ClientBody::parse(group, Api::Generate).unwrap();
    assert_eq!(json(&group.prefill_request())["sampling_params"]["n"], 1);
    assert_eq!(
        json(&group.decode_request(None, None))["sampling_params"]["n"],
        4
    );
    assert!(p.get("max_tokens").is_none() && p.get("stream_options").is_none());
    assert_eq!(
        (p["stream"].clone(), p["token_ids"].clone()),
        (false.into(), serde_json::json!([1, 2, 3]))
    );
    let d = json(&body.decode_request(Some(b"{}"), None));
    assert_eq!(d["sampling_params"]["max_tokens"], 9);
    // A top-level start is not the generate endpoint's; a bad sampling_params is named.
    let top = ClientBody::parse(br#"{"routed_experts_prompt_start":4}"#, Api::Generate);
    assert_eq!(top.unwrap().start, None);
    for bad in [
        &br#"{"sampling_params":[1]}"#[..],
        br#"{"sampling_params":{"routed_experts_prompt_start":-2}}"#,
    ] {
        let e = ClientBody::parse(bad, Api::Generate).unwrap_err();
        assert_eq!((e.status, e.side), (400, Blame::Client), "{e:?}");
        assert!(e.param.is_some(), "{e:?}");
    }
    // Without sampling_params, prefill gets one holding its limit.
    let bare = ClientBody::parse(br#"{"token_ids":[1]}"#, Api::Generate).unwrap();
    assert_eq!(
        json(&bare.prefill_request())["sampling_params"]["max_tokens"],
        1
    );
}

#[test]
fn request_ids() {
    assert!(acceptable_request_id(b"abc-1"));
    assert!(acceptable_request_id(&[b'a'; 128]));
    assert!(!acceptable_request_id(&[b'a'; 129]));
    assert!(!acceptable_request_id(b""));
    assert!(!acceptable_request_id(b"x y"));
    assert!(!acceptable_request_id("é".as_bytes()));
}

#[test]
fn decode_is_marked_for_the_vllm_plugin_beside_prefills_params() {
    let marked = |kv: Option<&[u8]>| {
        let text = marked_kv_transfer_params(kv).unwrap();
        serde_json::from_slice::<serde_json::Value>(&text).unwrap()
    };
    let alone = serde_json::json!({"routed_experts_plugin": true});
    assert_eq!(marked(None), alone);
    assert_eq!(marked(Some(b" null ")), alone);
    assert_eq!(
        marked(Some(
            br#"{"remote_host": "h", "routed_experts_plugin": false}"#
        )),
        serde_json::json!({"remote_host": "h", "routed_experts_plugin": true})
    );
    for bad in [&b"[1]"[..], b"\"x\"", b"{", b"7"] {
        let fault = marked_kv_transfer_params(Some(bad)).unwrap_err();
        assert_eq!((fault.status, fault.side), (502, Blame::Prefill));
        assert!(
            fault.message.contains("--vllm-plugin mark"),
            "{}",
            fault.message
        );
    }
}
