"""bench/contention.py: what the figures mean (per-round ratios, the GIL's and the cores' shares of the loss), and
that the busy loop really stops."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import contention


def test_losses_are_split_per_round_into_the_cores_and_the_gil() -> None:
    fps = {"none": {1: 1000.0, 2: 500.0},
           "thread 25%": {1: 700.0, 2: 400.0},
           "process 25%": {1: 900.0, 2: 450.0}}
    out = contention.summarise(fps, [0.25])
    # Per round: the process keeps 0.9 of the no-busy-work throughput in both, the thread 0.7 and 0.8.
    assert out["variants"]["process 25%"]["of_none"].median == pytest.approx(0.9)
    assert out["variants"]["thread 25%"]["of_none"].low == pytest.approx(0.7)
    assert out["variants"]["thread 25%"]["of_none"].high == pytest.approx(0.8)
    duty = out["duties"]["25%"]
    assert duty["cores_loss"].median == pytest.approx(0.1)
    assert (duty["gil_loss"].low, duty["gil_loss"].high) == (pytest.approx(0.1), pytest.approx(0.2))


def test_variants_pair_a_thread_and_a_process_per_duty_after_the_baseline() -> None:
    assert [v.name for v in contention.variants([0.25, 0.4])] == [
        "none", "thread 25%", "process 25%", "thread 40%", "process 40%"]
    # Names are exact: a duty is never rounded into another's name (or run at the rounded share).
    close = contention.variants([0.125, 0.12])
    assert [v.name for v in close][1::2] == ["thread 12.5%", "thread 12%"]
    assert [v.duty for v in close][1::2] == [0.125, 0.12]


def test_the_busy_loop_starts_and_stops_on_its_event() -> None:
    stop, started = threading.Event(), threading.Event()
    t = threading.Thread(target=contention.busy, args=(stop, 0.5, started), daemon=True)
    t.start()
    assert started.wait(10)
    stop.set()
    t.join(10)
    assert not t.is_alive()
