//! The tests of `body`.

use super::*;

#[test]
fn routing_keys_are_recognised_in_any_spelling() {
    for key in [
        "routed_experts",
        "prompt_routed_experts",
        "completion_routed_experts",
        "routed_expert_weights",
        "routedExperts",
        "Routed-Experts",
        "x_ROUTED__EXPERT",
        "routed_experts_str",
    ] {
        assert!(is_routing_key(key.as_bytes()), "{key}");
    }
    for key in [
        "routed",
        "experts",
        "expert_routed",
        "router_logits",
        "route_experts",
        "",
    ] {
        assert!(!is_routing_key(key.as_bytes()), "{key}");
    }
}

#[test]
fn counts_come_from_the_place_that_counts_the_choice() {
    let one = br#"{"choices":[{"index":0,"routed_experts":"x"}],"usage":{"prompt_tokens":7,"completion_tokens":5}}"#;
    let c = read_body(one).unwrap().values[0].counts;
    assert_eq!(c.prompt, Some((7, "usage.prompt_tokens")));
    assert_eq!(c.generated, Some((5, "usage.completion_tokens")));
    // Two choices share usage: no generated count from it, but their own token ids count.
    let two = br#"{"choices":[{"index":0,"routed_experts":"x"},{"index":1,"routed_experts":"x","prompt_token_ids":[1,2],"token_ids":[3]}],"usage":{"prompt_tokens":2,"completion_tokens":4}}"#;
    let b = read_body(two).unwrap();
    assert_eq!(b.values[0].counts.generated, None);
    assert_eq!(b.values[0].counts.prompt, Some((2, "usage.prompt_tokens")));
    assert_eq!(b.values[1].counts.generated, Some((1, "token_ids")));
    // A stream event's token ids are a delta: not a count without the choice's prompt ids.
    let event = br#"{"choices":[{"index":0,"token_ids":[12],"routed_experts":"x"}],"usage":null}"#;
    assert_eq!(
        read_body(event).unwrap().values[0].counts,
        Counts::default()
    );
    let twice = br#"{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens":30}}"#;
    let err = read_body(twice).unwrap_err().to_string();
    assert!(err.contains("duplicate key `prompt_tokens`"), "{err}");
    let sglang = br#"{"text":"a","meta_info":{"prompt_tokens":3,"completion_tokens":2,"routed_experts":"x"}}"#;
    let c = read_body(sglang).unwrap().values[0].counts;
    assert_eq!(c.prompt, Some((3, "meta_info.prompt_tokens")));
    assert_eq!(c.generated, Some((2, "meta_info.completion_tokens")));
}

#[test]
fn unknown_routing_keys_are_errors_naming_their_path() {
    for (body, path) in [
        (
            r#"{"choices":[{"completion_routed_experts":[[[1]]]}]}"#,
            "$.choices[0].completion_routed_experts",
        ),
        (r#"{"routed_experts":"x"}"#, "$.routed_experts"),
        (r#"{"usage":{"routedExperts":1}}"#, "$.usage.routedExperts"),
        (
            r#"{"choices":[{"message":{"routed_expert_ids":[]}}]}"#,
            "$.choices[0].message.routed_expert_ids",
        ),
        (
            r#"{"meta_info":{"routed_experts_str":"x"}}"#,
            "$.meta_info.routed_experts_str",
        ),
    ] {
        let err = read_body(body.as_bytes()).unwrap_err().to_string();
        assert!(err.contains(path), "{body}: {err}");
    }
}

#[test]
fn a_dynamo_receipt_for_routes_is_refused_with_where_they_went() {
    let receipt = r#"{"format":"generation_artifact_v1","contents":["moe_routes"],"state":"ready","actual_bytes":4096,"sha256":"ab","object_id":"obj-7"}"#;
    for (body, path) in [
        (
            format!(
                r#"{{"choices":[{{"index":0,"message":{{"content":"x"}}}}],"nvext":{{"routed_experts":null,"generation_artifact":{receipt}}}}}"#
            ),
            "$.nvext.generation_artifact",
        ),
        (
            format!(
                r#"{{"request_id":"r","choices":[{{"index":0,"token_ids":[1]}}],"generation_artifact":{receipt}}}"#
            ),
            "$.generation_artifact",
        ),
    ] {
        let err = read_body(body.as_bytes()).unwrap_err().to_string();
        assert!(err.contains(path), "{err}");
        assert!(
            err.contains("object store") && err.contains("obj-7"),
            "{err}"
        );
    }
    // A receipt of other outputs, or null, is passed by; one without contents is refused.
    let other =
        r#"{"generation_artifact":{"format":"generation_artifact_v1","contents":["logprobs"]}}"#;
    assert!(read_body(other.as_bytes()).unwrap().is_empty());
    assert!(read_body(br#"{"generation_artifact":null}"#)
        .unwrap()
        .is_empty());
    let unknown = br#"{"generation_artifact":{"object_id":"x"}}"#;
    let err = read_body(unknown).unwrap_err().to_string();
    assert!(err.contains("without a list of contents"), "{err}");
}
