"""The import graph of the installed package (qla_serving, qla_serving.kernels from kernels/,
qla_serving.integrations from integrations/), read from the source with ast: every import
statement counts, module-level and deferred (inside a function) alike, since a deferred import
is still a dependency a reader has to follow.

    python scripts/import_graph.py           # edges, then cycles; exit 1 if there is one
    python scripts/import_graph.py --dot     # the graph in Graphviz form

Only edges between the package's own modules are kept; engines, torch and TileLang are not.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# package name -> source folder, as pyproject's package-dir installs them
PACKAGE_DIRS = {
    "qla_serving": ROOT / "qla_serving",
    "qla_serving.kernels": ROOT / "kernels",
    "qla_serving.integrations": ROOT / "integrations",
}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p in ("shipped", "__pycache__") for p in parts):
                continue
            found[".".join([package, *parts])] = path
    return found


def _resolve(name: str, mods: dict[str, pathlib.Path]) -> str | None:
    """The longest prefix of a dotted name that is one of the package's modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in mods:
            return candidate
    return None


def edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_resolve(alias.name, mods) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    drop = node.level - 1 if is_package else node.level
                    base = base[: len(base) - drop] if drop else base
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import sub` imports the submodule where there is one, else pkg itself
                targets = [_resolve(f"{prefix}.{alias.name}", mods) for alias in node.names]
            for target in targets:
                if target and target != module:
                    graph[module].add(target)
    # a module importing its own parent package (running the __init__) is no layer crossing
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="print the graph in Graphviz form")
    args = parser.parse_args(argv)
    mods = modules()
    graph = edges(mods)
    if args.dot:
        print("digraph imports {")
        for src in sorted(graph):
            for dst in sorted(graph[src]):
                print(f'  "{src}" -> "{dst}";')
        print("}")
        return 0
    for src in sorted(graph):
        if graph[src]:
            print(f"{src} -> {', '.join(sorted(graph[src]))}")
    found = cycles(graph)
    n_edges = sum(len(v) for v in graph.values())
    print(f"\n{len(graph)} modules, {n_edges} edges, {len(found)} cycle(s)")
    for component in found:
        print("cycle: " + " <-> ".join(component))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
