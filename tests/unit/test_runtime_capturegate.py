"""No CUDA graph is destroyed while a capture is in progress (worker.runtime.capturegate), shown with stand-in
graphs: the CudaGraphRunner releases evicted, unadmitted and failed graphs, and a dropped runner's graphs, through
the gate, and captures inside `CaptureGate.capturing()`."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from worker.devices.graphplan import CaptureStop
from worker.runtime.capturegate import CaptureGate, CapturesStopped
from worker.testing import wait_for


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: records when it is destroyed."""

    def __init__(self, events: list[str], name: str = "destroyed") -> None:
        self.events = events
        self.name = name

    def __del__(self) -> None:
        self.events.append(self.name)


class CaptureInThread:
    """A capture in another thread (as another runner's lazy capture runs), held open until finish()."""

    def __init__(self, gate: CaptureGate, events: list[str]) -> None:
        self.gate, self.events = gate, events
        self.began, self._finish = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.began.wait(timeout=10)

    def _run(self) -> None:
        with self.gate.capturing():
            self.events.append("capture begins")
            self.began.set()
            assert self._finish.wait(timeout=10)
            self.events.append("capture ends")

    def finish(self) -> None:
        self._finish.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def test_a_graph_evicted_during_another_runners_capture_is_destroyed_after_it():
    gate, events = CaptureGate(), []
    capture = CaptureInThread(gate, events)
    evicted = [FakeGraph(events)]
    events.append("eviction requested")
    gate.release(evicted, then=lambda: events.append("memory returned"))
    assert evicted == [] and "destroyed" not in events
    capture.finish()
    assert events == ["capture begins", "eviction requested", "capture ends", "destroyed", "memory returned"]


def test_a_graph_released_while_no_capture_runs_is_destroyed_at_once():
    gate, events = CaptureGate(), []
    gate.release([FakeGraph(events)], then=lambda: events.append("memory returned"))
    assert events == ["destroyed", "memory returned"]


def test_a_graph_released_in_the_capturing_thread_is_destroyed_when_its_capture_ends():
    gate, events = CaptureGate(), []
    with gate.capturing():
        gate.release([FakeGraph(events)])
        events.append("capture ends")
    assert events == ["capture ends", "destroyed"]


class Runner:
    """Holds its graphs as CudaGraphRunner does, in a reference cycle so only the collector frees it."""

    def __init__(self, gate: CaptureGate, events: list[str]) -> None:
        self.graphs = {(1, (8, 8, 3)): FakeGraph(events)}
        self.me = self
        gate.adopt(self, self.graphs)


def test_a_runner_collected_during_a_capture_has_its_graphs_destroyed_after_the_capture():
    gate, events = CaptureGate(), []
    capture = CaptureInThread(gate, events)
    runner = Runner(gate, events)
    alive = weakref.ref(runner)
    del runner
    gc.collect()  # an explicit collection still runs during a capture: the runner goes, its graphs wait
    assert alive() is None and "destroyed" not in events
    capture.finish()
    assert events == ["capture begins", "capture ends", "destroyed"]


def test_a_runner_dropped_with_no_capture_running_takes_its_graphs_with_it():
    gate, events = CaptureGate(), []
    runner = Runner(gate, events)
    runner.me = None
    del runner
    assert events == ["destroyed"]


def test_captures_take_turns():
    gate, events = CaptureGate(), []
    first = CaptureInThread(gate, events)
    second_began = threading.Event()

    def second() -> None:
        with gate.capturing():
            events.append("second capture begins")
            second_began.set()

    thread = threading.Thread(target=second)
    thread.start()
    first.finish()
    assert second_began.wait(timeout=10)
    thread.join(timeout=10)
    assert events == ["capture begins", "capture ends", "second capture begins"]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_garbage_collector_does_not_run_inside_a_capture_and_its_state_is_restored(enabled_before):
    collections: list[str] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append("collection")

    def make_cyclic_garbage() -> None:
        for _ in range(20 * gc.get_threshold()[0]):  # far past the allocations that start a collection
            cycle: list = []
            cycle.append(cycle)

    gate = CaptureGate()
    was = gc.isenabled()
    gc.enable() if enabled_before else gc.disable()
    gc.callbacks.append(on_gc)
    try:
        with gate.capturing():
            assert not gc.isenabled()
            make_cyclic_garbage()
            during = list(collections)
        assert gc.isenabled() is enabled_before
        make_cyclic_garbage()
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable() if was else gc.disable()
    assert during == []
    if enabled_before:  # the same garbage outside a capture does start collections: the test can fail
        wait_for(lambda: bool(collections), timeout_s=5, what="a collection outside the capture")


# -- after a failed capture, none again (torch 2.11: pytorch issues 180395, 190348) ----------------------------------
class FailingGraph:
    """Stands in for torch.cuda.CUDAGraph whose capture fails (a host sync inside the forward)."""

    captures = 0

    def capture(self) -> None:
        FailingGraph.captures += 1
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class GoodGraph:
    captures = 0

    def capture(self) -> None:
        GoodGraph.captures += 1


def capture(gate: CaptureGate, graph_type: type) -> None:
    with gate.capturing(), gate.graph("device=cuda:0 bucket=8 shape=[224, 224, 3]"):
        graph_type().capture()


def test_a_failed_capture_stops_every_later_one_with_one_log_line(caplog):
    gate = CaptureGate()
    GoodGraph.captures = 0
    capture(gate, GoodGraph)
    assert gate.stopped is None
    with pytest.raises(RuntimeError, match="operation not permitted"):
        capture(gate, FailingGraph)
    assert gate.stopped == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    with pytest.raises(CapturesStopped, match="captures stopped after a failed one"):
        capture(gate, GoodGraph)
    assert GoodGraph.captures == 1  # the second good capture never began
    [line] = [r for r in caplog.records if r.name == "worker.runtime.capturegate"]
    assert line.levelname == "ERROR" and "no CUDA graph is captured again in this process" in line.getMessage()
    assert "bucket=8" in line.getMessage() and "operation not permitted" in line.getMessage()


def test_the_turn_is_free_after_a_failed_capture_for_what_is_released():
    gate, events = CaptureGate(), []
    with pytest.raises(RuntimeError):
        capture(gate, FailingGraph)
    gate.release([FakeGraph(events)], then=lambda: events.append("memory returned"))
    assert events == ["destroyed", "memory returned"]


def test_an_error_before_the_graph_is_begun_stops_nothing():
    """Out of memory in the eager warm-up runs before a capture is not a failed capture: the next one may run."""
    gate = CaptureGate()
    with pytest.raises(MemoryError), gate.capturing():
        raise MemoryError("warm-up")
    assert gate.stopped is None
    capture(gate, GoodGraph)


def test_gates_sharing_a_stop_stop_together_and_the_metric_reads_it():
    from prometheus_client import CollectorRegistry

    from worker.metrics import Metrics

    stop = CaptureStop()
    first, second = CaptureGate(stop), CaptureGate(stop)
    registry = CollectorRegistry()
    Metrics(registry, captures_stop=stop)
    assert registry.get_sample_value("streamfer_cuda_graph_captures_stopped") == 0.0
    with pytest.raises(RuntimeError):
        capture(first, FailingGraph)
    assert second.stopped is not None and stop.failures == 1
    assert registry.get_sample_value("streamfer_cuda_graph_captures_stopped") == 1.0
