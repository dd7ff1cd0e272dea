#!/usr/bin/env python3
"""Every type's methods are in the file that defines it: an inherent `impl T` in another file of
the crate fails (`make lint` runs it on the three crates), so "where is T, and where does a new
method of T go" has one answer, the file named for it. Trait impls (`impl Trait for T`) may live
beside the trait. Code under `#[cfg(test)]` is left out.

Usage: python3 .ci/type_homes.py [--except NAME]... CRATE_SRC_DIR...

`--except NAME` lets one type keep methods in another file; say why where it is passed.
Exit status 1 when a type's methods are outside its file.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from module_circles import strip, test_spans, in_spans  # noqa: E402

DEFINITION = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:struct|enum|union|trait|type)\s+([A-Z]\w*)", re.M
)
# `impl<...> Name<...> {`: an inherent impl (one whose head has no `for`; see `inherent`).
IMPL = re.compile(r"^\s*impl\b([^{;]*)\{", re.M)
NAMED = re.compile(r"^(?:<.*?>)?\s*([A-Z]\w*)")


def rust_files(root):
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if name.endswith(".rs"):
                yield os.path.join(folder, name)


def homes(root):
    """{type: files defining it}, {type: files with an inherent impl of it}."""
    defined, implemented = {}, {}
    for path in rust_files(root):
        with open(path, encoding="utf-8") as f:
            text = strip(f.read())
        spans = test_spans(text)
        for m in DEFINITION.finditer(text):
            if not in_spans(m.start(), spans):
                defined.setdefault(m.group(1), set()).add(path)
        for m in IMPL.finditer(text):
            name = inherent(m.group(1))
            if name and not in_spans(m.start(), spans):
                implemented.setdefault(name, set()).add(path)
    return defined, implemented


def inherent(head):
    """The type an impl head (between `impl` and `{`) gives methods to, or None for a trait
    impl (`... for T`)."""
    if re.search(r"\bfor\b", head):
        return None
    m = NAMED.match(head.strip())
    return m.group(1) if m else None


def main():
    args, allowed = [], set()
    it = iter(sys.argv[1:])
    for a in it:
        if a == "--except":
            allowed.add(next(it))
        else:
            args.append(a)
    strays = []
    for root in args:
        defined, implemented = homes(root)
        for name, files in sorted(implemented.items()):
            own = defined.get(name, set())
            elsewhere = files - own
            # A name defined in several files is several types: each impl sits beside one.
            if elsewhere and name not in allowed:
                strays.append(f"{name} (defined in {', '.join(sorted(own)) or '?'}) has "
                              f"methods in {', '.join(sorted(elsewhere))}")
    for s in strays:
        print(s)
    if strays:
        print(f"{len(strays)} type(s) with methods outside the file that defines them")
        return 1
    print("every type's methods are in its own file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
