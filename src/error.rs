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

/// Which rule an input broke. The first four are malformed input (the input alone is wrong);
/// the rest are inputs that are each well formed but do not fit together.
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
    /// Malformed input of another kind (a format that cannot be placed, a size past a limit,
    /// weights where ids belong, ...): the message says which.
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
    /// Parts that do not fit together in another way (a decode half that ends before prefill's,
    /// rows that overlap and disagree, an empty trajectory): the message says which.
    Inconsistent,
}

impl ErrorKind {
    /// Whether the input itself is malformed (Python's `PayloadError`), rather than well-formed
    /// parts that do not fit together (`MergeError`).
    pub fn is_malformed_input(&self) -> bool {
        matches!(
            self,
            ErrorKind::Field { .. }
                | ErrorKind::Json { .. }
                | ErrorKind::Counts { .. }
                | ErrorKind::Row { .. }
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
    pub fn payload(msg: impl Into<String>) -> Self {
        Error::new(ErrorKind::Malformed, msg)
    }

    /// Parts that do not fit together, of a kind with no fields of its own
    /// ([`ErrorKind::Inconsistent`]).
    pub fn merge(msg: impl Into<String>) -> Self {
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
            Error::merge("x"),
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
        assert!(Error::payload("x").kind().is_malformed_input());
    }
}
