//! [`Answer`]: the shape of a completion request's answer, decided once, before any server is
//! called, from the request and the proxy's settings.

use super::config::{Config, PromptRouting, StreamRouting};
use super::fault::Fault;
use super::request::{Api, ClientBody, PROMPT_ROUTING};

/// How a request is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// One JSON body: decode's, its routing merged with prefill's; with `shared_prompt`, the
    /// prompt's rows once at the top level (format.md §4.1).
    Plain { shared_prompt: bool },
    /// A completions or chat stream written from decode's plain answer (`stream_routing`
    /// buffered: vLLM streams no routing there).
    EventsFromPlain,
    /// Decode's stream relayed as it comes, each routing event merged as it passes (`/generate`
    /// streams, and `stream_routing` relay).
    Relay,
}

impl Answer {
    /// The shape `body` is answered in. A shared-prompt answer asked for a stream is the
    /// client's mistake: a stream's choices end one at a time, each with its own routing.
    pub(crate) fn of(stream: bool, body: &ClientBody, config: &Config) -> Result<Answer, Fault> {
        if !stream {
            let routing = body.prompt_routing.unwrap_or(config.prompt_routing);
            return Ok(Answer::Plain {
                shared_prompt: routing == PromptRouting::Shared,
            });
        }
        if body.prompt_routing == Some(PromptRouting::Shared) {
            return Err(Fault::bad_field(
                PROMPT_ROUTING,
                format!(
                    "{PROMPT_ROUTING}=\"shared\" is for plain requests: a stream's choices each \
                     end with their whole routing (ask without stream, or leave the field out)"
                ),
            ));
        }
        Ok(
            match body.api() != Api::Generate && config.stream_routing == StreamRouting::Buffered {
                true => Answer::EventsFromPlain,
                false => Answer::Relay,
            },
        )
    }

    /// The answer's `content-type` (a relayed stream takes decode's).
    pub(crate) fn mime(self) -> &'static str {
        match self {
            Answer::Plain { .. } => "application/json",
            Answer::EventsFromPlain | Answer::Relay => "text/event-stream",
        }
    }
}
