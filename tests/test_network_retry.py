"""tests/network_retry.py: a download tried again after a pause when it fails, the last failure
final with the command's exit status, and pip's own retries raised unless the caller set them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import network_retry
import pytest


def flaky(tmp_path: Path, failures: int) -> tuple[str, Path]:
    """A stand-in command: it records each call's arguments and PIP_RESUME_RETRIES, and exits 3
    for its first `failures` calls, 0 after."""
    calls = tmp_path / "calls"
    script = tmp_path / "flaky"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$* $PIP_RESUME_RETRIES" >> {calls}\n'
        f'[ "$(wc -l < {calls})" -gt {failures} ] || exit 3\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), calls


def test_a_failed_download_is_tried_again_until_it_succeeds(tmp_path: Path) -> None:
    command, calls = flaky(tmp_path, failures=2)
    cleared = []
    without = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    network_retry.run([command, "-m", "pip", "install", "numpy"], env=without, pauses=(0, 0),
                      before_again=lambda: cleared.append(1))  # fmt: skip
    assert calls.read_text().splitlines() == ["-m pip install numpy 20"] * 3
    assert cleared == [1, 1]


def test_the_third_failure_is_final_with_the_commands_exit_status(tmp_path: Path) -> None:
    command, calls = flaky(tmp_path, failures=5)
    with pytest.raises(subprocess.CalledProcessError) as failed:
        network_retry.run([command, "download"], pauses=(0, 0))
    assert failed.value.returncode == 3
    assert len(calls.read_text().splitlines()) == 3


def test_the_callers_own_pip_settings_are_kept(tmp_path: Path) -> None:
    command, calls = flaky(tmp_path, failures=0)
    network_retry.run([command, "x"], env={**os.environ, "PIP_RESUME_RETRIES": "7"}, pauses=())
    assert calls.read_text().splitlines() == ["x 7"]


def test_the_command_line_exits_with_the_commands_status(tmp_path: Path) -> None:
    command, _ = flaky(tmp_path, failures=0)
    script = Path(network_retry.__file__)
    assert subprocess.run([sys.executable, str(script), command, "x"]).returncode == 0
    assert subprocess.run([sys.executable, str(script)], capture_output=True).returncode == 1
