"""A model rolled out without a restart (issue 69), on the real broker with a real `worker run` process: realtime
frames at 20/s and standard frames flowing, `worker rollout start --shadow 0.2` then `promote` to a second real model
(the builtin CNN's architecture with other weights, as a TorchScript file under model.allowed_sources), then a corrupt
model file; and a worker that starts after a promote."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.codec.schemas import decode_result
from worker.frames import Encoding, Priority
from worker.kafka.topics import CONTROL_TOPIC_CONFIG, ensure_topics
from worker.rollout.plan import in_share
from worker.testing import FrameProducer, TestTopics, make_topics, run_worker, wait_for
from worker.tools.publish_frames import send_frames, synthetic_frames
from worker.tools.read_results import iter_messages

pytestmark = pytest.mark.integration

SHARE = 0.2
MODEL = "streamfer-moderation-cnn"


def scripted_builtin(path: Path, seed: int) -> Path:
    """The builtin CNN's architecture with weights from another seed, saved as TorchScript: a second real model.
    Its directory is what the operator's CLI (as the workers) allows (`setup`)."""
    import torch

    from worker.runtime.models import build_builtin_model

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(build_builtin_model(5, 3, seed=seed).eval()).save(str(path))
    return path


class Flow:
    """Frames published on a thread until stopped: realtime at 20/s over 30 streams, standard at 10/s over 20."""

    def __init__(self, bootstrap: str, topics: TestTopics) -> None:
        self.bootstrap, self.topics = bootstrap, topics
        self.stop = threading.Event()
        self.sent: Counter[str] = Counter()
        self.threads = [threading.Thread(target=self._run, args=(p, rate, streams), daemon=True)
                        for p, rate, streams in ((Priority.REALTIME, 20.0, 30), (Priority.STANDARD, 10.0, 20))]
        self.errors: list[BaseException] = []

    def _run(self, priority: Priority, rate: float, streams: int) -> None:
        try:
            topic = self.topics.for_priority(priority)
            producer = FrameProducer(self.bootstrap, self.topics)._client()
            # The same stream ids every run (the topics are the test's own): which streams a share picks is a hash
            # of the id, so random ids made the picked fraction of 50 streams vary from run to run (5 of 50, once).
            frames = synthetic_frames(10**6, [(64, 48)], Encoding.JPEG, priority, "rollout",
                                      streams_per_shape=streams)
            counted = (self._count(f) for f in itertools.takewhile(lambda _f: not self.stop.is_set(), frames))
            send_frames(producer, counted, lambda _r: topic, rate_fps=rate)
            producer.flush(30)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.errors.append(exc)

    def _count(self, frame: Any) -> Any:
        self.sent[frame.stream_id] += 1
        return frame

    def __enter__(self) -> Flow:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def cli(bootstrap: str, topics: TestTopics, control: str, *args: str) -> str:
    env = {**os.environ, **topics.env(), "WORKER_TOPICS_CONTROL": control,
           "WORKER_MODEL_ALLOWED_SOURCES": os.environ.get("ROLLOUT_TEST_ALLOWED", "")}
    done = subprocess.run([sys.executable, "-m", "worker", "rollout", *args, "-b", bootstrap, "--group-id",
                           topics.group], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def status(bootstrap: str, topics: TestTopics, control: str) -> dict[str, Any]:
    return json.loads(cli(bootstrap, topics, control, "status", "--json"))


def worker_state(bootstrap: str, topics: TestTopics, control: str, worker: str) -> dict[str, Any]:
    return status(bootstrap, topics, control)["workers"].get(worker, {})


def results(bootstrap: str, topic: str, count: int | None = None, timeout_s: float = 120) -> list[dict[str, Any]]:
    return [decode_result(m.value()) for m in iter_messages(bootstrap, topic, count, follow=count is not None,
                                                             idle_timeout_s=3.0, timeout_s=timeout_s)]


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line) and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def setup(kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[tuple[str, TestTopics, str, str, Path]]:
    monkeypatch.setenv("ROLLOUT_TEST_ALLOWED", f"{tmp_path / 'models'}/")
    unique = uuid.uuid4().hex[:8]
    topics = make_topics(kafka_bootstrap, f"rollout{unique}")
    control, shadow = f"t{unique}.control", f"t{unique}.shadow"
    ensure_topics(kafka_bootstrap, [control], partitions=1, configs={control: CONTROL_TOPIC_CONFIG})
    ensure_topics(kafka_bootstrap, [shadow], partitions=3)
    yield kafka_bootstrap, topics, control, shadow, tmp_path


def test_shadow_then_promote_then_a_corrupt_file(setup):
    bootstrap, topics, control, shadow_topic, tmp = setup
    models = tmp / "models"
    v2 = scripted_builtin(models / "cnn-v2.pt", seed=20261207)
    settings = {"topics": {"control": control, "shadow_results": shadow_topic},
                "model": {"allowed_sources": [f"{models}/"]},
                "batching": {"realtime": {"max_age_ms": 2000}}}
    worker = run_worker(bootstrap, topics, tmp, settings=settings, worker_id="w0")
    try:
        with Flow(bootstrap, topics) as flow:
            wait_for(lambda: flow.total > 60, 60, "frames flowing")
            rebalances = metric(worker.metrics(), "streamfer_rebalances_total")
            started = json.loads(cli(bootstrap, topics, control, "start", "--model", str(v2), "--version", "2",
                                     "--shadow", str(SHARE)))
            assert started["candidate"] == f"{MODEL}:2" and started["mode"] == "shadow"
            wait_for(lambda: worker_state(bootstrap, topics, control, "w0").get("state") == "shadow", 120,
                     "the candidate loaded, warmed and shadowing")
            shadow_from = flow.total
            wait_for(lambda: flow.total - shadow_from > 200, 60, "200 frames in shadow")
            sent_before_promote = Counter(flow.sent)
            promoted = json.loads(cli(bootstrap, topics, control, "promote"))
            assert promoted["primary"] == f"{MODEL}:2" and promoted["candidate"] is None
            wait_for(lambda: worker_state(bootstrap, topics, control, "w0").get("serving") == f"{MODEL}:2", 60,
                     "the promoted model serving")
            promoted_at = flow.total
            wait_for(lambda: flow.total - promoted_at > 100, 60, "100 frames after the promote")

            # A corrupt model file: the serving model keeps serving, the rollout says why.
            corrupt = models / "corrupt.pt"
            corrupt.write_bytes(b"not a model at all" * 100)
            cli(bootstrap, topics, control, "start", "--model", str(corrupt), "--version", "3", "--canary", "0.5")
            wait_for(lambda: worker_state(bootstrap, topics, control, "w0").get("state") == "failed", 120,
                     "the corrupt candidate failed")
            state = worker_state(bootstrap, topics, control, "w0")
            assert "corrupt.pt" in state["reason"] and state["serving"] == f"{MODEL}:2", state
            code, ready = worker.get("/readyz")
            assert code == 200 and "model rollout revision 3 failed" in ready, ready
            assert metric(worker.metrics(), "streamfer_rollout_failed") == 1
            failed_at = flow.total
            wait_for(lambda: flow.total - failed_at > 60, 60, "frames after the failure")
            cli(bootstrap, topics, control, "abort")  # a new revision: the failure is behind
            wait_for(lambda: worker_state(bootstrap, topics, control, "w0").get("state") == "serving", 60,
                     "the worker serving after the abort")
        assert not flow.errors, flow.errors
        got = results(bootstrap, topics.results, flow.total)
        text = worker.metrics()
    finally:
        worker.stop()

    # Every frame answered once, none expired, no dead letter, no rebalance.
    answered = Counter((r["stream_id"], r["frame_index"]) for r in got)
    assert len(answered) == flow.total and set(answered.values()) == {1}
    assert [r for r in got if r["status"] != "OK"] == []
    assert results(bootstrap, topics.dead_letter) == []
    assert metric(text, "streamfer_rebalances_total") == rebalances
    assert metric(text, "streamfer_frames_expired_total") == 0

    # Each stream's results carry version 1 up to the promote, version 2 after it, never back.
    for stream, index_version in itertools.groupby(sorted((r["stream_id"], r["frame_index"], r["model_version"])
                                                          for r in got), key=lambda t: t[0]):
        versions = [v for _, _, v in index_version]
        assert versions == sorted(versions), f"{stream}: {versions}"
        assert versions[0] == "1" and versions[-1] == "2", f"{stream}: {versions}"
        assert all(v == "1" for v in versions[:sent_before_promote[stream]]), stream
    assert {r["model_name"] for r in got} == {MODEL}

    # The shadow topic: the candidate's results, for the streams of its share alone, about a fifth of the frames.
    shadowed = results(bootstrap, shadow_topic)
    assert shadowed and {r["model_version"] for r in shadowed} == {"2"}
    streams = {r["stream_id"] for r in got}
    in_streams = {s for s in streams if in_share(s, SHARE)}
    assert {r["stream_id"] for r in shadowed} <= in_streams
    assert 0.1 < len(in_streams) / len(streams) < 0.35  # 14 of these 50 ids
    v1_in_share = sum(1 for r in got if r["model_version"] == "1" and r["stream_id"] in in_streams)
    scored = metric(text, "streamfer_shadow_frames_total", 'outcome="scored"')
    skipped = metric(text, "streamfer_shadow_frames_total", 'outcome="skipped"')
    assert len(shadowed) == scored and scored + skipped <= v1_in_share
    assert scored >= 0.5 * (scored + skipped), (scored, skipped)
    assert metric(text, "streamfer_shadow_verdicts_total") > 0
    assert metric(text, "streamfer_rollout_failed") == 0
    assert metric(text, "streamfer_model_frames_total", 'version="2"') > 0


def test_a_worker_started_after_a_promote_serves_the_promoted_model(setup, monkeypatch):
    """With topics.worker_status set, the worker reports there (and `rollout status` reads it from there)."""
    bootstrap, topics, control, shadow_topic, tmp = setup
    reports = f"{control}.status"
    ensure_topics(bootstrap, [reports], partitions=1, configs={reports: CONTROL_TOPIC_CONFIG})
    monkeypatch.setenv("WORKER_TOPICS_WORKER_STATUS", reports)  # the worker's and the CLI's
    models = tmp / "models"
    v2 = scripted_builtin(models / "cnn-v2.pt", seed=99)
    settings = {"topics": {"control": control, "shadow_results": shadow_topic},
                "model": {"allowed_sources": [f"{models}/"]}}
    # Written with no worker running: the group's model set says v2 is the primary.
    cli(bootstrap, topics, control, "start", "--model", str(v2), "--version", "2", "--canary", "0.5")
    cli(bootstrap, topics, control, "promote")
    worker = run_worker(bootstrap, topics, tmp, settings=settings, worker_id="late")
    try:
        FrameProducer(bootstrap, topics).publish(synthetic_frames(20, [(64, 48)], Encoding.JPEG, Priority.STANDARD,
                                                                  "late"))
        got = results(bootstrap, topics.results, 20)
        assert {r["model_version"] for r in got} == {"2"}
        wait_for(lambda: worker_state(bootstrap, topics, control, "late").get("revision") == 2, 60,
                 "the late worker's report")
        state = worker_state(bootstrap, topics, control, "late")
        assert state["state"] == "serving" and state["serving"] == f"{MODEL}:2", state
        on_control = [m.key() for m in iter_messages(bootstrap, control, idle_timeout_s=2.0)]
        assert all(b"/worker/" not in (k or b"") for k in on_control), on_control  # reports went to worker_status
    finally:
        worker.stop()
