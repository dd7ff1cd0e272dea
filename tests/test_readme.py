"""The README's Python blocks run as written, in order, in one namespace (a user copies them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
QUICKSTART = "# quickstart: needs the three commands above running"


@pytest.mark.source_tree
def test_every_python_block_of_the_readme_runs() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
    assert len(blocks) >= 3
    # The quickstart's block needs servers: the next test runs it with them.
    blocks = [b for b in blocks if not b.startswith(QUICKSTART)]
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # pragma: no cover - the failure names the block
            raise AssertionError(f"README.md python block {i + 1} fails: {e!r}") from e


@pytest.mark.source_tree
def test_the_proxy_quickstart_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's three commands (on ports the system picks, which they print) and the OpenAI
    SDK request after them, as a user copies them."""
    import contextlib
    import shlex
    import sys
    import time
    import urllib.request

    pytest.importorskip("openai")
    text = README.read_text()
    start = text.index("**Try it in a minute")
    commands = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    client = re.search(r"```python\n(" + re.escape(QUICKSTART) + r".*?)```", text[start:], re.S)
    assert commands and client
    lines = [line.rstrip(" &") for line in commands.group(1).strip().splitlines()]
    assert len(lines) == 3
    exe = str(Path(sys.executable).with_name("routed-experts"))
    ports: dict[str, str] = {}

    def run(line: str) -> tuple[subprocess.Popen[str], str]:
        for fixed, actual in ports.items():
            line = line.replace(f":{fixed}", f":{actual}")
        argv = shlex.split(line)
        assert argv[0] == "routed-experts"
        fixed = argv[argv.index("--port") + 1]
        argv[argv.index("--port") + 1] = "0"
        proc = subprocess.Popen(
            [exe, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for said in proc.stdout:  # the engine prints its URL; the proxy logs it
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", said)
            if found:
                ports[fixed] = found.group(1)
                return proc, found.group(1)
        raise AssertionError(f"{line!r} ended before it said its port")

    with contextlib.ExitStack() as stack:
        procs = []
        for line in lines:
            proc, _ = run(line)
            procs.append(proc)
            stack.callback(_end, proc)
        proxy = f"http://127.0.0.1:{ports['8000']}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(proxy + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "the proxy never became healthy"
                time.sleep(0.1)
        code = client.group(1).replace(":8000", ":" + ports["8000"])
        exec(compile(code, "README.md quickstart", "exec"), {})  # noqa: S102
        assert all(p.poll() is None for p in procs)
    assert capsys.readouterr().out.strip() == "(31, 48, 8)"


def _end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
