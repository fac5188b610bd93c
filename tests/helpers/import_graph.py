"""The import graph of a source tree, read from its files (never imported), and the layout's rules.

Every `import` and `from ... import` statement counts, at module level or inside a function, class or
`try`, except those under `if TYPE_CHECKING:` (they never run), which are kept apart as type-only.
An edge goes to the most specific module the tree holds: `from cachefuse.metadata import scores` is an
edge to `cachefuse.metadata.scores`, `from cachefuse.metadata import open_metastore` one to
`cachefuse.metadata` (its `__init__.py`). Importing a submodule also runs its parent package's
`__init__.py`; that implicit step is not an edge (a package may import its own submodules).

The rules (docs/architecture.md, "What may import what") take the graph and return violations as
readable lines; an empty list means the rule holds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    source: str
    """The importing module, dotted (`cachefuse.vllm.worker_side`; a package is its `__init__`)."""
    target: str
    """The imported module: a module of the tree, or an outside one as written (`vllm.config`)."""
    lineno: int
    lazy: bool
    """Inside a function: runs when called, not on import."""
    type_only: bool
    """Under `if TYPE_CHECKING:`: never runs."""

    def __str__(self) -> str:
        kind = " (type-only)" if self.type_only else " (in a function)" if self.lazy else ""
        return f"{self.source}:{self.lineno} imports {self.target}{kind}"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `root/package`."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement with (lazy, type_only)."""

    def walk(node: ast.AST, lazy: bool, type_only: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, lazy, type_only
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
            else:
                inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                yield from walk(child, inner, type_only)

    yield from walk(tree, False, False)


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """A relative import's absolute name (`from . import x` inside `a.b` -> `a`)."""
    if level == 0:
        return name or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(root: Path, package: str = "cachefuse") -> dict[str, list[Edge]]:
    """Module -> its import edges, for every module of `root/package` (see the module docstring)."""
    modules = module_names(root, package)

    def resolve(dotted: str) -> str:
        while dotted and dotted not in modules and "." in dotted and dotted.split(".")[0] == package:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    graph: dict[str, list[Edge]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = []
        for stmt, lazy, type_only in _statements(tree):
            if isinstance(stmt, ast.Import):
                targets = [alias.name for alias in stmt.names]
            else:
                base = _absolute(module, is_package, stmt.level, stmt.module)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in stmt.names]
            for target in dict.fromkeys(targets):
                edges.append(Edge(module, resolve(target), stmt.lineno, lazy, type_only))
        graph[module] = edges
    return graph


def _runtime_edges(graph: dict[str, list[Edge]]) -> dict[str, set[str]]:
    return {m: {e.target for e in edges if not e.type_only and e.target in graph and e.target != m}
            for m, edges in graph.items()}


def _parents(module: str, graph: dict[str, list[Edge]]) -> set[str]:
    """The packages whose `__init__` importing `module` runs first (`a.b.c` -> `a`, `a.b`), where they import
    anything: such a package that imports its own modules is in a cycle with each of them."""
    parts = module.split(".")
    return {p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if graph.get(p)}


def _all_edges(graph: dict[str, list[Edge]]) -> dict[str, set[str]]:
    """Every edge a reader follows: runtime, lazy, type-only, and the implicit one to each parent package."""
    return {m: ({e.target for e in edges if e.target in graph} | _parents(m, graph)) - {m}
            for m, edges in graph.items()}


def cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted. Every kind of edge counts:
    lazy imports, imports under TYPE_CHECKING (a reader still goes round), and a module's implicit import of
    its parent packages' `__init__` (one that imports the package's own modules closes a cycle with them)."""
    adjacency = _all_edges(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(adjacency[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(adjacency):
        if node not in index:
            visit(node)
    return found


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_of_outside(graph: dict[str, list[Edge]], top: str, allowed: str) -> list[str]:
    """Imports of the outside package `top` (e.g. "vllm") by modules not under `allowed`, type-only included."""
    return [str(e) for m, edges in graph.items() if not _in(m, allowed)
            for e in edges if _in(e.target, top)]


def forbidden_edges(graph: dict[str, list[Edge]], source: str, target: str) -> list[str]:
    """Runtime imports of anything under `target` by anything under `source`."""
    return [str(e) for m, edges in graph.items() if _in(m, source)
            for e in edges if not e.type_only and _in(e.target, target)]


def loaded_on_import(graph: dict[str, list[Edge]], module: str) -> dict[str, list[str]]:
    """What importing `module` loads: every module reached through module-level (not lazy) imports,
    outside ones included, each with the chain of modules that leads to it."""
    chains: dict[str, list[str]] = {module: [module]}
    frontier = [module]
    while frontier:
        current = frontier.pop()
        for edge in graph.get(current, []):
            if edge.lazy or edge.type_only or edge.target in chains:
                continue
            chains[edge.target] = [*chains[current], edge.target]
            if edge.target in graph:
                frontier.append(edge.target)
    return chains


def heavy_on_import(graph: dict[str, list[Edge]], module: str, heavy: Iterable[str]) -> list[str]:
    """The chains by which importing `module` would load a package of `heavy` (e.g. torch)."""
    heavy = tuple(heavy)
    return [" -> ".join(chain) for target, chain in sorted(loaded_on_import(graph, module).items())
            if any(_in(target, h) for h in heavy)]
