"""No two modules of worker/ (or of bench/) import each other, directly or around a loop.

The imports are read from the source with `ast`, wherever they stand: at module level, inside functions and
methods, under `try:` or `if`. An import inside a function is the usual way to hide a cycle (it runs late enough
not to fail), so it counts like any other. Imports under `if TYPE_CHECKING:` count too: they never run, but a
module whose signatures name another's types depends on it as much as one that calls it, and a type-only import
is the other usual way to hide a cycle. An import names the module it loads: `from a import b` is an arrow to a.b
when that is a module, else to a; the parent packages Python initialises on the way are not arrows (a package's
__init__ only hands names on). Not followed: imports by a name known at run time (`importlib.import_module`),
which load the user's model factories, never a module of this tree.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, order=True)
class Edge:
    importer: str
    imported: str
    where: str  # path:line of the import statement


def module_names(base: Path, as_package: bool) -> dict[str, Path]:
    """Every module under `base` by the name it is imported as: worker/ is the package `worker` (worker.tools.demo);
    the bench/ scripts put bench/ on sys.path and import each other by file name (`import common`)."""
    names: dict[str, Path] = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(base.parent if as_package else base).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_names(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
                   modules: Collection[str]) -> Iterator[str]:
    """The modules one import statement loads, by dotted name."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: counted from the importer's package
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
    for alias in node.names:
        submodule = f"{base}.{alias.name}" if base else alias.name
        yield submodule if submodule in modules else base


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """importer -> imported for every import of one of `modules` by another."""
    edges: set[Edge] = set()
    for importer, path in modules.items():
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in imported_names(node, importer, path.name == "__init__.py", modules):
                    if name in modules and name != importer:
                        edges.add(Edge(importer, name, f"{shown}:{node.lineno}"))
    return sorted(edges)


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Loops of imports, as the imports that make each: for every group of modules that reach each other
    (Tarjan's strongly connected components), the shortest loops that together pass through all of them."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, []).append(edge)
        graph.setdefault(edge.imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.imported not in index:
                visit(edge.imported)
                low[node] = min(low[node], low[edge.imported])
            elif edge.imported in on_stack:
                low[node] = min(low[node], index[edge.imported])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    loops = []
    for component in components:  # a loop through each module of the group, so every one is named
        covered: set[str] = set()
        for member in sorted(component):
            if member not in covered:
                loops.append(_shortest_loop(member, component, graph))
                covered.update(edge.importer for edge in loops[-1])
    return loops


def _shortest_loop(start: str, component: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """The shortest loop of imports from `start` back to it (breadth first, inside its component)."""
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge.imported == start:
                    loop = [edge]
                    while loop[0].importer != start:
                        loop.insert(0, came_by[loop[0].importer])
                    return loop
                if edge.imported in component and edge.imported not in came_by:
                    came_by[edge.imported] = edge
                    following.append(edge.imported)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component but on no loop")


def describe(loop: list[Edge]) -> str:
    return " -> ".join([loop[0].importer, *(e.imported for e in loop)]) + "".join(
        f"\n    {e.importer} imports {e.imported} at {e.where}" for e in loop)


TREES = {"worker": True, "bench": False}  # the tree, and whether it is imported as a package


@pytest.mark.parametrize("tree", [
    "worker",
    "bench",
])
def test_no_module_imports_itself_around_a_loop(tree: str) -> None:
    found = cycles(import_edges(module_names(ROOT / tree, as_package=TREES[tree])))
    assert not found, f"import cycles in {tree}/:\n" + "\n".join(describe(loop) for loop in found)


def imports_of_tests(base: Path) -> list[str]:
    """Every import of the tests/ tree under `base`, wherever it stands, as "path:line module"."""
    found = []
    for path in sorted(base.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(base.parent)}:{node.lineno} {name}" for name in names
                      if name == "tests" or name.startswith("tests.")]
    return found


@pytest.mark.parametrize("tree", ["worker", "bench"])
def test_nothing_the_worker_or_the_benchmarks_run_imports_the_tests(tree: str) -> None:
    """What a benchmark measures or a user installs is built on worker/ (its kit: worker.testing), never on
    the tests' own helpers."""
    assert imports_of_tests(ROOT / tree) == []


def test_an_import_of_the_tests_is_found_wherever_it_stands(tmp_path: Path) -> None:
    scripts = _write(tmp_path, {"a.py": "import os\ndef late():\n    from tests.unit import helpers\n",
                                "b.py": "import tests.pixels as p\nfrom .tests import x\nimport testsuite\n"})
    found = [line.split(" ", 1)[1] for line in imports_of_tests(scripts)]
    assert found == ["tests.unit", "tests.pixels"]


# -- the walker itself ------------------------------------------------------------------------------------------
def _write(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(textwrap.dedent(text))
    return base


def test_a_cycle_hidden_inside_a_function_is_found_and_named(tmp_path: Path) -> None:
    scripts = _write(tmp_path, {"a.py": "import b\n", "b.py": "def late():\n    from a import thing\n",
                                "c.py": "import a\nimport b\n"})
    (loop,) = cycles(import_edges(module_names(scripts, as_package=False)))
    assert [(e.importer, e.imported, e.where.rsplit("/", 1)[-1]) for e in loop] == [("a", "b", "a.py:1"),
                                                                                    ("b", "a", "b.py:2")]
    assert describe(loop).startswith("a -> b -> a\n")


def test_a_type_checking_import_counts(tmp_path: Path) -> None:
    scripts = _write(tmp_path, {"a.py": "import b\n", "b.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from a import Thing
        """})
    assert len(cycles(import_edges(module_names(scripts, as_package=False)))) == 1


def test_relative_imports_name_the_module_they_load(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {"pkg/__init__.py": "from pkg.x import X\n", "pkg/x.py": "from . import y\n",
                            "pkg/y.py": "from .sub.w import W\n", "pkg/sub/__init__.py": "from . import w\n",
                            "pkg/sub/w.py": "from ..x import X\n"})
    edges = {(e.importer, e.imported) for e in import_edges(module_names(pkg / "pkg", as_package=True))}
    assert edges == {("pkg", "pkg.x"), ("pkg.x", "pkg.y"), ("pkg.y", "pkg.sub.w"), ("pkg.sub", "pkg.sub.w"),
                     ("pkg.sub.w", "pkg.x")}


def test_every_module_of_a_group_is_named() -> None:
    edges = [Edge("a", "b", "a.py:1"), Edge("b", "a", "b.py:1"), Edge("b", "c", "b.py:2"), Edge("c", "b", "c.py:1")]
    assert {e.importer for loop in cycles(edges) for e in loop} == {"a", "b", "c"}


def test_a_chain_and_a_diamond_are_no_cycle() -> None:
    assert cycles([Edge("a", "b", "a.py:1"), Edge("b", "c", "b.py:1"), Edge("a", "c", "a.py:2")]) == []


def test_the_worker_walk_reads_imports_in_functions_and_type_checking_blocks() -> None:
    edges = {(e.importer, e.imported) for e in import_edges(module_names(ROOT / "worker", as_package=True))}
    assert ("worker.cli", "worker.app") in edges  # inside cmd_run
    assert ("worker.testing.kafka", "worker.frames") in edges  # under `if TYPE_CHECKING:`
    assert ("worker.runtime", "worker.runtime.executor") in edges  # a package's __init__
