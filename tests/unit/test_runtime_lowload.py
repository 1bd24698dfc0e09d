"""Low load on a CPU (issue 61): an idle runner prepares its batch on its own thread (no hand-off through the
preprocessing pool), a busy one still overlaps the next batch's preparation with it; a small batch runs on the
intra-op threads warm-up chose for it, and the configured ones are back after it."""

from __future__ import annotations

import threading

import torch

from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.runtime import InferenceExecutor
from worker.runtime.models import ModelContract
from worker.runtime.runners import SMALL_BATCH, EagerRunner
from worker.testing import wait_for

CONTRACT = ModelContract(name="m", version="1", labels=("a", "b"))
SHAPE = (8, 8, 3)


def _frame(i: int) -> Frame:
    return Frame(stream_id="s", frame_index=i, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0, width=8,
                 height=8, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(8 * 8 * 3), source=SourceRef("in", 0, i))


class GatedModel:
    """Zero scores once `gate` is set; records the intra-op threads it ran with."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.threads.append(torch.get_num_threads())
        assert self.gate.wait(30)
        return torch.zeros((x.shape[0], 2))


def test_an_idle_cpu_runner_prepares_its_batch_itself_and_a_busy_one_gets_it_prepared_beside_it():
    model = GatedModel()
    with InferenceExecutor([EagerRunner(model, CONTRACT, torch.device("cpu"))], CONTRACT, preprocess_threads=1) as ex:
        prepared_on: list[str] = []
        prepare = ex._preprocessor.prepare

        def recording(frames, shape):
            prepared_on.append(threading.current_thread().name)
            return prepare(frames, shape)

        ex._preprocessor.prepare = recording  # type: ignore[method-assign]
        first = ex.submit([_frame(0)], SHAPE)
        assert model.entered.wait(30)  # the first batch is in the model: the runner is busy
        second = ex.submit([_frame(1)], SHAPE)
        wait_for(lambda: len(prepared_on) == 2, 30, "the second batch prepared while the first runs", 0.01)
        assert not second.done()
        model.gate.set()
        assert len(first.result(30).verdicts) == len(second.result(30).verdicts) == 1
    assert prepared_on[0].startswith("infer-")
    assert prepared_on[1].startswith("preprocess-")


def test_a_small_batch_runs_on_the_threads_warm_up_chose_and_the_configured_ones_come_back():
    model = GatedModel()
    model.gate.set()
    runner = EagerRunner(model, CONTRACT, torch.device("cpu"))
    configured = torch.get_num_threads()
    runner.small_batch_threads = 1
    runner.run(torch.zeros((SMALL_BATCH, *SHAPE), dtype=torch.uint8))
    runner.run(torch.zeros((SMALL_BATCH + 1, *SHAPE), dtype=torch.uint8))
    assert model.threads == [1, configured]
    assert torch.get_num_threads() == configured
