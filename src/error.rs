//! The one error type of the core: an [`ErrorKind`] a caller can match (which rule was broken,
//! with the values that matter) and the message that names them. The binding layer maps the
//! kinds to Python's exceptions in one place (`crates/python/src/errors.rs`): input that is
//! malformed ([`ErrorKind::is_malformed_input`]) is a `PayloadError`, halves or turns that do
//! not fit together a `MergeError`, both beneath `RoutedExpertsError(ValueError)`.

use std::fmt::Display;

/// What went wrong: [`kind`](Error::kind) to match on, and a message (its `Display`) naming the
/// field, the expected and the actual value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

/// Which rule an input broke. Those up to [`Malformed`](ErrorKind::Malformed) are malformed
/// input (the input alone is wrong); the rest are inputs that are each well formed but do not
/// fit together. [`Malformed`](ErrorKind::Malformed) and
/// [`Inconsistent`](ErrorKind::Inconsistent) hold what no caller is expected to branch on;
/// every failure a caller would tell apart has a kind of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A field or argument holds a value it cannot: `field` names it (a JSON key, a Python
    /// argument), `expected` and `actual` say what it should hold and what it held.
    Field {
        /// The field or argument.
        field: String,
        /// What it must hold.
        expected: String,
        /// What it held.
        actual: String,
    },
    /// A document is not JSON (or not the JSON expected) at byte `at`.
    Json {
        /// The byte offset the reader had reached.
        at: usize,
        /// What was expected there.
        expected: String,
    },
    /// A value's routing rows contradict the token counts its body states (format.md §3.3).
    Counts {
        /// The rows the value holds.
        rows: u64,
        /// The position its rows start at.
        start: u64,
    },
    /// A router's row of routing that replay cannot take (an id out of range or repeated, a
    /// corrupt negative id, ids all zero where routing was expected): `router` indexes the
    /// routers the call was given, `row` the batch's rows (format.md §6.2).
    Row {
        /// The router, as the caller listed them.
        router: usize,
        /// The row of the batch.
        row: usize,
    },
    /// An expert id a router cannot take at `position`, `layer`: out of the expert range,
    /// repeated within a top_k, or negative beside real ids (format.md §7).
    Id {
        /// The token position.
        position: u64,
        /// The layer.
        layer: usize,
    },
    /// Rows that should hold routing hold none: an all-zero row, a row marked missing (all
    /// -1) where every row must be routed, a value a producer sent as null after generating
    /// tokens (format.md §3.4, §7). The message names the first.
    RowsLost,
    /// A size past a limit: `bytes` declared or decoded against `limit` (the caller's
    /// `max_bytes`; raising it is the caller's to say: `set_max_bytes`, `--max-bytes`,
    /// `--max-merge-bytes`).
    TooLarge {
        /// The bytes the input declares or decodes to.
        bytes: u64,
        /// The limit it passed.
        limit: u64,
    },
    /// Routing this library cannot place, refused rather than guessed (format.md §3.2): a value
    /// in no known format, a format where no producer writes it, a routing key at a place that
    /// is not read, a body whose rows read two ways. A producer's format has likely changed.
    Unplaced,
    /// The body says its routing is not in it (NVIDIA Dynamo's generation artifact receipt,
    /// format.md §3.2): fetch it from where the receipt says.
    Offloaded,
    /// Rows that do not split as asked: `rows` is not a multiple of `multiple` (pad each
    /// sample, or the batch, before packing; format.md §6.1).
    Unpadded {
        /// The rows to split.
        rows: u64,
        /// What they must be a multiple of.
        multiple: u64,
    },
    /// The body read for routing is not a response: an engine's or a router's error reply
    /// (its message quoted), or JSON that has none of a response's keys (`{}`, a request, a
    /// routing value where a body belongs).
    NotResponse,
    /// Malformed input of another kind (weights where ids belong, a slice outside a payload,
    /// a shape that overflows, ...): the message says which.
    Malformed,
    /// Rows are missing between two halves or turns: the first stops at `stop`, the next starts
    /// at `start`, past it.
    Gap {
        /// Where the earlier part's rows stop.
        stop: u64,
        /// Where the later part's rows start.
        start: u64,
    },
    /// Two parts route different numbers of layers or experts per token.
    Shape {
        /// `(num_layers, top_k)` of the earlier part.
        first: (usize, usize),
        /// `(num_layers, top_k)` of the later part.
        second: (usize, usize),
    },
    /// One half of a prefill/decode pair carries routing and the other none; the half named is
    /// the one without (a proxy blames the right server without reading the message).
    MissingRouting(Half),
    /// Rows that overlap and disagree: at `position`, `layer` the rows held and the rows added
    /// route differently (format.md §5).
    Overlap {
        /// The token position.
        position: u64,
        /// The layer.
        layer: usize,
    },
    /// Parts that do not fit together in another way (a decode half that ends before prefill's,
    /// an empty trajectory, halves from different releases): the message says which.
    Inconsistent,
}

