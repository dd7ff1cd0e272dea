"""Routed experts for MoE router replay: parse, merge, stitch and encode at memory speed.

Every hop of MoE reinforcement learning (engine -> router -> orchestrator -> trainer) moves the
per-token, per-layer top-k expert ids that router replay needs. This package does the hot path in
Rust (GIL released) and hands numpy arrays over without copies.
"""

from routed_experts import _core
from routed_experts._core import *  # noqa: F403 (the public API: the extension's `__all__`)
from routed_experts._core import __version__ as __version__

from . import replay

# One list of public names, the extension's (crates/python/src/lib.rs), and `replay`.
__all__ = ["replay"]
__all__ += _core.__all__

# `__version__` is the crate's (Cargo.toml's `workspace.package.version`), set by the build.
