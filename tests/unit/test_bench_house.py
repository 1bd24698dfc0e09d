"""The README's benchmark section short and quoting only figures that bench/results/summary.md, the generated home
of every measured figure, holds. (bench/'s import cycles: tests/unit/test_import_cycles.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


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
