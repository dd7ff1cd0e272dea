"""The CHANGELOG is a changelog (issue 63): releases and what a user notices. The figures as
measured at each stage live in docs/benchmark-history.md, where a reader who wants them finds
them."""

from __future__ import annotations

import pytest

from conftest import REPO

CHANGELOG = REPO / "CHANGELOG.md"
HISTORY = REPO / "docs" / "benchmark-history.md"

# Headings the history had when it moved out of the CHANGELOG: none of its sections is lost.
HISTORY_HEADINGS = [
    "The P/D proxy, measured",
    "The fair race (issue 55): the full explanation",
    "Issue 39: where a vLLM-body request's CPU goes (why 0.4x is not reached there)",
    "Long-context load, slow readers, byte-split events (issue 25)",
    "The Python data plane (before)",
    "One pass over the text (issue 29), measured",
    "Base64 at memory speed",
    "The page-fault cliff",
    "Replay quality: goals and where the time goes",
    "The R3 loop, end to end (issue 54)",
    "Full table (2026-11-25)",
    "The checks of issue 24 (formats in the wild): their cost",
    "Criterion (Rust core, no Python)",
    "Before and after the three-crate split (issue 27)",
]


@pytest.mark.source_tree
def test_the_changelog_is_short_and_the_measurements_live_in_the_history() -> None:
    lines = CHANGELOG.read_text().splitlines()
    assert len(lines) < 400, (
        f"CHANGELOG.md is {len(lines)} lines: keep it to releases and what a user notices; "
        "measurements go in docs/benchmark-history.md"
    )
    assert not any(line.startswith("## Benchmark history") for line in lines)
    assert "docs/benchmark-history.md" in CHANGELOG.read_text()


@pytest.mark.source_tree
def test_the_benchmark_history_keeps_every_section_it_had() -> None:
    assert HISTORY.exists(), "docs/benchmark-history.md is missing"
    headings = {
        line.lstrip("#").strip() for line in HISTORY.read_text().splitlines()
        if line.startswith("#")
    }
    missing = [h for h in HISTORY_HEADINGS if h not in headings]
    assert not missing, f"docs/benchmark-history.md lost these sections: {missing}"
