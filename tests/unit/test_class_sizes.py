"""No class in worker/ grows past 400 lines: a class that big holds several policies, each better in its own small,
named place (as worker/batching/ splits the micro-batcher)."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "worker"
MAX_CLASS_LINES = 400
# The loop only orchestrates: reading (worker.loop.admission), flow control (worker.loop.flow), the runtime's batches
# (worker.loop.inflight) and the answers with their metrics (worker.loop.answers) each live in their own module.
MAX_PIPELINE_LINES = 250


def class_lengths() -> dict[str, int]:
    """Every class under worker/, as path:name, with its length in lines (decorators and docstring included)."""
    lengths = {}
    for path in sorted(WORKER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                lengths[f"{path.relative_to(WORKER.parent)}:{node.name}"] = node.end_lineno - start + 1
    return lengths


def test_the_walk_finds_the_classes_it_measures() -> None:
    lengths = class_lengths()

    assert 0 < lengths["worker/batching/batcher.py:MicroBatcher"] <= MAX_CLASS_LINES
    assert "worker/loop/pipeline.py:Pipeline" in lengths


def test_no_class_in_worker_is_over_400_lines() -> None:
    too_big = {name: n for name, n in class_lengths().items() if n > MAX_CLASS_LINES}

    assert not too_big, f"classes over {MAX_CLASS_LINES} lines (split them by the decisions they hold): {too_big}"


def test_the_loop_stays_an_orchestrator() -> None:
    assert class_lengths()["worker/loop/pipeline.py:Pipeline"] <= MAX_PIPELINE_LINES
