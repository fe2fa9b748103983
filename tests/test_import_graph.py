"""The package's modules import each other without a cycle, counting every import statement.

Read from the source with ``ast`` (nothing is imported): top-level imports, imports inside functions and
imports under ``if TYPE_CHECKING:`` all count, since each is a dependency of one module on another that
a reader (and a refactoring) has to follow. An edge goes to the module an import names: ``from
evictlayers.a import b`` to ``evictlayers.a.b`` where ``b`` is a submodule, else to ``evictlayers.a``
(its ``__init__``). Importing a submodule also runs its package's ``__init__``, but that implicit edge is
not counted: every package's ``__init__`` imports its own submodules, so it would make every package a
cycle.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PACKAGE = "evictlayers"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent / PACKAGE

Edges = dict[str, dict[str, int]]  # importer -> {imported module: line of its first import there}


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> source file of every module under ``root`` (a package's ``__init__.py`` is the package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ``modules`` (``None``: outside them)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement in ``module`` names: each ``import a.b``; for ``from a import b, c``
    the module ``a`` first, then ``a.b`` and ``a.c`` (resolved against the modules by the caller)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: one dot is the importer's package, each further dot one package up
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]


def import_graph(root: Path, package: str) -> Edges:
    """Every module's imports of the package's modules, from its whole syntax tree."""
    modules = module_names(root, package)
    edges: Edges = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            named = _imported(node, name, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                # ``from a import b``: the submodule a.b where b is one, else the module a
                submodules = [n for n in named[1:] if _resolve(n, modules) == n]
                targets = submodules
                if len(submodules) < len(named) - 1:  # some name is the module's own: an edge to it too
                    targets = [*submodules, _resolve(named[0], modules)]
            else:
                targets = [_resolve(n, modules) for n in named]
            for target in targets:
                if target is not None and target != name:
                    edges[name][target] = min(edges[name].get(target, node.lineno), node.lineno)
    return edges


def strongly_connected(edges: Edges) -> list[list[str]]:
    """The strongly connected components of the graph (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = lowlink[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(edges[successor])))
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    lowlink[parent] = min(lowlink[parent], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def shortest_cycle(edges: Edges, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as ``[m0, m1, ..., m0]`` (breadth first,
    inside the component)."""
    members, start = set(component), component[0]
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in edges[node]:
            if successor not in members:
                continue
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if successor not in previous:
                previous[successor] = node
                queue.append(successor)
    raise AssertionError(f"no cycle through {start} in {component}")


def describe_cycles(edges: Edges) -> list[str]:
    """One line per import cycle: the modules of each component of several, and a shortest cycle through
    them, each import with its line."""
    lines = []
    for component in strongly_connected(edges):
        if len(component) < 2:
            continue
        cycle = shortest_cycle(edges, component)
        steps = " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:]))
        lines.append(f"{{{', '.join(component)}}}: {steps} -> {cycle[0]}")
    return lines


def test_the_package_has_no_import_cycle():
    edges = import_graph(PACKAGE_ROOT, PACKAGE)
    assert len(edges) > 50 and f"{PACKAGE}.compose.store" in edges  # the walk found the package
    cycles = describe_cycles(edges)
    assert not cycles, "import cycles (importer (line of the import) -> imported):\n" + "\n".join(cycles)


def test_every_kind_of_import_is_an_edge(tmp_path):
    """The walk counts imports in functions and under TYPE_CHECKING, relative imports, and ``from p import
    m`` as an edge to the submodule ``m``; a cycle through them is reported."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from pkg.sub import deep\n",
        "top.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.sub import deep\n",
        "sub/__init__.py": "",
        "sub/deep.py": "def late():\n    from .. import lazy\n",
        "lazy.py": "import pkg.top as top\n",
        "alone.py": "import os\nfrom pkg import sub\nfrom pkg.sub import deep, NAME\n",
    }
    for name, source in sources.items():
        (package / name).write_text(source)
    edges = import_graph(package, "pkg")
    assert edges["pkg"] == {"pkg.sub.deep": 1}
    assert edges["pkg.alone"] == {"pkg.sub": 2, "pkg.sub.deep": 3}  # NAME is no submodule: pkg.sub's __init__
    assert edges["pkg.sub.deep"] == {"pkg.lazy": 2}
    assert describe_cycles(edges) == [
        "{pkg.lazy, pkg.sub.deep, pkg.top}: pkg.lazy (line 1) -> pkg.top (line 4) -> pkg.sub.deep (line 2) -> pkg.lazy"
    ]
