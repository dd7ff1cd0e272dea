#!/usr/bin/env python3
"""No module circles in a Rust crate: its module dependency graph, read from its source text,
and its cycles (`make lint` runs it on the three crates, file by file and by top-level folder;
docs/architecture.md's claim that the crates have none rests on it).

Usage: python3 .ci/module_circles.py [--folders] [--with-tests] [--edges] CRATE_ROOT_FILE...

Why a script rather than a tool: cargo-modules 0.28 needs rustc 1.98; 0.27's `--acyclic` fails
on item-level edges (a type and its own methods) before any filter applies, and its graph
records `use` lines and signatures but not paths inside function bodies, so it misses circles
made by calls; cargo-cycles 0.2 panics on this workspace. Python's standard library only.

An edge A -> B means: module A names (in a `use`, or a path in code, or a macro it
invokes) an item *defined* in module B. Re-exports (`pub use`) are followed to the
definition, as rust-analyzer does; paths that only pass through a re-exporting module
(e.g. `crate::dtype::DType` via lib.rs's `pub use payload::dtype`) are recorded with the
re-exporter noted. `mod` declarations (ownership) are not edges. Code under `#[cfg(test)]`
is left out unless --with-tests. Exit status 1 if any cycle is found (for CI).
"""
import os
import re
import sys
from collections import defaultdict

KEYWORDS = {"crate", "super", "self", "$crate"}
COLLAPSE = "--collapse-inline" in sys.argv
VIA = "--via" in sys.argv or "--via-root" in sys.argv
VIA_ROOT = "--via-root" in sys.argv


def strip(text):
    """Blank comments, string and char literals (keeping newlines and offsets)."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth += 1
                    j += 2
                elif text.startswith("*/", j):
                    depth -= 1
                    j += 2
                else:
                    j += 1
            blank(i, j)
            i = j
        else:
            m = re.compile(r'b?r(#*)"').match(text, i)
            if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
                end = '"' + m.group(1)
                j = text.find(end, m.end())
                j = n if j < 0 else j + len(end)
                blank(i, j)
                i = j
                continue
            if c == '"':
                j = i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                blank(i, j + 1)
                i = j + 1
                continue
            if c == "'":
                # char literal vs lifetime
                m = re.compile(r"'(\\.[^']*|[^'\\])'").match(text, i)
                if m:
                    blank(i, m.end())
                    i = m.end()
                    continue
            i += 1
    return "".join(out)


def match_brace(s, i):
    """s[i] == '{'; index after the matching '}'."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def test_spans(s):
    """Spans of items under #[cfg(test)] (or #[cfg(all(test, ..))])."""
    spans = []
    for m in re.finditer(r"#\[cfg\((?:all\()?test\b[^\]]*\]", s):
        # the next item: up to its ';' or its matching '{...}'
        j = m.end()
        # skip further attributes
        while True:
            mm = re.compile(r"\s*#\[[^\]]*\]").match(s, j)
            if not mm:
                break
            j = mm.end()
        semi = s.find(";", j)
        brace = s.find("{", j)
        if brace != -1 and (semi == -1 or brace < semi):
            spans.append((m.start(), match_brace(s, brace)))
        else:
            spans.append((m.start(), semi + 1))
    return spans


def in_spans(pos, spans):
    return any(a <= pos < b for a, b in spans)


def expand_use_tree(tree):
    """'a::{b, c::{d as e}, self}' -> [(['a','b'],'b'), ...]; glob -> name '*'."""
    tree = re.sub(r"\s+", " ", tree).strip()
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree)

    def parse(t, prefix):
        res = []
        # split top-level on ::{ ... }
        if t.startswith("::"):
            t = t[2:]
        m = re.match(r"^((?:[\w$]+::)*)\{(.*)\}$", t)
        if m:
            pre = [p for p in m.group(1).split("::") if p]
            inner = m.group(2)
            parts, depth, cur = [], 0, ""
            for ch in inner:
                if ch == "," and depth == 0:
                    parts.append(cur)
                    cur = ""
                    continue
                depth += ch == "{"
                depth -= ch == "}"
                cur += ch
            parts.append(cur)
            for p in parts:
                if p:
                    res += parse(p, prefix + pre)
            return res
        alias = None
        if " as " in t:
            t, alias = t.split(" as ")
        segs = [p for p in t.split("::") if p]
        full = prefix + segs
        if segs == ["self"]:
            full = prefix
            name = alias or (prefix[-1] if prefix else "self")
        elif segs and segs[-1] == "*":
            name = "*"
        else:
            name = alias or full[-1]
        res.append((full, name))
        return res

    return parse(tree, [])


