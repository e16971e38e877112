#!/usr/bin/env python3
"""Checks that the source files of every crate depend on each other one way.

Each crate's module tree is read from its root file (`lib.rs`, `main.rs`, `bin/*.rs`) through
its `mod` declarations. A path in a file that names another file's module is an edge from the
first file to the second: `crate::a::b`, `super::x`, `self::x` and paths that start with a
child module's name, in `use` declarations and in code alike (a macro's `$crate::` counts as
`crate::`, a `#[macro_export]` macro as an item of the file that defines it). A path is followed
through the imports it passes (`crate::Name`, re-exported by the crate root from `a`, is an edge
to `a`'s file) and ends at the file of the last module it names.

Declaring a module (`mod a;`) is not an edge, nor is a module's re-export of its own
submodules' items (`pub use a::X;` where the module's own code does not use `X`): that is the
module's public face, and paths through it are followed to `a`. A file using its parent
module's items while the parent's own code uses the file is a circle like any other.

The check fails on any circle of files within a crate. Test code (`#[cfg(test)]` modules) is
left out: a test may drive the whole crate, it is not part of the flow. In the pipeline crate
it also fails when a top-level module imports from one that is not below it in the declared
flow (the ranks ARCHITECTURE.md draws; a new top-level module must be added to FLOW). It prints
every crate's file edges, the pipeline's module flow and a summary.

Usage: python3 scripts/check_module_dag.py [SRC_DIR ...]
(default: every crate of the repository: src, crates/*/src, python/src)
"""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The pipeline crate's top-level modules, bottom to top. A module may import only from modules
# of a strictly lower rank.
FLOW = [
    ["error", "isa", "reuse", "parallel"],
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
FLOW_SRC = ROOT / "src"

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
MOD_DECL = re.compile(
    r"((?:#\s*\[[^\]]*\]\s*)*)(?:pub\s*(?:\([^)]*\))?\s*)?\bmod\s+(" + IDENT + r")\s*([;{])"
)
USE_DECL = re.compile(
    r"(\bpub\s*(?:\([^)]*\))?\s*)?\buse\s+([^;{}]*(?:\{[^;]*\})?[^;{}]*);"
)
PATH = re.compile(
    r"(?<![A-Za-z0-9_:])(\$crate|" + IDENT + r")((?:\s*::\s*(?:" + IDENT + r"))+)"
)
MACRO_EXPORT = re.compile(r"#\s*\[\s*macro_export\s*\]\s*macro_rules!\s*(" + IDENT + ")")
CFG_TEST = re.compile(r"\bcfg\s*\(\s*(?:all\s*\(\s*)?test\b")
CHAR = re.compile(r"'(?:\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'")
RAW_STR = re.compile(r'b?r(#*)"')


def code_of(text: str) -> str:
    """`text` with its comments and the insides of its string and char literals blanked
    (newlines kept, so that offsets and line numbers stay those of the file)."""
    out = list(text)
    n = len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    i = 0
    while i < n:
        c = text[i]
        prev = text[i - 1] if i else " "
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c in "rb" and not (prev.isalnum() or prev == "_") and RAW_STR.match(text, i):
            m = RAW_STR.match(text, i)
            end = text.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            blank(i, end)
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            m = CHAR.match(text, i)
            if m:
                blank(i, m.end())
                i = m.end()
            else:
                i += 1  # a lifetime or a label
        else:
            i += 1
    return "".join(out)


def matching_brace(code: str, at: int) -> int:
    """The offset just past the `}` that closes the `{` at `at`."""
    depth = 0
    for k in range(at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return len(code)


def flatten_use(tree: str) -> list[tuple[list[str], str | None]]:
    """The paths of a use tree, each with the name it binds (None for a glob)."""
    tree = re.sub(r"\s+", " ", tree).strip()
    out: list[tuple[list[str], str | None]] = []

    def split_top(s: str) -> list[str]:
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        return [p.strip() for p in parts if p.strip()]

    def walk(prefix: list[str], t: str) -> None:
        t = t.strip()
        brace = t.find("{")
        if brace >= 0:
            head = [s.strip() for s in t[:brace].split("::") if s.strip()]
            inner = t[brace + 1 : t.rfind("}")]
            for part in split_top(inner):
                walk(prefix + head, part)
            return
        alias = None
        m = re.fullmatch(r"(.*?)\s+as\s+(" + IDENT + ")", t)
        if m:
            t, alias = m.group(1), m.group(2)
        segs = [s.strip() for s in t.split("::") if s.strip()]
        if segs == ["self"]:
            segs = []
        path = prefix + segs
        if not path:
            return
        if path[-1] == "*":
            out.append((path[:-1], None))
        else:
            out.append((path, alias or path[-1]))

    if tree.startswith("::"):
        return []  # an extern crate's path
    walk([], tree)
    return out


class Crate:
    """One crate root's module tree, its files, imports and the paths in its code."""

    def __init__(self, root_file: pathlib.Path):
        self.root_file = root_file
        self.children: dict[tuple, set[str]] = {}  # module -> its child modules
        self.file_of: dict[tuple, pathlib.Path] = {}  # module -> the file that holds it
        self.imports: dict[tuple, dict[str, list[str] | None]] = {}  # module -> name -> path
        self.defined_at: dict[str, tuple] = {}  # exported macro -> its module
        # (file, line, module the path is written in, path)
        self.paths: list[tuple[pathlib.Path, int, tuple, list[str]]] = []
        # `pub use` items, each with whether the file's own code names what it imports.
        self.reexports: list[tuple[tuple[pathlib.Path, int, tuple, list[str]], bool]] = []
        self.module_of: dict[pathlib.Path, tuple] = {}  # file -> the module it holds
        self.load(root_file, (), root_file.parent)

    def load(self, path: pathlib.Path, module: tuple, mod_dir: pathlib.Path) -> None:
        """Reads the file `path`, which holds `module` and whose `mod x;` are in `mod_dir`."""
        self.module_of[path] = module
        code = code_of(path.read_text())
        line_at = [0]
        for ch in code:
            line_at.append(line_at[-1] + (ch == "\n"))
        # Regions of inline modules: (start, end, module, directory for its `mod x;`).
        regions = [(0, len(code), module, mod_dir, False)]
        pending = []  # file modules: (module, directory)
        for m in MOD_DECL.finditer(code):
            attrs, name, kind = m.group(1), m.group(2), m.group(3)
            start = m.start(2)
            outer = max((r for r in regions if r[0] <= start < r[1]), key=lambda r: r[0])
            if outer[4]:
                continue  # inside test code
            test = bool(CFG_TEST.search(attrs))
            child = outer[2] + (name,)
            if test:
                if kind == "{":
                    regions.append((m.end() - 1, matching_brace(code, m.end() - 1), child,
                                    outer[3] / name, True))
                continue
            self.children.setdefault(outer[2], set()).add(name)
            if kind == "{":
                self.file_of[child] = path
                regions.append((m.end() - 1, matching_brace(code, m.end() - 1), child,
                                outer[3] / name, False))
            elif child not in self.file_of:
                d = outer[3]
                f = d / f"{name}.rs"
                if not f.exists():
                    f = d / name / "mod.rs"
                self.file_of[child] = f
                pending.append((child, f, d / name))
        self.file_of.setdefault(module, path)

        def region_at(pos: int):
            return max((r for r in regions if r[0] <= pos < r[1]), key=lambda r: r[0])

        for m in MACRO_EXPORT.finditer(code):
            r = region_at(m.start())
            if not r[4]:
                self.defined_at[m.group(1)] = r[2]
        uses, reexports = [], []
        for m in USE_DECL.finditer(code):
            r = region_at(m.start())
            if r[4]:
                continue
            uses.append((m.start(), m.end()))
            for segs, name in flatten_use(m.group(2)):
                if name is not None:
                    self.imports.setdefault(r[2], {})[name] = segs
                item = (path, line_at[m.start()] + 1, r[2], segs)
                if m.group(1):
                    reexports.append((item, name))
                else:
                    self.paths.append(item)
        in_code = set()  # names the file's code (outside `use` and tests) mentions
        for m in re.finditer(IDENT, code):
            r = region_at(m.start())
            if not r[4] and not any(a <= m.start() < b for a, b in uses):
                in_code.add(m.group(0))
        self.reexports += [(item, name is None or name in in_code) for item, name in reexports]
        for m in PATH.finditer(code):
            if any(a <= m.start() < b for a, b in uses):
                continue
            r = region_at(m.start())
            if r[4]:
                continue
            segs = [m.group(1)] + [s.strip() for s in m.group(2).split("::") if s.strip()]
            self.paths.append((path, line_at[m.start()] + 1, r[2], segs))
        for child, f, d in pending:
            self.load(f, child, d)

    def resolve(self, at: tuple, segs: list[str], depth: int = 0) -> tuple | None:
        """The module a path written in module `at` ends in, or None if it leaves the crate
        (or names nothing the crate declares)."""
        if depth > 32 or not segs:
            return None
        head, rest = segs[0], segs[1:]
        if head in ("crate", "$crate"):
            base = ()
        elif head == "self":
            base = at
        elif head == "super":
            base = at[:-1]
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
        elif head in self.children.get(at, ()):
            base, rest = at + (head,), rest
        elif head in self.imports.get(at, {}) and self.imports[at][head] != segs:
            target = self.imports[at][head]
            return self.resolve(at, target + rest, depth + 1) if target else None
        else:
            return None
        while rest and rest[0] in self.children.get(base, ()):
            base, rest = base + (rest[0],), rest[1:]
        if rest:
            imported = self.imports.get(base, {}).get(rest[0])
            if imported and imported[0] != rest[0]:
                found = self.resolve(base, imported + rest[1:], depth + 1)
                if found is not None:
                    return found
            if base == () and rest[0] in self.defined_at:
                return self.defined_at[rest[0]]
        return base

    def edges(self) -> dict[tuple[pathlib.Path, pathlib.Path], str]:
        out: dict[tuple[pathlib.Path, pathlib.Path], str] = {}
        items = [(item, True) for item in self.paths] + self.reexports
        for (path, line, at, segs), used in items:
            target = self.resolve(at, segs)
            if target is None:
                continue
            if not used and len(target) > len(at) and target[: len(at)] == at:
                continue  # a re-export of a submodule's item, the module's public face
            to = self.file_of.get(target)
            if to is not None and to != path:
                out.setdefault((path, to), f"{rel(path)}:{line}")
        return out


def rel(p: pathlib.Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def cycles(graph: dict) -> list[tuple[list, list]]:
    """Each set of mutually dependent nodes (a strongly connected component of more than one
    node), with one shortest cycle through it (its nodes, the first repeated last)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    components: list[list] = []

    def strong(v) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ()), key=str):
            if w not in index:
                strong(w)
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
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph, key=str):
        if v not in index:
            strong(v)
    found = []
    for comp in components:
        members = set(comp)
        start = min(comp, key=str)
        # Breadth first from `start`, within the component, back to `start`.
        prev = {start: None}
        queue = [start]
        end = None
        while queue and end is None:
            v = queue.pop(0)
            for w in sorted(graph.get(v, ()), key=str):
                if w == start:
                    end = v
                    break
                if w in members and w not in prev:
                    prev[w] = v
                    queue.append(w)
        walk = []
        while end is not None:
            walk.append(end)
            end = prev[end]
        found.append((sorted(comp, key=str), walk[::-1] + [start]))
    return found


def check_src(src: pathlib.Path) -> tuple[list[str], int, int]:
    """Problems, files and edges of the crates whose roots are in `src`."""
    problems: list[str] = []
    n_files = n_edges = 0
    roots = [src / f for f in ("lib.rs", "main.rs") if (src / f).exists()]
    roots += sorted((src / "bin").glob("*.rs")) if (src / "bin").is_dir() else []
    if not roots:
        return [f"{rel(src)}: no lib.rs or main.rs"], 0, 0
    for root in roots:
        crate = Crate(root)
        edges = crate.edges()
        n_files += len(crate.module_of)
        n_edges += len(edges)
        graph: dict[pathlib.Path, set[pathlib.Path]] = {}
        for a, b in edges:
            graph.setdefault(a, set()).add(b)
        print(f"{rel(root)}: {len(crate.module_of)} files, {len(edges)} edges")
        base = root.parent
        for a in sorted(graph):
            targets = ", ".join(sorted(str(b.relative_to(base)) for b in graph[a]))
            print(f"  {str(a.relative_to(base)):>22} -> {targets}")
        for members, cycle in cycles(graph):
            where = [edges[(a, b)] for a, b in zip(cycle, cycle[1:])]
            problems.append(
                f"import circle among {', '.join(rel(f) for f in members)}: "
                + " -> ".join(rel(f) for f in cycle)
                + f" ({', '.join(where)})"
            )
        if src.resolve() == FLOW_SRC and root.name == "lib.rs":
            problems += check_flow(crate, edges)
    return problems, n_files, n_edges


def check_flow(crate: Crate, edges: dict) -> list[str]:
    """The pipeline crate's top-level modules against FLOW; prints their edges."""
    top = {f: m[0] for f, m in crate.module_of.items() if m}
    top_edges: dict[tuple[str, str], str] = {}
    for (a, b), where in edges.items():
        if a in top and b in top and top[a] != top[b]:
            top_edges.setdefault((top[a], top[b]), where)
    problems = []
    for m in sorted(set(top.values()) - RANK.keys()):
        problems.append(f"module `{m}` is not in the declared flow of {sys.argv[0]}")
    for (a, b), where in sorted(top_edges.items()):
        if a in RANK and b in RANK and RANK[b] >= RANK[a]:
            problems.append(f"`{a}` imports `{b}`, which is not below it in the flow ({where})")
    graph: dict[str, set[str]] = {}
    for a, b in top_edges:
        graph.setdefault(a, set()).add(b)
    print("  module flow:")
    for a in sorted(graph, key=lambda m: (RANK.get(m, -1), m)):
        order = sorted(graph[a], key=lambda m: (RANK.get(m, -1), m))
        print(f"  {a:>11} -> {', '.join(order)}")
    for _, cycle in cycles(graph):
        problems.append("module cycle: " + " -> ".join(cycle))
    return problems


def main() -> int:
    if len(sys.argv) > 1:
        srcs = [pathlib.Path(a) for a in sys.argv[1:]]
    else:
        srcs = [ROOT / "src", *sorted(ROOT.glob("crates/*/src")), ROOT / "python" / "src"]
    problems: list[str] = []
    files = edges = 0
    for src in srcs:
        p, f, e = check_src(src)
        problems += p
        files += f
        edges += e
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"module flow: {len(srcs)} crates, {files} files, {edges} edges, one way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
