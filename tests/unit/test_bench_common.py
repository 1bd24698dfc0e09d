"""bench/common.py: the batch-size figures taken from results, and how an offered load is sent in step."""

from __future__ import annotations

import os
import socket
import sys
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
