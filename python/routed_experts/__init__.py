"""Routed experts for MoE router replay: parse, merge, stitch and encode at memory speed.

Every hop of MoE reinforcement learning (engine -> router -> orchestrator -> trainer) moves the
per-token, per-layer top-k expert ids that router replay needs. This package does the hot path in
Rust (GIL released) and hands numpy arrays over without copies.
"""

from routed_experts._core import (
    FORMATS,
    Agreement,
    ConfigError,
    ExpertLoad,
    MergeError,
    PayloadError,
    RoutedExperts,
    RoutedExpertsError,
    Trajectory,
    agreement,
    decode,
    detect_format,
    encode,
    expert_load,
    from_response,
    get_max_bytes,
    group_from_response,
    merge,
    merge_response,
    pack,
    pack_shard,
    set_max_bytes,
    shard,
)
from routed_experts._core import (
    __version__ as __version__,
)

from . import replay

__all__ = [
    "Agreement",
    "ConfigError",
    "ExpertLoad",
    "FORMATS",
    "MergeError",
    "PayloadError",
    "RoutedExperts",
    "RoutedExpertsError",
    "Trajectory",
    "agreement",
    "decode",
    "detect_format",
    "encode",
    "expert_load",
    "from_response",
    "get_max_bytes",
    "group_from_response",
    "merge",
    "merge_response",
    "pack",
    "pack_shard",
    "replay",
    "set_max_bytes",
    "shard",
]

# `__version__` is the crate's (Cargo.toml's `workspace.package.version`), set by the build.
