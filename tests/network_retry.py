"""A command that downloads (pip, debootstrap, apt-get, rustup), run again after a pause when the
network drops it.

Every environment the project makes (the Makefile's venv, the engines', the trainer's, the
wheel checks') is downloaded, gigabytes of it on a fresh machine. A CI run once failed in the
linters' install: the registry's connection broke at the same byte on each of pip's six quick
resumes ("incomplete-download"). pip's own retries come seconds apart; a pause of a minute or
two outlasts a broken connection. The third failure is final, with the command's own message
and exit status.

    python3 tests/network_retry.py COMMAND...   # e.g. .venv/bin/python -m pip install numpy

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

# Seconds to wait before the second and the third try.
PAUSES = (30, 120)
# pip's own retries within one try: connections (--retries, 5 by default) and resumes of a
# broken download (--resume-retries, pip 25.1 and newer; an older pip ignores the variable).
# A caller's own setting is kept.
PIP_SETTINGS = {"PIP_RETRIES": "10", "PIP_RESUME_RETRIES": "20", "PIP_TIMEOUT": "60",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip


def run(command: Sequence[str], env: Mapping[str, str] | None = None,
        pauses: Sequence[float] = PAUSES, before_again: Callable[[], None] | None = None,
        **kw: object) -> None:  # fmt: skip
    """Run `command` (subprocess.run's keywords in `kw`), up to len(pauses) + 1 times; raise
    CalledProcessError when the last try fails. `before_again` clears what a failed try left."""
    merged = dict(os.environ if env is None else env)
    for key, value in PIP_SETTINGS.items():
        merged.setdefault(key, value)
    for pause in [*pauses, None]:
        done = subprocess.run(list(command), env=merged, **kw)  # type: ignore[call-overload]
        if done.returncode == 0:
            return
        if pause is None:
            raise subprocess.CalledProcessError(done.returncode, list(command))
        print(f"network_retry: `{' '.join(command)}` exited {done.returncode}; "
              f"trying again in {pause:g} s", file=sys.stderr, flush=True)  # fmt: skip
        time.sleep(pause)
        if before_again is not None:
            before_again()


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python3 tests/network_retry.py COMMAND...")
    try:
        run(sys.argv[1:])
    except subprocess.CalledProcessError as failed:
        sys.exit(failed.returncode)


if __name__ == "__main__":
    main()
