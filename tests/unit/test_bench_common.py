"""bench/common.py: the batch-size figures taken from results, how an offered load is sent in step, the worker's loop
run in a thread of this process, and a benchmark's child process against a source tree."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import common


def test_batch_sizes_count_batches_from_frames_that_each_report_their_batch() -> None:
    # Two batches of 4, one of 1 and one of 2; an expired frame is left out.
    results = [{"batch_size": 4}] * 8 + [{"batch_size": 1}] + [{"batch_size": 2}] * 2 + [
        {"batch_size": 32, "status": "EXPIRED"}]
    sizes = common.batch_sizes(results)
    assert sizes["batches"] == 4
    assert sizes["mean_frame_weighted"] == pytest.approx((8 * 4 + 1 + 2 * 2) / 11)
    assert sizes["share_of_frames"] == {"1": round(1 / 11, 3), "2-3": round(2 / 11, 3), "4-7": round(8 / 11, 3),
                                        "8-15": 0.0, "16-31": 0.0, "32+": 0.0}
    assert sizes["sizes_used"][4] == {"frames": 8, "batches": 2, "share_of_frames": 8 / 11}


def test_no_frames_have_no_mean_batch() -> None:
    sizes = common.batch_sizes([])
    assert sizes["batches"] == 0 and sizes["mean_frame_weighted"] != sizes["mean_frame_weighted"]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def publish(self, records: list[int], rate_fps: float | None = None) -> SimpleNamespace:
        self.calls.append(list(records))
        return SimpleNamespace(sent=len(records), seconds=0.0, send_delays_ms=[])


def test_an_in_step_load_sends_one_burst_of_every_stream_at_a_time() -> None:
    producer = Recorder()
    load = common.publish(producer, list(range(10)), rate_fps=1e9, in_step=4)  # type: ignore[arg-type]
    assert producer.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert load["sent"] == 10 and load["in_step"] == 4


def test_a_workloads_consecutive_frames_are_its_streams_in_turn() -> None:
    streams = common.STREAMS_PER_SHAPE * 2
    records = common.workload_records(2 * streams, "r", common.WORKLOADS["jpeg720+1080"])
    first, second = records[:streams], records[streams:]
    assert len({r.stream_id for r in first}) == streams  # one burst: every stream once
    assert [r.stream_id for r in first] == [r.stream_id for r in second]
    assert {(r.width, r.height) for r in first} == {(1280, 720), (1920, 1080)}


def test_the_process_listening_on_a_bootstrap_port_is_found_so_an_external_brokers_cpu_is_measured() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert common.listening_pid(f"127.0.0.1:{port},other:9092") == os.getpid()
    assert common.listening_pid(f"127.0.0.1:{port}") is None  # closed: nobody listens
    assert common.listening_pid("no-port") is None


# -- the loop in a thread, a child process ----------------------------------------------------------------------
def test_the_loop_runs_in_a_thread_named_loop_until_told_to_stop_and_its_cpu_is_counted_by_role() -> None:
    from worker.config import ObservabilitySettings, Settings
    from worker.loop.pipeline import build_pipeline
    from worker.metrics import Health, Metrics
    from worker.testing import FakeClock, InMemoryKafka
    from worker.testing.fakes import FakeExecutor, frame_value

    kafka, clock = InMemoryKafka(), FakeClock()
    settings = Settings(observability=ObservabilitySettings(worker_id="bench-loop"))
    kafka.send((settings.topics.realtime, 0), *(frame_value("s", i) for i in range(20)))
    pipeline = build_pipeline(settings, FakeExecutor(), Metrics(), Health(), clock, clients=kafka.clients)
    asked_in: set[str] = set()

    def answered() -> bool:
        asked_in.add(threading.current_thread().name)
        clock.advance(0.01)
        return pipeline.delivery.results == 20

    run = common.run_pipeline_thread(pipeline, answered)
    assert asked_in == {"loop"}
    assert run.summary.consumed == 20 and pipeline.delivery.results == 20
    assert run.wall_s > 0 and "loop" in run.thread_cpu_s and all(s >= 0 for s in run.thread_cpu_s.values())


def test_an_error_of_the_loop_is_raised_in_the_caller_and_a_loop_that_ends_unasked_is_one() -> None:
    class Failing:
        def run(self, should_stop: object) -> None:
            raise ValueError("the loop broke")

    class Quitting:
        def run(self, should_stop: object) -> SimpleNamespace:
            return SimpleNamespace()

    with pytest.raises(ValueError, match="the loop broke"):
        common.run_pipeline_thread(Failing(), lambda: False)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="ended before should_stop said so"):
        common.run_pipeline_thread(Quitting(), lambda: False)  # type: ignore[arg-type]


def test_a_child_runs_against_the_trees_worker_and_hands_back_the_json_on_its_last_line(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "worker").mkdir(parents=True)
    (tree / "worker" / "__init__.py").write_text("")
    script = tmp_path / "bench_child.py"
    script.write_text("import json, os, sys\nimport worker\nprint('a line before')\n"
                      "print(json.dumps({'worker': worker.__file__, 'cwd': os.getcwd(), 'argv': sys.argv[1:]}))\n")
    out = common.run_child(script, {"round": 1}, tree, timeout_s=60)
    assert out == {"worker": str(tree / "worker" / "__init__.py"), "cwd": str(tree),
                   "argv": ["--child", '{"round": 1}']}


def test_a_child_that_fails_is_an_error_naming_its_exit_code_and_the_end_of_its_stderr(tmp_path: Path) -> None:
    script = tmp_path / "bench_child.py"
    script.write_text("import sys\nsys.stderr.write('the round broke')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"bench_child.py --child \{\}: exit 3\nthe round broke"):
        common.run_child(script, {}, tmp_path, timeout_s=60)