impl ErrorKind {
    /// Every kind's [`name`](ErrorKind::name), malformed input first, in declaration order.
    pub const NAMES: [&'static str; 17] = [
        "field",
        "json",
        "counts",
        "row",
        "id",
        "rows_lost",
        "too_large",
        "unplaced",
        "offloaded",
        "unpadded",
        "not_response",
        "malformed",
        "gap",
        "shape",
        "missing_routing",
        "overlap",
        "inconsistent",
    ];

    /// Its name, in snake case (`"gap"`, `"missing_routing"`, `"too_large"`, ...): Python's
    /// exceptions carry it as `kind`, and a metric may take it as a label.
    pub fn name(&self) -> &'static str {
        match self {
            ErrorKind::Field { .. } => "field",
            ErrorKind::Json { .. } => "json",
            ErrorKind::Counts { .. } => "counts",
            ErrorKind::Row { .. } => "row",
            ErrorKind::Id { .. } => "id",
            ErrorKind::RowsLost => "rows_lost",
            ErrorKind::TooLarge { .. } => "too_large",
            ErrorKind::Unplaced => "unplaced",
            ErrorKind::Offloaded => "offloaded",
            ErrorKind::Unpadded { .. } => "unpadded",
            ErrorKind::NotResponse => "not_response",
            ErrorKind::Malformed => "malformed",
            ErrorKind::Gap { .. } => "gap",
            ErrorKind::Shape { .. } => "shape",
            ErrorKind::MissingRouting(_) => "missing_routing",
            ErrorKind::Overlap { .. } => "overlap",
            ErrorKind::Inconsistent => "inconsistent",
        }
    }

    /// Whether the input itself is malformed (Python's `PayloadError`), rather than well-formed
    /// parts that do not fit together (`MergeError`).
    pub fn is_malformed_input(&self) -> bool {
        matches!(
            self,
            ErrorKind::Field { .. }
                | ErrorKind::Json { .. }
                | ErrorKind::Counts { .. }
                | ErrorKind::Row { .. }
                | ErrorKind::Id { .. }
                | ErrorKind::RowsLost
                | ErrorKind::TooLarge { .. }
                | ErrorKind::Unplaced
                | ErrorKind::Offloaded
                | ErrorKind::Unpadded { .. }
                | ErrorKind::NotResponse
                | ErrorKind::Malformed
        )
    }
}