class Module:
    def __init__(self, path, file, test=False, inline=False):
        self.path = path  # tuple of names, () for root
        self.file = file
        self.test = test
        self.inline = inline
        self.children = {}
        self.uses = []  # (segments, name, is_pub, line, is_test)
        self.items = set()  # names defined here
        self.code_paths = []  # (segments, line, is_test)
        self.macros = []  # (name, line, is_test)

    def name(self):
        return "crate" + "".join("::" + p for p in self.path)


class Crate:
    def __init__(self, root_file):
        self.root_file = root_file
        self.modules = {}
        self.exported_macros = {}  # macro name -> defining module path (file)
        self.macro_paths = {}  # macro name -> $crate paths in its body
        self.load((), root_file, is_root=True)

    def load(self, path, file, is_root=False, test=False, text=None, line0=0, inline=False):
        mod = Module(path, file, test, inline)
        self.modules[path] = mod
        if text is None:
            with open(file) as f:
                text = f.read()
        s = strip(text)
        spans = test_spans(s)
        d = os.path.dirname(file)
        base = os.path.basename(file)
        if is_root or base == "mod.rs":
            childdir = d
        else:
            childdir = os.path.join(d, base[:-3])

        def lineno(pos):
            return line0 + s.count("\n", 0, pos) + 1

        # inline modules: handled recursively; blank them out of this module's text
        inner = []
        for m in re.finditer(r"(?m)^[ \t]*(?:pub(?:\([\w:]+\))?\s+)?mod\s+(\w+)\s*\{", s):
            if any(a <= m.start() < b for a, b in inner):
                continue
            end = match_brace(s, m.end() - 1)
            inner.append((m.start(), end))
            name = m.group(1)
            is_t = test or in_spans(m.start(), spans)
            # keep the original text (with strings) for the child, but we parse stripped anyway
            self.load(path + (name,), file, test=is_t, text=text[m.end():end - 1],
                      line0=lineno(m.end()) - 1, inline=True)
            mod.children[name] = path + (name,)
            mod.items.add(name)
        s2 = list(s)
        for a, b in inner:
            for k in range(a, b):
                if s2[k] != "\n":
                    s2[k] = " "
        s = "".join(s2)

        # file modules
        for m in re.finditer(r"(?m)^[ \t]*(?:pub(?:\([\w:]+\))?\s+)?mod\s+(\w+)\s*;", s):
            name = m.group(1)
            cand = [os.path.join(childdir, name + ".rs"), os.path.join(childdir, name, "mod.rs")]
            f = next((c for c in cand if os.path.exists(c)), None)
            if f is None:
                print("warning: no file for mod", name, "in", file, file=sys.stderr)
                continue
            is_t = test or in_spans(m.start(), spans)
            self.load(path + (name,), f, test=is_t)
            mod.children[name] = path + (name,)
            mod.items.add(name)

        # modules declared by a macro (`$(mod $module;)+`, as formats/mod.rs's `producers!`):
        # each `VARIANT in MODULE` line of its invocation declares MODULE, and the macro's
        # `&$module::PRODUCER` makes this module name it.
        for mm in re.finditer(r"macro_rules!\s*(\w+)\s*\{", s):
            body = s[mm.end() - 1:match_brace(s, mm.end() - 1)]
            if not re.search(r"mod\s+\$\w+\s*;", body):
                continue
            for inv in re.finditer(re.escape(mm.group(1)) + r"!\s*\{", s):
                if inv.start() == mm.start():
                    continue
                iend = match_brace(s, inv.end() - 1)
                for line in re.finditer(r"\b\w+\s+in\s+(\w+)\s*,", s[inv.end():iend]):
                    name = line.group(1)
                    cand = [os.path.join(childdir, name + ".rs"), os.path.join(childdir, name, "mod.rs")]
                    f = next((c for c in cand if os.path.exists(c)), None)
                    if f is None or name in mod.children:
                        continue
                    self.load(path + (name,), f, test=test)
                    mod.children[name] = path + (name,)
                    mod.items.add(name)
                    pos = inv.end() + line.start(1)
                    mod.code_paths.append(([name, "PRODUCER"], lineno(pos),
                                           test or in_spans(pos, spans)))

        # use declarations
        for m in re.finditer(r"(?m)^[ \t]*(pub(?:\([\w:]+\))?\s+)?use\s+([^;]+);", s):
            is_pub = bool(m.group(1))
            is_t = test or in_spans(m.start(), spans)
            for segs, name in expand_use_tree(m.group(2)):
                mod.uses.append((segs, name, is_pub, lineno(m.start()), is_t))

        # defined items
        for m in re.finditer(
            r"(?m)^[ \t]*(?:pub(?:\([\w:]+\))?\s+)?(?:unsafe\s+|const\s+|async\s+|extern\s+\"C\"\s+)*"
            r"(fn|struct|enum|trait|type|const|static|union)\s+(\w+)", s):
            mod.items.add(m.group(2))
        for m in re.finditer(r"#\[macro_export\][\s\S]*?macro_rules!\s*(\w+)\s*\{", s):
            self.exported_macros[m.group(1)] = path
            body = s[m.end() - 1:match_brace(s, m.end() - 1)]
            self.macro_paths[m.group(1)] = sorted({p for p in re.findall(r"\$crate(?:::\w+)+", body)})
        for m in re.finditer(r"macro_rules!\s*(\w+)", s):
            mod.items.add(m.group(1) + "!")

        # paths in code (not in use lines)
        use_spans = [(m.start(), m.end()) for m in
                     re.finditer(r"(?m)^[ \t]*(pub(?:\([\w:]+\))?\s+)?use\s+([^;]+);", s)]
        for m in re.finditer(r"(?<![\w:])((?:\$crate|crate|super|self|[A-Za-z_]\w*)(?:::(?:\w+))+)", s):
            if in_spans(m.start(), use_spans):
                continue
            segs = m.group(1).split("::")
            is_t = test or in_spans(m.start(), spans)
            mod.code_paths.append((segs, lineno(m.start()), is_t))
        for m in re.finditer(r"(?<![\w:])(\w+)!\s*[\(\[\{]", s):
            if in_spans(m.start(), use_spans):
                continue
            is_t = test or in_spans(m.start(), spans)
            mod.macros.append((m.group(1), lineno(m.start()), is_t))

    # ---- resolution ----
    # An entity is (kind, module path): ("mod", p) for module p itself, ("item", p) for an
    # item defined in module p. `via` lists modules whose re-exports the path went through.
    def name_in(self, mod, name, scope, via, depth):
        key = (mod, name, scope)
        active = self.__dict__.setdefault("_active", set())
        if key in active:
            return None
        active.add(key)
        try:
            return self._name_in(mod, name, scope, via, depth)
        finally:
            active.discard(key)

    def _name_in(self, mod, name, scope, via, depth):
        m = self.modules.get(mod)
        if m is None or depth > 40:
            return None
        if name in m.children:
            return ("mod", m.children[name])
        if name in m.items or name + "!" in m.items:
            return ("item", mod)
        for usegs, uname, is_pub, line, t in m.uses:
            if uname == name and usegs:
                r = self.path_from(mod, usegs, via, depth + 1)
                if r is not None and not scope:
                    via.append(mod)
                return r
        if mod == () and name in self.exported_macros:
            return ("item", self.exported_macros[name])
        if scope:
            for usegs, uname, is_pub, line, t in m.uses:
                if uname == "*":
                    g = self.path_from(mod, usegs, [], depth + 1)
                    if g and g[0] == "mod":
                        r = self.name_in(g[1], name, False, via, depth + 1)
                        if r is not None:
                            return r
            if m.inline or mod == ():
                pass
            if name in self.exported_macros:  # #[macro_export] macros are usable by name
                return ("item", self.exported_macros[name])
        return None

    def path_from(self, cur, segs, via, depth=0):
        if not segs or depth > 40:
            return None
        first, rest = segs[0], segs[1:]
        if first in ("crate", "$crate"):
            ent = ("mod", ())
        elif first == "super":
            ent = ("mod", cur[:-1])
            while rest and rest[0] == "super":
                ent = ("mod", ent[1][:-1])
                rest = rest[1:]
        elif first == "self":
            ent = ("mod", cur)
        else:
            ent = self.name_in(cur, first, True, via, depth)
            if ent is None:
                return None
        for seg in rest:
            if ent[0] != "mod":
                break  # an associated item/variant of a type: stays with the type's module
            if seg == "*":
                break
            nxt = self.name_in(ent[1], seg, False, via, depth + 1)
            if nxt is None:
                return ("item", ent[1]) if seg[:1].isupper() or seg.startswith("__") else None
            ent = nxt
        return ent

    def resolve(self, cur, segs):
        via = []
        r = self.path_from(cur, segs, via)
        if r is None:
            return None
        return (r[1], via)

    def owner(self, path):
        """Map inline modules (tests etc.) onto their file module for the graph."""
        while path and self.modules[path].inline and COLLAPSE:
            path = path[:-1]
        return path

    def edges(self, with_tests):
        E = defaultdict(list)  # (a, b) -> [(file:line, text)]
        for p, m in self.modules.items():
            if m.test and not with_tests:
                continue
            a = self.owner(p)
            refs = []
            for segs, name, is_pub, line, t in m.uses:
                refs.append((segs, line, t, "use " + "::".join(segs) + ("" if name in (segs[-1:] or [""]) or name == "*" else " as " + name)))
            for segs, line, t in m.code_paths:
                refs.append((segs, line, t, "::".join(segs)))
            for name, line, t in m.macros:
                refs.append(([name], line, t, name + "!"))
                r = self.path_from(p, [name], [])
                if r and r[0] == "item":
                    for mname, mp in self.exported_macros.items():
                        if mp == r[1] and (name == mname or name in
                                           {u for _, u, _, _, _ in self.modules[mp].uses}):
                            for path in self.macro_paths.get(mname, []):
                                refs.append((path.split("::"), line, t,
                                             f"{name}! expands to {path}"))
            for segs, line, t, txt in refs:
                if t and not with_tests:
                    continue
                r = self.resolve(p, segs)
                if r is None:
                    continue
                tgt, via = r
                if tgt not in self.modules:
                    continue
                targets = [(self.owner(tgt), via)]
                if VIA:
                    targets += [(self.owner(v), []) for v in via if v != () or VIA_ROOT]
                for b, vv in targets:
                    if self.folders:
                        a2, b = a[:1], b[:1]
                    else:
                        a2 = a
                    if b == a2:
                        continue
                    if self.modules[b].test and not with_tests:
                        continue
                    note = [self.modules[v].name() for v in vv if v != a]
                    if vv is not via:
                        note = ["(edge to the re-exporting module)"]
                    E[(a2, b)].append((f"{os.path.relpath(m.file)}:{line}", txt, note))
        return E


