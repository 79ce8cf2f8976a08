#!/usr/bin/env python3
"""The import rules of the engine (docs/architecture.md, "Layers").

Checks two things:

* no cycle between the top-level modules of the engine crate (core/src):
  reads every source file, finds which top-level modules it names (`use
  crate::x`, `crate::x::...`; `super::` from a top-level module's own files
  is internal), and requires every strongly connected component of the
  import graph to be a single module. A cycle is reported with one of its
  edges and the file and line that make it;
* the pure crate (proto/) stays pure: its manifest names no crate that does
  I/O (an async runtime, libc, sockets, the TUN), and none reaches it
  through another dependency (`cargo tree`). What it may not call (the
  clock, sleeping) is clippy's to check (proto/clippy.toml).

Test code is left out: `#[cfg(test)] mod tests` blocks at the end of a file,
and files that only tests compile (`tests.rs`, `testutil.rs`).

Usage: scripts/check-layers.py [--graph]   (exit 1 on a violation)
"""

import os
import re
import subprocess
import sys
import tomllib

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ROOT = os.path.join(REPO, "core", "src")
PURE_MANIFEST = os.path.join(REPO, "proto", "Cargo.toml")
# Crates that do I/O: never a dependency of the pure crate.
IO_CRATES = {"tokio", "libc", "socket2", "mio", "nix", "tun-rs", "smoltcp", "kerntun"}
# Of those, the ones that must not reach it through another crate either
# (libc comes in through parking_lot's futex wait on Linux, which is a lock,
# not I/O).
IO_TRANSITIVE = IO_CRATES - {"libc"}
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


def check_pure():
    """Violations of the pure crate's dependency rule."""
    with open(PURE_MANIFEST, "rb") as fh:
        manifest = tomllib.load(fh)
    bad = 0
    for table in ("dependencies", "build-dependencies"):
        for name, spec in manifest.get(table, {}).items():
            crate = spec.get("package", name) if isinstance(spec, dict) else name
            if crate in IO_CRATES:
                bad += 1
                print(f"proto/Cargo.toml [{table}] names {crate}: the pure crate does no I/O")
    try:
        tree = subprocess.run(
            ["cargo", "tree", "-p", "kerntun-proto", "-e", "normal", "--prefix", "none", "--format", "{p}"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"check-layers: cargo tree -p kerntun-proto failed: {e}")
        return bad + 1
    reached = {line.split()[0] for line in tree.splitlines() if line.strip()}
    for crate in sorted(reached & IO_TRANSITIVE):
        bad += 1
        print(f"the pure crate reaches {crate} through its dependencies (cargo tree -p kerntun-proto -i {crate})")
    return bad


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
    bad += check_pure()
    if bad:
        print(f"check-layers: {bad} violation(s); see docs/architecture.md, \"Layers\"")
        return 1
    print(f"check-layers: {len(nodes)} modules, {len(found)} imports, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
