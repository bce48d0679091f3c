#!/usr/bin/env python3
"""The shape of the code at a git revision (default: the work tree): the module graph (top-level modules of src/
and the modules their non-test code names as `crate::<module>`), the largest files and the longest functions.

    scripts/code-shape.py            # the work tree
    scripts/code-shape.py a61c76a    # any revision, read with git show

The graph is the same reading as tests/module_graph.rs (comments and `#[cfg(test)]` modules left out), so an
upward import shows here as it fails there. Function length is lines from `fn` to its closing brace at the same
indentation (rustfmt's layout), test code included only in the file sizes.
"""

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def files_at(rev):
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "src").rglob("*.rs")}
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "src"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    return {
        n: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], check=True, capture_output=True,
                          text=True).stdout
        for n in names if n.endswith(".rs")
    }


def without_tests(text):
    out, lines = [], iter(text.splitlines())
    for line in lines:
        if line.lstrip().startswith("//"):
            continue
        if line.strip() != "#[cfg(test)]":
            out.append(line)
            continue
        nxt = next(lines, "")
        if nxt.rstrip().endswith("{"):
            break
    return out


def functions(text):
    lines = text.splitlines()
    start = re.compile(r"^(\s*)(pub(\([a-z]+\))? )?(const )?(async )?(unsafe )?fn (\w+)")
    for i, line in enumerate(lines):
        m = start.match(line)
        if not m:
            continue
        indent = m.group(1)
        for j in range(i, len(lines)):
            if lines[j] == indent + "}" or (j == i and line.rstrip().endswith("}")):
                yield m.group(7), j - i + 1
                break
            if lines[j].rstrip().endswith(";") and j == i:
                break


def main():
    rev = sys.argv[1] if len(sys.argv) > 1 else None
    files = files_at(rev)
    test_only = set()
    for text in files.values():
        ls = [l.strip() for l in text.splitlines()]
        for a, b in zip(ls, ls[1:]):
            if a == "#[cfg(test)]" and b.startswith("mod ") and b.endswith(";"):
                test_only.add(b[4:-1])
    graph = defaultdict(set)
    for name, text in files.items():
        parts = Path(name).parts
        module = parts[1].removesuffix(".rs")
        if module in ("lib", "main", "bin") or Path(name).stem in test_only:
            continue
        code = "\n".join(without_tests(text))
        graph[module] |= {m for m in re.findall(r"crate::(\w+)", code) if m != module}
        graph[module] |= set()
    print(f"module graph at {rev or 'work tree'}:")
    for module in sorted(graph):
        print(f"  {module:<11} -> {' '.join(sorted(graph[module]))}")
    sizes = sorted(((len(t.splitlines()), n) for n, t in files.items()), reverse=True)[:5]
    print("largest files (lines):", ", ".join(f"{n} {s}" for s, n in sizes))
    fns = sorted(((length, f"{n}::{f}") for n, t in files.items() for f, length in functions(t)), reverse=True)[:5]
    print("longest functions (lines):", ", ".join(f"{name} {length}" for length, name in fns))


if __name__ == "__main__":
    main()
