#!/usr/bin/env python3
"""The tree's one file map is docs/development.md's "Layout" section: every source file of the
crates, the package, the benches, the examples, the fuzz targets, the engine harness and this
folder is named there (in backticks, by its name or a path ending in it), and every file a doc
names, there or in docs/architecture.md, exists. `make lint` runs it; exit status 1 lists what
the map lacks or names wrongly.

Usage: python3 .ci/file_map.py
"""
import os
import re
import subprocess
import sys

MAP = "docs/development.md"
ALSO_CHECKED = ["docs/architecture.md"]
ROOTS = ["src", "crates", "python/routed_experts", "benches", "examples", "fuzz/fuzz_targets",
         "tests/real/harness", ".ci"]
SOURCE = (".rs", ".py", ".pyi")
NAMED = re.compile(r"`([\w./-]+\.(?:rs|pyi|py))`")


def tracked():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if os.path.exists(p)]


def section(text, title):
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def names_in(text):
    # Names only in backticks, so a word like `a.b` in prose is not taken for a file.
    return {m.group(1) for m in NAMED.finditer(text)}


def covers(name, path):
    return path == name or path.endswith("/" + name)


def main():
    files = tracked()
    sources = [p for p in files if p.endswith(SOURCE)
               and any(p == r or p.startswith(r + "/") for r in ROOTS)]
    with open(MAP, encoding="utf-8") as f:
        mapped = names_in(section(f.read(), "Layout"))
    problems = []
    for path in sources:
        if not any(covers(name, path) for name in mapped):
            problems.append(f"{MAP}, Layout: {path} is not named (add what it holds)")
    for doc in [MAP, *ALSO_CHECKED]:
        with open(doc, encoding="utf-8") as f:
            named = names_in(f.read())
        for name in sorted(named):
            if not any(covers(name, path) for path in files):
                problems.append(f"{doc}: `{name}` names no file of the tree")
    for p in problems:
        print(p)
    print(f"file map: {len(sources)} source files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
