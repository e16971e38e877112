#!/usr/bin/env python3
"""Checks that the pipeline crate's top-level modules depend on each other one way.

Every `crate::<module>` path in src/ (outside comments) is an edge from the module of the file
it appears in to <module>. The check fails when an edge points up the declared flow (a module
importing from one downstream of it) or when the modules form a cycle, and prints the edges
either way. The flow below is the one ARCHITECTURE.md draws; a new module must be added to it.

Usage: python3 scripts/check_module_dag.py [SRC_DIR]   (default: src)
"""
import pathlib
import re
import sys

# Bottom to top. A module may import only from modules of a strictly lower rank.
FLOW = [
    ["error", "isa", "reuse"],
    ["fields"],
    ["spec"],
    ["input"],
    ["key", "gain"],
    ["extracted"],
    ["extract"],
    ["group"],
    ["fill"],
    ["stats"],
    ["output"],
    ["allreduce"],
    ["preprocess"],
    ["io"],
    ["fdo", "balance"],
]
RANK = {m: r for r, ms in enumerate(FLOW) for m in ms}
PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)")


def module_of(src: pathlib.Path, path: pathlib.Path) -> str:
    rel = path.relative_to(src)
    return rel.parts[0].removesuffix(".rs")


def code_lines(text: str):
    """(line number, code) of every line that is not a comment, numbered as in the file."""
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if stripped.startswith("//"):
            continue
        # A trailing comment cannot hold an import that matters.
        yield n, (line.split("//", 1)[0] if "//" in line and '"' not in line else line)


def main() -> int:
    src = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src")
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(src.rglob("*.rs")):
        if path.name in ("lib.rs", "main.rs") and path.parent == src:
            continue  # the crate root only declares modules and re-exports
        module = module_of(src, path)
        for n, line in code_lines(path.read_text()):
            for target in PATH.findall(line):
                if target != module:
                    edges.setdefault((module, target), f"{path}:{n}")
    problems = []
    modules = {m for e in edges for m in e}
    for m in sorted(modules - RANK.keys()):
        problems.append(f"module `{m}` is not in the declared flow of {sys.argv[0]}")
    for (a, b), where in sorted(edges.items()):
        if a in RANK and b in RANK and RANK[b] >= RANK[a]:
            problems.append(f"`{a}` imports `{b}`, which is not below it in the flow ({where})")
    # Cycles (possible only through undeclared modules once the ranks hold, but checked anyway).
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                problems.append("cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    for a in sorted(graph, key=lambda m: (RANK.get(m, -1), m)):
        print(f"{a:>11} -> {', '.join(sorted(graph[a], key=lambda m: (RANK.get(m, -1), m)))}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"module flow: {len(modules)} modules, {len(edges)} edges, one way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