/// A half of a prefill/decode pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// The prefill server's response.
    Prefill,
    /// The decode server's response.
    Decode,
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// Which rule was broken.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The message (what `Display` shows).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// "`field`: expected X, got Y", the shape of every field-level message
    /// ([`ErrorKind::Field`]).
    pub fn field(field: &str, expected: impl Display, actual: impl Display) -> Self {
        let (expected, actual) = (expected.to_string(), actual.to_string());
        let message = format!("`{field}`: expected {expected}, got {actual}");
        Error::new(
            ErrorKind::Field {
                field: field.to_string(),
                expected,
                actual,
            },
            message,
        )
    }

    /// Malformed input of a kind with no fields of its own ([`ErrorKind::Malformed`]).
    pub fn malformed(msg: impl Into<String>) -> Self {
        Error::new(ErrorKind::Malformed, msg)
    }

    /// Parts that do not fit together, of a kind with no fields of its own
    /// ([`ErrorKind::Inconsistent`]).
    pub fn inconsistent(msg: impl Into<String>) -> Self {
        Error::new(ErrorKind::Inconsistent, msg)
    }

    /// One half carries routing, `half` none ([`ErrorKind::MissingRouting`]).
    pub(crate) fn missing_routing(half: Half, msg: impl Into<String>) -> Self {
        Error::new(ErrorKind::MissingRouting(half), msg)
    }

    /// Prefix the message with where it happened (a format name, a choice index, ...); the kind
    /// stays.
    pub fn context(self, ctx: impl Display) -> Self {
        Error {
            message: format!("{ctx}: {}", self.message),
            kind: self.kind,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn a_kind_survives_context_and_the_message_is_the_display() {
        let e = Error::field("shape", "3 integers", "2").context("decode");
        assert_eq!(e.to_string(), "decode: `shape`: expected 3 integers, got 2");
        assert_eq!(e.message(), e.to_string());
        let ErrorKind::Field {
            field,
            expected,
            actual,
        } = e.kind()
        else {
            panic!("{e:?}")
        };
        assert_eq!(
            (&**field, &**expected, &**actual),
            ("shape", "3 integers", "2")
        );
        assert!(e.kind().is_malformed_input());
        for merge in [
            Error::inconsistent("x"),
            Error::missing_routing(Half::Decode, "x"),
            Error::new(ErrorKind::Gap { stop: 3, start: 5 }, "x"),
            Error::new(
                ErrorKind::Shape {
                    first: (2, 8),
                    second: (3, 8),
                },
                "x",
            ),
        ] {
            assert!(!merge.kind().is_malformed_input(), "{merge:?}");
        }
        assert!(Error::malformed("x").kind().is_malformed_input());
    }

    /// One of each kind; the match fails to compile until a new kind is listed here.
    fn one_of_each() -> Vec<ErrorKind> {
        let kinds = vec![
            ErrorKind::Field {
                field: "f".into(),
                expected: "e".into(),
                actual: "a".into(),
            },
            ErrorKind::Json {
                at: 1,
                expected: "e".into(),
            },
            ErrorKind::Counts { rows: 1, start: 0 },
            ErrorKind::Row { router: 0, row: 1 },
            ErrorKind::Id {
                position: 1,
                layer: 0,
            },
            ErrorKind::RowsLost,
            ErrorKind::TooLarge { bytes: 2, limit: 1 },
            ErrorKind::Unplaced,
            ErrorKind::Offloaded,
            ErrorKind::Unpadded {
                rows: 3,
                multiple: 2,
            },
            ErrorKind::NotResponse,
            ErrorKind::Malformed,
            ErrorKind::Gap { stop: 3, start: 5 },
            ErrorKind::Shape {
                first: (2, 8),
                second: (3, 8),
            },
            ErrorKind::MissingRouting(Half::Prefill),
            ErrorKind::Overlap {
                position: 1,
                layer: 0,
            },
            ErrorKind::Inconsistent,
        ];
        for k in &kinds {
            match k {
                ErrorKind::Field { .. }
                | ErrorKind::Json { .. }
                | ErrorKind::Counts { .. }
                | ErrorKind::Row { .. }
                | ErrorKind::Id { .. }
                | ErrorKind::RowsLost
                | ErrorKind::TooLarge { .. }
                | ErrorKind::Unplaced
                | ErrorKind::Offloaded
                | ErrorKind::Unpadded { .. }
                | ErrorKind::NotResponse
                | ErrorKind::Malformed
                | ErrorKind::Gap { .. }
                | ErrorKind::Shape { .. }
                | ErrorKind::MissingRouting(_)
                | ErrorKind::Overlap { .. }
                | ErrorKind::Inconsistent => {}
            }
        }
        kinds
    }

    #[test]
    fn every_kind_is_named_once_and_the_malformed_ones_come_first() {
        let names: Vec<&str> = one_of_each().iter().map(ErrorKind::name).collect();
        assert_eq!(names, ErrorKind::NAMES);
        let malformed = one_of_each()
            .iter()
            .take_while(|k| k.is_malformed_input())
            .count();
        assert_eq!(
            malformed, 12,
            "malformed input first, then parts that do not fit"
        );
        assert!(one_of_each()[malformed..]
            .iter()
            .all(|k| !k.is_malformed_input()));
    }

    /// Every kind a caller tells apart is what the public API raises where its rule breaks.
    #[test]
    fn each_typed_kind_is_raised_where_its_rule_breaks() {
        use crate::{
            agreement, from_response, pack, read_body, sidecar, validate, DTypeChoice, ExpertLoad,
            Hints, Overlap, Payload, Shape, Trajectory, DEFAULT_MAX_BYTES,
        };
        let kind = |r: Result<()>| r.unwrap_err().kind().clone();
        let payload = |values: &[i64], (t, l, k): (usize, usize, usize), start: u64| {
            Payload::from_values(values, Shape::new(t, l, k), start, DTypeChoice::Compact).unwrap()
        };
        // Ids a router cannot take: out of range, repeated, negative beside real ids.
        let p = payload(&[1, 9, 3, 3], (2, 1, 2), 10);
        let experts = validate::Checks {
            num_experts: Some(8),
            ..validate::Checks::default()
        };
        let id = |position, layer| ErrorKind::Id { position, layer };
        assert_eq!(kind(validate::validate(&p, &experts)), id(10, 0));
        let repeats = validate::Checks {
            duplicates: true,
            ..validate::Checks::default()
        };
        assert_eq!(kind(validate::validate(&p, &repeats)), id(11, 0));
        let mut load = ExpertLoad::new(1, 4, 1 << 20).unwrap();
        assert_eq!(
            kind(load.add(&payload(&[0, 1, 3, 4], (2, 1, 2), 0))),
            id(1, 0)
        );
        let negative = payload(&[1, 2, 1, -1], (2, 1, 2), 5);
        let fine = payload(&[1, 2, 1, 2], (2, 1, 2), 5);
        assert_eq!(kind(agreement(&negative, &fine).map(drop)), id(6, 0));
        let l = pack::layout(
            &[&negative],
            &pack::PackOptions::default(),
            DType::I32,
            1 << 20,
        )
        .unwrap();
        let packed = pack::pack_into(&[&negative], &l, &mut vec![0i32; l.rows * 2], None);
        assert_eq!(kind(packed.map(drop)), id(6, 0));
        // Rows that should hold routing and hold none.
        let lost = payload(&[1, 2, 0, 0], (2, 1, 2), 0);
        let zero_rows = validate::Checks {
            zero_rows: true,
            ..validate::Checks::default()
        };
        assert_eq!(
            kind(validate::validate(&lost, &zero_rows)),
            ErrorKind::RowsLost
        );
        let null_after_tokens = br#"{"prompt_routed_experts":[[[1,2]]],"usage":{"prompt_tokens":1,"completion_tokens":3},"choices":[{"index":0,"routed_experts":null}]}"#;
        let read = from_response(null_after_tokens, 0, &Hints::default(), DEFAULT_MAX_BYTES);
        assert_eq!(kind(read.map(drop)), ErrorKind::RowsLost);
        // A size past the caller's limit, with the sizes.
        let big = sidecar::encode(&payload(&[1; 64], (8, 4, 2), 0));
        let e = sidecar::decode(&big, 63).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::TooLarge {
                    bytes: 64,
                    limit: 63
                }
            ),
            "{e:?}"
        );
        assert!(
            !e.message().contains("set_max_bytes"),
            "the caller names its knob: {e}"
        );
        // Routing that cannot be placed, and routing that is elsewhere.
        let unknown = crate::formats::decode_text(b"\"~~~~\"", &Hints::default(), 1 << 20);
        assert_eq!(kind(unknown.map(drop)), ErrorKind::Unplaced);
        let two =
            br#"{"choices":[{"index":0,"routed_experts":"x"},{"index":0,"routed_experts":"y"}]}"#;
        assert_eq!(kind(read_body(two).map(drop)), ErrorKind::Unplaced);
        let receipt = br#"{"generation_artifact":{"format":"generation_artifact_v1","contents":["moe_routes"],"object_id":"o"}}"#;
        assert_eq!(kind(read_body(receipt).map(drop)), ErrorKind::Offloaded);
        // JSON: a key twice, nesting too deep.
        let twice = br#"{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens":30}}"#;
        assert!(
            matches!(kind(read_body(twice).map(drop)), ErrorKind::Json { .. }),
            "a duplicate key"
        );
        let deep = format!("{{\"usage\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(matches!(
            kind(read_body(deep.as_bytes()).map(drop)),
            ErrorKind::Json { .. }
        ));
        // Rows that do not split as asked.
        let cp = crate::shard::Rank {
            cp_size: 2,
            ..crate::shard::Rank::default()
        };
        let unpadded = crate::shard::plan(&[0, 6], 6, 2, &cp).map(drop);
        assert_eq!(
            kind(unpadded),
            ErrorKind::Unpadded {
                rows: 6,
                multiple: 4
            }
        );
        // Turns whose shared rows route differently.
        let mut t = Trajectory::new();
        t.append(
            &payload(&[1, 2, 3, 4], (2, 1, 2), 0),
            Overlap::Check,
            1 << 20,
        )
        .unwrap();
        let other = t.append(&payload(&[3, 5], (1, 1, 2), 1), Overlap::Check, 1 << 20);
        assert_eq!(
            kind(other),
            ErrorKind::Overlap {
                position: 1,
                layer: 0
            }
        );
        assert!(!ErrorKind::Overlap {
            position: 1,
            layer: 0
        }
        .is_malformed_input());
    }
}
