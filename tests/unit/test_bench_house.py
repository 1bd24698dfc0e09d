"""bench/ as a whole: no import cycle between its modules (imports inside functions included), and the README's
benchmark section short and quoting only figures that bench/results/summary.md, the generated home of every
measured figure, holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def _bench_imports() -> dict[str, set[str]]:
    """For each bench/*.py module, the bench/ modules it imports anywhere in its body."""
    names = {p.stem for p in BENCH.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in BENCH.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
        graph[path.stem] = (found & names) - {path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [*path, nxt]
            if state.get(nxt) is None and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if state.get(n) is None and (c := visit(n, [n]))), None)


def test_bench_modules_import_each_other_without_a_cycle() -> None:
    graph = _bench_imports()
    assert graph["run_all"] >= {"batching_gain", "model_limit", "latency_sweep", "settings_ab"}  # the walk sees them
    assert _cycle(graph) is None, f"import cycle in bench/: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _readme_benchmarks() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Benchmarks\n")
    end = text.index("\n## ", start + 1)
    return text[start + 1:end]


def test_the_readme_benchmark_section_is_short_and_links_the_summary() -> None:
    section = _readme_benchmarks()
    assert len(section.strip().splitlines()) < 25
    assert "bench/results/summary.md" in section


def test_every_figure_in_the_readme_benchmark_section_is_in_the_generated_summary() -> None:
    summary = set(NUMBER.findall((BENCH / "results" / "summary.md").read_text()))
    missing = [n for n in NUMBER.findall(_readme_benchmarks()) if n not in summary]
    assert not missing, f"figures in the README's benchmark section that bench/results/summary.md lacks: {missing}"
