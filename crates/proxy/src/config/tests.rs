//! The tests of `config`.

use super::*;

fn config() -> Config {
    Config {
        prefill: vec!["http://127.0.0.1:1".into()],
        decode: vec!["http://127.0.0.1:2/prefix".into()],
        ..Config::default()
    }
}

#[test]
fn defaults_serve_and_zero_limits_are_named() {
    assert_eq!(config().check(), Ok(()));
    let c = Config {
        max_in_flight: 0,
        ..config()
    };
    assert_eq!(
        c.check().unwrap_err().message,
        "max_in_flight must be at least 1, got 0"
    );
    let c = Config {
        write_timeout: Duration::ZERO,
        ..config()
    };
    assert!(c.check().unwrap_err().message.starts_with("write_timeout"));
    let c = Config {
        max_header_bytes: 100,
        ..config()
    };
    assert!(c.check().unwrap_err().message.contains("at least 8192"));
}

#[test]
fn every_setting_is_set_by_name_within_its_bound() {
    let mut c = config();
    for s in SETTINGS {
        let ok = match s.unit {
            Unit::Seconds => Value::Seconds(2.5),
            _ => Value::Whole(s.minimum + 1),
        };
        assert_eq!(c.set(s.name, ok), Ok(()), "{}", s.name);
        let bad = match s.unit {
            Unit::Seconds => Value::Seconds(0.0),
            _ => Value::Whole(s.minimum - 1),
        };
        assert!(
            c.set(s.name, bad).unwrap_err().message.starts_with(s.name),
            "{}",
            s.name
        );
        let wrong = match s.unit {
            Unit::Seconds => Value::Whole(3),
            _ => Value::Seconds(3.0),
        };
        assert!(
            c.set(s.name, wrong)
                .unwrap_err()
                .message
                .contains("expected"),
            "{}",
            s.name
        );
    }
    assert_eq!(c.check(), Ok(()));
    assert_eq!(c.read_timeout, Duration::from_millis(2500));
    assert_eq!(c.max_header_bytes, MIN_HEADER_BYTES + 1);
    assert!(c
        .set("max_bogus", Value::Whole(1))
        .unwrap_err()
        .message
        .contains("unknown"));
    // The defaults are the declared ones.
    let d = Config::default();
    assert_eq!(
        d.max_in_flight as u64,
        setting("max_in_flight").unwrap().default
    );
    assert_eq!(
        d.header_timeout.as_secs(),
        setting("header_timeout").unwrap().default
    );
}

#[test]
fn text_settings_are_checked_and_the_upstreams_file_is_read_by_line() {
    let mut c = config();
    for (name, default, _) in TEXT_SETTINGS {
        if let Some(d) = default {
            assert_eq!(c.set_text(name, d), Ok(()));
        }
    }
    assert_eq!(c.routing_format, RoutingFormat::Engine);
    assert_eq!(c.set_text("routing_format", "compact"), Ok(()));
    assert_eq!(c.routing_format, RoutingFormat::Compact);
    assert_eq!(c.prompt_routing, PromptRouting::PerChoice);
    assert_eq!(c.set_text("prompt_routing", "shared"), Ok(()));
    assert_eq!(c.prompt_routing, PromptRouting::Shared);
    assert_eq!(
        c.set_text("prompt_routing", "once").unwrap_err().message,
        "prompt_routing: expected per_choice or shared, got \"once\""
    );
    assert_eq!(
        c.set_text("routing_format", "npy").unwrap_err().message,
        "routing_format: expected compact or engine, got \"npy\""
    );
    assert_eq!(c.stream_routing, StreamRouting::Buffered);
    assert_eq!(c.set_text("stream_routing", "relay"), Ok(()));
    assert_eq!(c.stream_routing, StreamRouting::Relay);
    assert_eq!(
        c.set_text("stream_routing", "live").unwrap_err().message,
        "stream_routing: expected buffered or relay, got \"live\""
    );
    assert_eq!(c.set_text("decode_policy", "round_robin"), Ok(()));
    assert_eq!(c.decode_policy, Policy::RoundRobin);
    assert!(c
        .set_text("prefill_policy", "cache_aware")
        .unwrap_err()
        .message
        .starts_with("prefill_policy: expected one of"));
    assert!(c
        .set_text("session_header", "x y")
        .unwrap_err()
        .message
        .starts_with("session_header"));
    assert!(c
        .set_text("bogus", "1")
        .unwrap_err()
        .message
        .contains("unknown"));
    let text = "# servers\nprefill http://a:1\n\ndecode  http://b:2/v  # the big one\nprefill http://c:3\n";
    assert_eq!(
        read_upstreams(text),
        Ok((
            vec!["http://a:1".into(), "http://c:3".into()],
            vec!["http://b:2/v".into()]
        ))
    );
    assert_eq!(
        read_upstreams("prefill\n").unwrap_err().message,
        "line 1: expected `prefill URL` or `decode URL`, got \"prefill\""
    );
    assert!(read_upstreams("decode http://a:1 x\n")
        .unwrap_err()
        .message
        .starts_with("line 1"));
    assert!(read_upstreams("\ndecode a:1\n")
        .unwrap_err()
        .message
        .starts_with("line 2: expected a URL"));
    // Either the file or the lists.
    c.upstreams_file = Some("/nonexistent/upstreams".into());
    assert!(c.check().unwrap_err().message.contains("not both"));
    c.prefill.clear();
    c.decode.clear();
    assert!(c
        .check()
        .unwrap_err()
        .message
        .starts_with("upstreams_file /nonexistent/upstreams: "));
}

#[test]
fn upstream_urls_are_checked() {
    let c = Config {
        decode: vec!["localhost:8000".into()],
        ..config()
    };
    assert!(c.check().unwrap_err().message.starts_with("decode: "));
    let c = Config {
        prefill: vec![],
        ..config()
    };
    assert_eq!(
        c.check().unwrap_err().message,
        "give at least one prefill server"
    );
}
