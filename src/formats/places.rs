//! Where producers write routing in a body (format.md §3.2) and which rows they send there
//! (§3.3): the two things a producer's file declares beside its codec, so a body's walker and
//! the coverage checks ask the producers instead of listing formats themselves.

/// The kind of place a routing value was found at, which fixes the formats its producers write
/// there (format.md §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// `choices[i].routed_experts`: vLLM's `.npy` (0.22+), nested lists (vLLM 0.21's generated
    /// rows, lmdeploy's chat).
    Choice,
    /// Top-level `prompt_routed_experts`: nested lists (vLLM 0.21).
    Prompt,
    /// `choices[i].message.routed_experts`: NeMo-RL's `nrlre1` (nested lists before its PR #3292).
    Message,
    /// `sglext`, `meta_info` or `choices[i].meta_info`: SGLang's flat values, lmdeploy's nested
    /// lists.
    Sglang,
    /// `nvext` or `nvext.engine_data`: Dynamo's compact sidecar, or the backend's own value
    /// passed through (SGLang's flat values, vLLM's `.npy`).
    Nvext,
}

/// What a format's producers promise about the rows they send, for a sequence of `P` prompt
/// and `G` generated tokens and a requested start `S`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Rows `[S, P + G - 1)`: every position but the last sampled token's (vLLM 0.22+'s `.npy`,
    /// SGLang's flat values). The start is not in the value: the counts fix where it ends.
    EndsBeforeLastToken,
    /// Rows `[0, P + G)`, the last a filler (`0, 1, ..., top_k - 1` in every layer), not
    /// routing: NeMo-RL's values (`nrlre1` strings, nested lists before its PR #3292).
    WholeWithFiller,
    /// Rows from 0, ending anywhere up to `P + G` (lmdeploy's nested lists drop the last row
    /// after a stop string).
    FromZero,
    /// Nested lists at `choices[i].routed_experts`: lmdeploy's rows from 0 ([`Rule::FromZero`]),
    /// unless they number what vLLM 0.21 writes there (its generated rows, `G - 1` or `G`,
    /// whose prompt rows sit in a top-level `prompt_routed_experts` a router may have dropped):
    /// those cannot be told apart, and are refused with both readings named.
    ListsAtChoice,
    /// The value states its own start and shape (the compact sidecar): its positions are never
    /// guessed, and the body around it may have been rewritten by a router that kept another
    /// body's counts, so they are not held against it.
    SelfPlaced,
}
