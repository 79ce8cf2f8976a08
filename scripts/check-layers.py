#!/usr/bin/env python3
"""The import rule of the engine crate (docs/architecture.md, "Layers").

Reads every source file of core/src, finds which top-level modules of the
crate it names (`use crate::x`, `crate::x::...`, `super::` from a top-level
module's own files is internal), and checks two things:

* no cycle between top-level modules: every strongly connected component of
  the import graph is a single module. A cycle is reported with one of its
  edges and the file and line that make it;
* the pure layers (packet, nat, translate, stats) import only each other:
  nothing that holds I/O or engine state.

Test code is left out: `#[cfg(test)] mod tests` blocks at the end of a file,
and files that only tests compile (`tests.rs`, `testutil.rs`).

Usage: scripts/check-layers.py [--graph]   (exit 1 on a violation)
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core", "src")
PURE = {"packet", "nat", "translate", "stats"}
# Files compiled only for tests: their imports do not shape the engine.
TEST_FILES = {"tests.rs", "testutil.rs", "recvx_emul.rs"}
PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)")
USE_GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.S)


def top_module(rel):
    """The top-level module a file belongs to (`lib` for lib.rs)."""
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".rs") else first


def strip_tests(text):
    """Source without comments and without a trailing `#[cfg(test)] mod ...`."""
    text = re.sub(r"//[^\n]*", "", text)
    m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
    return text[: m.start()] if m else text


def edges():
    found = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in sorted(files):
            if not f.endswith(".rs") or f in TEST_FILES:
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT)
            src = top_module(rel)
            if src == "lib":
                continue  # the crate root declares every module
            with open(path, encoding="utf-8") as fh:
                raw = fh.read()
            text = strip_tests(raw)
            names = [(m.group(1), m.start()) for m in PATH.finditer(text)]
            for g in USE_GROUP.finditer(text):
                for item in re.split(r",", g.group(1)):
                    item = item.strip()
                    if item:
                        name = re.match(r"[a-z_][a-z0-9_]*", item)
                        if name:
                            names.append((name.group(0), g.start()))
            for dst, pos in names:
                if dst == src or dst in ("self",):
                    continue
                line = text.count("\n", 0, pos) + 1
                found.setdefault((src, dst), f"core/src/{rel}:{line}")
    return found


def sccs(nodes, adj):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main():
    found = edges()
    adj, nodes = {}, set()
    for (a, b) in found:
        adj.setdefault(a, set()).add(b)
        nodes.update((a, b))
    if "--graph" in sys.argv:
        for a in sorted(adj):
            print(f"{a} -> {', '.join(sorted(adj[a]))}")
    bad = 0
    for comp in sccs(nodes, adj):
        if len(comp) < 2:
            continue
        members = set(comp)
        bad += 1
        print(f"cycle between core modules: {', '.join(sorted(members))}")
        for (a, b), where in sorted(found.items()):
            if a in members and b in members:
                print(f"  {a} -> {b}  ({where})")
    for (a, b), where in sorted(found.items()):
        if a in PURE and b not in PURE:
            bad += 1
            print(f"pure layer {a} imports {b} ({where}): pure layers import only {sorted(PURE)}")
    if bad:
        print(f"check-layers: {bad} violation(s); see docs/architecture.md, \"Layers\"")
        return 1
    print(f"check-layers: {len(nodes)} modules, {len(found)} imports, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
