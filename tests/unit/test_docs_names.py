"""Every module, folder and type that docs/architecture.md and the package docstrings name exists.

A newcomer reads these first; a name that was renamed or moved away sends them looking for nothing. The test reads
each name in backquotes and checks it against the tree: a path (`loop/pipeline.py`, `runtime/`), a dotted name
(`worker.devices.graphplan.GraphPlan`), a type or its member (`FrameSource.poll`), a module's name
(`graphplan.BatchCaps`), and each `- \\`module\\`:` entry of a package's docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

from worker.config import Settings

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"
TOP = ("worker", "bench", "tests", "deploy", "docs", "schemas")
# Named in the docs but defined outside the project: confluent-kafka's error class.
EXTERNAL = {"KafkaError"}
CAMEL = re.compile(r"^([A-Z][a-z0-9]+[A-Za-z0-9]*)(?:\.([a-z_][a-z0-9_]*))?(?:\(.*\))?$")
MODULE_NAME = re.compile(r"^([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\(.*\))?$")


@cache
def _tree_files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for top in TOP
            for p in (ROOT / top).rglob("*") if "__pycache__" not in p.parts]


@cache
def _definitions() -> dict[str, dict[str, set[str]]]:
    """Per top-level name defined anywhere in worker/: the names defined inside it (methods, fields, attributes)."""
    found: dict[str, dict[str, set[str]]] = defaultdict(dict)
    for path in WORKER.rglob("*.py"):
        module = ast.parse(path.read_text())
        for node in module.body:
            for name, members in _defined(node):
                found[name].setdefault(path.stem, set()).update(members)
    return found


def _defined(node: ast.stmt) -> list[tuple[str, set[str]]]:
    if isinstance(node, ast.ClassDef):
        members: set[str] = set()
        for item in ast.walk(node):
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                members.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                members.add(item.target.id)
            elif isinstance(item, ast.Assign | ast.AnnAssign):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                for target in targets:
                    if isinstance(target, ast.Attribute):
                        members.add(target.attr)
                    elif isinstance(target, ast.Name):
                        members.add(target.id)
        return [(node.name, members)]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [(node.name, set())]
    if isinstance(node, ast.Assign):
        names = [(t.id, set[str]()) for t in node.targets if isinstance(t, ast.Name)]
        # A constant's value may be a name the docs use too: a dead letter's `error_type` such as `ModelError`.
        value = node.value.value if isinstance(node.value, ast.Constant) else None
        if isinstance(value, str) and value.isidentifier():
            names.append((value, set()))
        return names
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [(node.target.id, set())]
    if isinstance(node, ast.ImportFrom):
        return []
    return []


@cache
def _setting_paths() -> set[str]:
    paths: set[str] = set()
    for section in dataclasses.fields(Settings):
        default = section.default_factory() if section.default_factory is not dataclasses.MISSING else None
        paths.add(section.name)
        if dataclasses.is_dataclass(default):
            for field in dataclasses.fields(default):
                paths.add(f"{section.name}.{field.name}")
    return paths


def _module_stems() -> set[str]:
    return {p.stem for p in WORKER.rglob("*.py")} | {p.name for p in WORKER.rglob("*") if p.is_dir()}


def problem_with(name: str) -> str | None:
    """Why a name in backquotes names nothing in the tree, or None when it does (or is not a code name)."""
    bare = name.split("(")[0].strip()
    if " " in bare or not bare:
        return None
    if bare.endswith(".py") or (bare.endswith("/") and "/" not in bare[:-1] and bare[:-1].isidentifier()):
        suffix = bare.rstrip("/")
        hits = [f for f in (*_tree_files(), *TOP) if f == suffix or f.endswith("/" + suffix)]
        return None if hits else f"`{name}`: no file or folder of that name"
    if bare.startswith("worker."):
        return _dotted_problem(bare)
    if camel := CAMEL.match(bare):
        return _type_problem(name, camel.group(1), camel.group(2))
    if (match := MODULE_NAME.match(bare)) and match.group(1) in _module_stems() and bare not in _setting_paths():
        return _module_attr_problem(name, match.group(1), match.group(2))
    return None


def _dotted_problem(dotted: str) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"`{dotted}`: {'.'.join(parts[:i])} has no `{attr}`"
            obj = getattr(obj, attr)
        return None
    return f"`{dotted}`: no such module"


def _type_problem(name: str, type_name: str, member: str | None) -> str | None:
    if type_name in EXTERNAL:
        return None
    where = _definitions().get(type_name)
    if not where:
        return f"`{name}`: no class, function or constant `{type_name}` in worker/"
    if member and not any(member in members for members in where.values()):
        return f"`{name}`: `{type_name}` has no `{member}`"
    return None


def _module_attr_problem(name: str, module: str, attr: str) -> str | None:
    """`module.attr`: a name the module defines, or a member of one of its classes (`delivery.commit`: the object)."""
    if (WORKER / module).is_dir():
        return None if _dotted_problem(f"worker.{module}.{attr}") is None else f"`{name}`: no `{attr}` in {module}/"
    if module in _definitions().get(attr, {}):
        return None
    if any(attr in members for where in _definitions().values() for stem, members in where.items() if stem == module):
        return None
    return f"`{name}`: no module `{module}` in worker/ defines `{attr}`"


def _backquoted(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def test_architecture_names_only_what_exists() -> None:
    names = _backquoted((ROOT / "docs" / "architecture.md").read_text())
    problems = sorted({p for n in names if (p := problem_with(n))})
    assert problems == [], "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


PACKAGES = sorted(p.parent for p in WORKER.rglob("__init__.py"))


@pytest.mark.parametrize("init", PACKAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_package_docstring_names_only_what_exists(init: Path) -> None:
    doc = ast.get_docstring(ast.parse((init / "__init__.py").read_text())) or ""
    problems = {p for n in _backquoted(doc) if (p := problem_with(n))}
    # `- \`module\`: ...` entries list the package's own modules.
    for entry in re.findall(r"^\s*- `([a-z_][a-z0-9_]*)`:", doc, flags=re.M):
        if not ((init / f"{entry}.py").exists() or (init / entry).is_dir()):
            problems.add(f"`{entry}`: listed as a module of {init.relative_to(ROOT)} but no such module")
    assert sorted(problems) == [], f"{init.relative_to(ROOT)}'s docstring names what does not exist:\n" + "\n".join(
        sorted(problems))


@pytest.mark.parametrize("name, problem", [
    ("worker/loop/pipeline.py", False), ("priority_reading.py", True), ("runtime/", False), ("nowhere/", True),
    ("worker.devices.graphplan.GraphPlan", False), ("worker.graphplan", True), ("FrameSource.poll", False),
    ("FrameSource.no_such_method", True), ("Committer", True), ("graphplan.BatchCaps", False),
    ("graphplan.NoSuchThing", True), ("delivery.max_uncommitted_frames", False), ("max_wait_ms", False),
])
def test_the_check_itself_tells_a_missing_name(name: str, problem: bool) -> None:
    assert (problem_with(name) is not None) is problem, problem_with(name)