def sccs(nodes, adj):
    index, low, onstack, stack, out = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        onstack.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in onstack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                onstack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in nodes:
        if v not in index:
            strong(v)
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) > 1:  # several crates: each checked, exit 1 if any has a cycle
        rc = 0
        for root in args:
            print(f"== {root}")
            sys.argv = [sys.argv[0], root] + [a for a in sys.argv[1:] if a.startswith("--")]
            rc |= main()
        return rc
    with_tests = "--with-tests" in sys.argv
    c = Crate(args[0])
    c.folders = "--folders" in sys.argv
    E = c.edges(with_tests)
    name = lambda p: c.modules[p].name()
    adj = defaultdict(set)
    for a, b in E:
        adj[a].add(b)
    if "--edges" in sys.argv:
        for (a, b), refs in sorted(E.items()):
            print(f"{name(a)} -> {name(b)}")
            for loc, txt, via in refs:
                print(f"    {loc}: {txt}" + (f"   [via re-export in {', '.join(via)}]" if via else ""))
    comps = sccs(sorted(adj), adj)
    level = ("with #[cfg(test)] code" if with_tests else "non-test code") + \
        (", by top-level folder" if c.folders else "") + \
        (", re-exporting modules counted" if VIA else "") + (" (crate root too)" if VIA_ROOT else "")
    if not comps:
        print(f"no module cycles ({level})")
        return 0
    for comp in comps:
        cs = set(comp)
        print(f"CYCLE ({level}): " + ", ".join(sorted(name(x) for x in comp)))
        for (a, b), refs in sorted(E.items()):
            if a in cs and b in cs:
                print(f"  {name(a)} -> {name(b)}")
                for loc, txt, via in refs:
                    print(f"      {loc}: {txt}" + (f"   [via re-export in {', '.join(via)}]" if via else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
