"""bench/settings_ab.py: which settings it accepts (the order it runs them in: stats.rotating, tested in
test_bench_stats.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import settings_ab


def test_assignments_become_the_worker_environment() -> None:
    assert settings_ab.parse_assignments(["WORKER_RUNTIME_INSTANCES_PER_DEVICE=2", "WORKER_BATCHING_MAX_WAIT_MS="]) \
        == {"WORKER_RUNTIME_INSTANCES_PER_DEVICE": "2", "WORKER_BATCHING_MAX_WAIT_MS": ""}
    assert settings_ab.parse_assignments([]) == {}


@pytest.mark.parametrize("item", ["RUNTIME_INSTANCES=2", "WORKER_RUNTIME_INSTANCES_PER_DEVICE", "worker_x=1",
                                  "WORKER_A-B=1", "PATH=/tmp"])
def test_anything_but_a_worker_variable_is_refused_with_the_expected_form(item: str) -> None:
    with pytest.raises(ValueError, match="WORKER_<SECTION>_<FIELD>=VALUE"):
        settings_ab.parse_assignments([item])


def test_a_variable_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        settings_ab.parse_assignments(["WORKER_X=1", "WORKER_X=2"])


@pytest.mark.parametrize("argv, reason", [
    (["--b", "FOO=1"], "WORKER_<SECTION>_<FIELD>=VALUE"),
    (["--a", "WORKER_X=1", "--b", "WORKER_X=1"], "nothing to compare"),
    ([], "nothing to compare"),
])
def test_bad_variants_stop_before_a_broker_starts_with_the_reason(argv: list[str], reason: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        settings_ab.variants_of(argv)
    assert stopped.value.code == 2
    assert reason in capsys.readouterr().err


def test_good_variants_are_read_among_the_benchmark_flags() -> None:
    assert settings_ab.variants_of(["--quick", "--b", "WORKER_RUNTIME_INSTANCES_PER_DEVICE=2", "--rounds", "3"]) == {
        "A": {}, "B": {"WORKER_RUNTIME_INSTANCES_PER_DEVICE": "2"}}


def test_a_base_tree_runs_as_variant_b_with_the_trees_worker_first_on_the_path(tmp_path: Path) -> None:
    variants = settings_ab.variants_of(["--base", str(tmp_path), "--a", "WORKER_RUNTIME_TORCH_THREADS=1",
                                        "--b", "WORKER_RUNTIME_TORCH_THREADS=1"])
    assert variants == {"A": {"WORKER_RUNTIME_TORCH_THREADS": "1"},
                        "B": {"WORKER_RUNTIME_TORCH_THREADS": "1", "PYTHONPATH": str(tmp_path),
                              "PYTHONSAFEPATH": "1"}}
