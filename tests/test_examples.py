"""The Python examples (examples/*.py) run as a user runs them, each in a process of its own, and
say what they did: a router's merge, an orchestrator's rollout, a trainer's batch and shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What each example must print: the results a user reads, and each error it shows by name.
EXPECTED = {
    "router.py": [
        "merged: ",
        "rows [0, 9), shape (9, 4, 2)",
        "text kept:  Paris",
        "a gap: MergeError: ",
        "mismatched halves: MergeError: ",
        "no prefill routing: MergeError: ",
        "a start no router asks: PayloadError: ",
    ],
    "orchestrator.py": [
        "rows [0, 13) -> trajectory [0, 13)",
        "rows [13, 27) -> trajectory [0, 27)",
        "rows [27, 39) -> trajectory [0, 39)",
        "refused, trajectory unchanged at [0, 39): ",
        "the other process: received rows [0, 39) -> training array (40, 4, 2), 39 rows with "
        "routing",
    ],
    "trainer.py": [
        "batch (56, 4, 2) int32, cu_seqlens [0, 20, 32, 56], 49 of 56 rows with routing",
        "cp rank 0, tp rank 0: (14, 2, 2), cu_seqlens [0, 10, 16, 28]",
        "cp rank 1, tp rank 1: (14, 2, 2), cu_seqlens [0, 10, 16, 28]",
        "agreement: exact match 0.969",
        "expert load: imbalance per layer [",
    ],
}


@pytest.mark.source_tree
def test_every_python_example_is_tested() -> None:
    assert sorted(p.name for p in (REPO / "examples").glob("*.py")) == sorted(EXPECTED)


@pytest.mark.source_tree
@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_the_example_runs_as_written(example: str) -> None:
    # As its header says: with the clone's .venv python (what `make run` installs), from the
    # clone's root.
    header = (REPO / "examples" / example).read_text().split('"""')[1]
    assert f"Run it: .venv/bin/python examples/{example}, after `make run`" in header, header
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / example)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    for said in EXPECTED[example]:
        assert said in done.stdout, (said, done.stdout)
