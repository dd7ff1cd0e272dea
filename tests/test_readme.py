"""The README's Python blocks run as written, in order, in one namespace (a user copies them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.source_tree
def test_every_python_block_of_the_readme_runs() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
    assert len(blocks) >= 3
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # pragma: no cover - the failure names the block
            raise AssertionError(f"README.md python block {i + 1} fails: {e!r}") from e
