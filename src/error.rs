//! The one error type of the core. The binding layer maps each kind to a Python exception
//! (`PayloadError`, `MergeError`; a missing half is a `MergeError`), beneath
//! `RoutedExpertsError(ValueError)`.

use std::fmt::Display;

/// What went wrong, with a message naming the field, the expected and the actual value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Malformed input: bad JSON, bad base64, a shape that does not match the data, ...
    #[error("{0}")]
    Payload(String),
    /// Inconsistent halves or turns: gaps, mismatched layers/top_k, overlap conflicts.
    #[error("{0}")]
    Merge(String),
    /// One half of a prefill/decode pair carries routing and the other none: the half at
    /// fault is data, so a proxy blames the right server without reading the message.
    #[error("{1}")]
    MissingRouting(Half, String),
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
    /// "`field`: expected X, got Y", the shape of every field-level message.
    pub fn field(field: &str, expected: impl Display, actual: impl Display) -> Self {
        Error::Payload(format!("`{field}`: expected {expected}, got {actual}"))
    }

    /// A [`Error::Payload`] with `msg`.
    pub fn payload(msg: impl Into<String>) -> Self {
        Error::Payload(msg.into())
    }

    /// A [`Error::Merge`] with `msg`.
    pub fn merge(msg: impl Into<String>) -> Self {
        Error::Merge(msg.into())
    }

    /// Prefix the message with where it happened (a format name, a choice index, ...).
    pub fn context(self, ctx: impl Display) -> Self {
        match self {
            Error::Payload(m) => Error::Payload(format!("{ctx}: {m}")),
            Error::Merge(m) => Error::Merge(format!("{ctx}: {m}")),
            Error::MissingRouting(h, m) => Error::MissingRouting(h, format!("{ctx}: {m}")),
        }
    }
}
