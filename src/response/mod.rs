//! Routing inside whole response bodies: find it without building the rest of the body, and
//! merge prefill and decode bodies by replacing only the routing values' bytes (format.md §4).
//! Three jobs, a file each: reading (`read`), sampling rows for a broken engine's marks
//! (`suspects`), and merging (`merge`, into the pieces of `spliced`; vLLM's `.npy` kept as
//! `.npy` by copying its text, `npy_text`; decode's start derived from the body's counts when
//! none is given, `decode_start`); and merging one event of a stream as it passes
//! (`streaming`, with prefill's rows held decoded in `prefill_rows`). Beside them: a group read
//! once (`group`), or as its body arrives (`body_reader`), the shared-prompt answer
//! (`shared_prompt`), and what a whole file handed to a tool is (`sniff`).

mod body_reader;
mod decode_start;
mod group;
mod merge;
mod npy_text;
mod options;
mod prefill_rows;
mod read;
mod shared_prompt;
mod sniff;
mod spliced;
mod streaming;
#[cfg(test)]
mod streaming_tests;
mod suspects;

pub use body_reader::{BodyReader, DECODE_FROM};
pub use group::{group_from_response, Group, GroupChoice};
pub use merge::{merge_response, merge_response_found, merge_response_pieces};
pub use options::MergeOptions;
pub use prefill_rows::PrefillRows;
pub use read::{decode_found, from_response, routing_rows};
pub use sniff::{sniff, Sniffed};
pub use spliced::{Part, Recoded, Spliced};
pub use streaming::{DataFirst, EventMerge, Step, StreamOptions};
pub use suspects::{merge_suspects, suspect_rows};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::{find_routing, read_prefill};
    use crate::error::Half;
    use crate::formats::{self, Format, Hints};
    use crate::limits::DEFAULT_MAX_BYTES;
    use crate::payload::dtype::DType;
    use crate::payload::{Payload, Shape};
    use crate::quality::validate::Suspect;

    const OPTS: MergeOptions = MergeOptions {
        max_bytes: DEFAULT_MAX_BYTES,
        splice: true,
        hints: Hints {
            start: None,
            num_layers: None,
            top_k: None,
            dtype: None,
        },
        decode_start: None,
        keep_format: false,
        require_routing: false,
        defer_recode: false,
        shared_prompt: false,
    };

    fn body(routing: &str) -> String {
        format!(
            r#"{{"id":"x","choices":[{{"index":0,"logprob":-0.12345678901234568, "routed_experts":{routing}}}],"usage":{{}}}}"#
        )
    }

    #[test]
    fn merges_the_spec_example_and_keeps_other_bytes() {
        let prefill = body(r#"{"data":"CgsUFR4f","shape":[3,1,2],"start":0,"dtype":"uint8"}"#);
        let decode = body(r#"{"data":"AAAAAAAAKCk=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#);
        let merged = r#"{"data":"CgsUFR4fKCk=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#;
        for splice in [true, false] {
            let out = merge_response(
                prefill.as_bytes(),
                decode.as_bytes(),
                MergeOptions { splice, ..OPTS },
            )
            .unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), body(merged));
        }
        // Unassembled, and with the prefill routing found first: the same bytes.
        let (p, d) = (prefill.as_bytes(), decode.as_bytes());
        let found = crate::body::read_body(p).unwrap();
        let pieces = merge_response_found(p, &found, d, OPTS).unwrap();
        assert_eq!(pieces.merged_values(), 1);
        assert_eq!(
            pieces.checked_slices().unwrap().concat(),
            body(merged).as_bytes()
        );
        let none = merge_response_pieces(p, br#"{"choices":[]}"#, OPTS).unwrap();
        assert_eq!(none.merged_values(), 0);
        // Bad base64 in the spliced text is refused by the unassembled path too.
        let bad = body(r#"{"data":"AAAAAAAAK!k=","shape":[4,1,2],"start":0,"dtype":"uint8"}"#);
        let pieces = merge_response_pieces(p, bad.as_bytes(), OPTS);
        let refused = pieces.and_then(|s| s.checked_slices().map(|v| v.concat()));
        assert!(refused.is_err(), "{refused:?}");
    }

    #[test]
    fn no_routing_returns_decode_unchanged_and_missing_prefill_is_an_error() {
        let plain = r#"{"choices":[{"index":0,"text":"w"}]}"#;
        assert_eq!(
            merge_response(plain.as_bytes(), plain.as_bytes(), OPTS).unwrap(),
            plain.as_bytes()
        );
        let decode = body(r#"{"data":"Hh8oKQ==","shape":[2,1,2],"start":2}"#);
        let err = merge_response(plain.as_bytes(), decode.as_bytes(), OPTS).unwrap_err();
        assert!(
            matches!(
                err.kind(),
                crate::error::ErrorKind::MissingRouting(Half::Prefill)
            ),
            "{err}"
        );
    }

    #[test]
    fn read_prefill_finds_kv_params_and_rows_in_one_walk() {
        let b = br#"{"kv_transfer_params":{"remote_block_ids":[3,5],"remote_host":"h"},"choices":[{"index":0,"routed_experts":{"data":"CgsUFR4f","shape":[3,1,2],"start":0}}]}"#;
        let p = read_prefill(b).unwrap();
        assert_eq!(
            p.kv_transfer_params.unwrap(),
            br#"{"remote_block_ids":[3,5],"remote_host":"h"}"#
        );
        let rows =
            routing_rows(&p.routing.values[0], &Hints::default(), DEFAULT_MAX_BYTES).unwrap();
        assert_eq!(rows, 3);
        let none = read_prefill(br#"{"kv_transfer_params":null,"choices":[]}"#).unwrap();
        assert!(none.kv_transfer_params.is_none() && none.routing.is_empty());
        let twice = br#"{"kv_transfer_params":{},"choices":[],"kv_transfer_params":{"a":1}}"#;
        let err = read_prefill(twice).unwrap_err();
        assert!(err.to_string().contains("duplicate"), "{err}");
        // Other readers keep their rules: the key is not theirs to police.
        assert!(find_routing(twice).unwrap().is_empty());
        // A shape that does not match its data is refused without decoding.
        let bad = br#"{"choices":[{"routed_experts":{"data":"CgsU","shape":[3,1,2]}}]}"#;
        let p = read_prefill(bad).unwrap();
        assert!(routing_rows(&p.routing.values[0], &Hints::default(), DEFAULT_MAX_BYTES).is_err());
    }

    #[test]
    fn suspect_rows_sampled_from_text_match_the_decoded_payload() {
        use crate::payload::DTypeChoice;
        // 40 rows of 3 layers x top_k 2: every 7th zero throughout, every 5th a duplicate.
        let values: Vec<i64> = (0..40 * 6)
            .map(|i| {
                let (t, j) = (i / 6, i % 6);
                match () {
                    _ if t % 7 == 3 => 0,
                    _ if t % 5 == 1 && j % 2 == 1 => ((i - 1) % 50 + 1) as i64,
                    _ => (i % 50 + 1) as i64,
                }
            })
            .collect();
        let p = Payload::from_values(
            &values,
            Shape::new(40, 3, 2),
            4,
            DTypeChoice::Exact(DType::U16),
        )
        .unwrap();
        let hints = Hints {
            start: Some(4),
            ..Hints::default()
        };
        for format in [Format::Compact, Format::VllmNpy, Format::Lists] {
            let value = formats::encode_json(&p, format).unwrap();
            let text = format!(
                r#"{{"choices":[{{"index":0,"routed_experts":{}}}]}}"#,
                String::from_utf8(value).unwrap()
            );
            let found = find_routing(text.as_bytes()).unwrap();
            for (from, sample) in [(0, 64), (10, 7), (30, 1000), (99, 5)] {
                let mut want = Suspect::default();
                want.add_payload(&p, from, sample);
                if from == 0 {
                    assert!(want.zero_rows > 0 && want.duplicate_rows > 0, "{want:?}");
                }
                let got = suspect_rows(&found[0], &hints, DEFAULT_MAX_BYTES, from, sample).unwrap();
                assert_eq!(got, (want, 44), "{format:?} from {from}, sample {sample}");
            }
        }
    }

    #[test]
    fn from_response_finds_by_index() {
        let b = r#"{"choices":[{"index":1,"routed_experts":{"data":"Hh8oKQ==","shape":[2,1,2],"start":2}},{"index":0}]}"#;
        assert_eq!(
            from_response(b.as_bytes(), 1, &Hints::default(), DEFAULT_MAX_BYTES)
                .unwrap()
                .unwrap()
                .start(),
            2
        );
        // None only for a response with no routing in any choice; a mistake is an error.
        let read =
            |b: &str, c| from_response(b.as_bytes(), c, &Hints::default(), DEFAULT_MAX_BYTES);
        let kind = |r: crate::Result<Option<Payload>>| match r {
            Ok(p) => format!("ok {p:?}"),
            Err(e) => e.kind().name().to_string(),
        };
        assert_eq!(kind(read(b, 0)), "rows_lost");
        let e = read(b, 5).unwrap_err().to_string();
        assert!(
            e.contains("`choice`: expected one of the body's choices (0, 1), got 5"),
            "{e}"
        );
        let none = r#"{"choices":[{"index":0,"text":"a"},{"index":1,"text":"b"}]}"#;
        assert!(read(none, 1).unwrap().is_none());
        assert_eq!(kind(read(none, 2)), "field");
        assert_eq!(kind(read("{}", 0)), "not_response");
        assert_eq!(
            kind(read(r#"{"error":{"message":"no"}}"#, 0)),
            "not_response"
        );
        let sglang = r#"{"text":"a","meta_info":{"id":"x"}}"#;
        assert!(read(sglang, 0).unwrap().is_none());
        assert_eq!(kind(read(sglang, 1)), "field");
    }
}
