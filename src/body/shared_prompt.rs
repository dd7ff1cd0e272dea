//! Reading the shared-prompt answer (format.md §4.1): the prompt's rows once, as a compact
//! sidecar at the top-level `prompt_routed_experts`, and each choice's own rows after them as a
//! compact sidecar of its own. A choice reads as its whole sequence: the prompt's rows, then
//! its own, which must start where the prompt's stop.

use crate::body::{BodyRouting, Found};
use crate::error::{Error, ErrorKind, Result};
use crate::formats::{self, Hints};
use crate::payload::{merge, Payload};

/// The whole sequence of choice `choice` (`None` when the body has no such choice). Hints are
/// held to what the values state, as for any compact sidecar: a start to the prompt's (the
/// sequence's start), the rest to both.
pub fn sequence(
    body: &BodyRouting,
    prompt: &Found,
    choice: u64,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Option<Payload>> {
    if !body.choices.iter().any(|(i, _)| *i == choice) {
        return Ok(None);
    }
    let rows = prompt_rows(prompt, hints, max_bytes)?;
    let Some(value) = body.value(choice) else {
        return Err(Error::new(
            ErrorKind::RowsLost,
            format!(
                "a shared-prompt answer without routing of choice {choice}'s own: its rows after \
                 the prompt's are lost (the shared answer writes every choice's, empty or not)"
            ),
        ));
    };
    let own = own_rows(&rows, value, hints, max_bytes)?;
    merge::concat(
        rows.start(),
        &[(&rows, 0, rows.num_tokens()), (&own, 0, own.num_tokens())],
    )
    .map(Some)
}

/// A choice's own rows must start exactly where the prompt's stop (each value states its
/// start; nothing is guessed), with the same layers and top_k.
pub fn check_follows(prompt: &Payload, own: &Payload) -> Result<()> {
    merge::check_same_rows(
        prompt.shape(),
        own.shape(),
        "the prompt's rows",
        "the choice's",
    )?;
    if own.start() == prompt.stop() {
        return Ok(());
    }
    let message = format!(
        "a shared-prompt answer's choice rows start at {} but the prompt's rows cover \
         [{}, {}): a choice's own rows follow the prompt's exactly",
        own.start(),
        prompt.start(),
        prompt.stop()
    );
    Err(if own.start() > prompt.stop() {
        let kind = ErrorKind::Gap {
            stop: prompt.stop(),
            start: own.start(),
        };
        Error::new(kind, message)
    } else {
        Error::malformed(message)
    })
}

/// The prompt's rows of a shared-prompt answer, a start hint held to theirs (the sequence's).
pub fn prompt_rows(prompt: &Found, hints: &Hints, max_bytes: usize) -> Result<Payload> {
    compact(prompt, hints, max_bytes)
}

/// A choice's own rows of a shared-prompt answer, held to follow `prompt`'s exactly
/// ([`check_follows`]); a start hint is the prompt's, not theirs.
pub fn own_rows(
    prompt: &Payload,
    value: &Found,
    hints: &Hints,
    max_bytes: usize,
) -> Result<Payload> {
    let own_hints = Hints {
        start: None,
        ..*hints
    };
    let own = compact(value, &own_hints, max_bytes)?;
    check_follows(prompt, &own)?;
    Ok(own)
}

fn compact(f: &Found, hints: &Hints, max_bytes: usize) -> Result<Payload> {
    let fields = f.fields.clone().unwrap_or_default();
    formats::decode_compact_fields(fields, hints, max_bytes).map_err(|e| e.context(&f.path))
}
