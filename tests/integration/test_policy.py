"""Per-tenant policies and review queues (issue 66) on the real broker, with a real `worker run` process (the
builtin model): three tenants send the same pictures and get different verdicts; review and flagged copies land on
their topics and nothing else does; a policy written mid-stream with `worker policy set` applies from a batch
boundary, and every result names the version that decided it; under exactly-once, a SIGKILL mid-stream leaves
every frame one result and each route at most one copy (read_committed)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from worker.codec.schemas import FrameRecord
from worker.config import PolicySettings, Settings
from worker.frames import Encoding, Priority, Verdict
from worker.kafka.topics import ensure_control_topic, ensure_topics
from worker.policy.verdicts import Policy
from worker.testing import FrameProducer, TestTopics, make_topics, run_worker, uncommitted, wait_for
from worker.testing.workers import start_worker
from worker.tools.read_results import read_results

LABELS = Settings().model.labels
TENANTS = ("kids", "teen", "dating")
SIDE = 32
WAIT_S = 180.0

# r1: kids flag on nudity, teen goes to review on nudity, dating is allowed (every label named, at 1.0).
R1 = {"flag": {label: 1.0 for label in LABELS},
      "tenants": {"kids": {"flag": {"nudity": 0.0}}, "teen": {"review": {"nudity": 0.0}}}}
# r2, written mid-stream: the other way round for kids and teen.
R2 = {"flag": {label: 1.0 for label in LABELS},
      "tenants": {"kids": {"review": {"nudity": 0.0}}, "teen": {"flag": {"nudity": 0.0}}}}


def toml(policy: dict[str, Any]) -> str:
    def table(values: dict[str, float]) -> str:
        return "{ " + ", ".join(f"{k} = {v}" for k, v in values.items()) + " }"

    lines = ["[policy]"] + [f"{kind} = {table(policy[kind])}" for kind in ("flag", "review") if kind in policy]
    for tenant, overrides in policy.get("tenants", {}).items():
        lines.append(f"[policy.tenants.{tenant}]")
        lines += [f"{kind} = {table(values)}" for kind, values in overrides.items()]
    return "\n".join(lines) + "\n"


def settings_of(policy: dict[str, Any]) -> PolicySettings:
    return PolicySettings(flag=policy["flag"], review=policy.get("review", {}), tenants=policy["tenants"])


@pytest.fixture
def topics(kafka_bootstrap: str) -> tuple[TestTopics, dict[str, str]]:
    t = make_topics(kafka_bootstrap, uuid.uuid4().hex[:8])
    routes = {"review": f"{t.results}.review", "flagged": f"{t.results}.flagged", "control": f"{t.group}.control"}
    ensure_topics(kafka_bootstrap, [routes["review"], routes["flagged"]], 3)
    from dataclasses import replace

    from worker.config import TopicSettings

    ensure_control_topic(kafka_bootstrap, replace(TopicSettings(), control=routes["control"]))
    return t, routes


def policy_cli(kafka_bootstrap: str, t: TestTopics, routes: dict[str, str], tmp_path: Path, *args: str
               ) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "control.toml"
    config.write_text(f'[topics]\ncontrol = "{routes["control"]}"\n')
    return subprocess.run([sys.executable, "-m", "worker", "policy", *args, "-b", kafka_bootstrap,
                           "--config", str(config), "--group-id", t.group], capture_output=True, text=True,
                          timeout=120)


def set_policy(kafka_bootstrap: str, t: TestTopics, routes: dict[str, str], tmp_path: Path,
               policy: dict[str, Any], name: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(toml(policy))
    done = policy_cli(kafka_bootstrap, t, routes, tmp_path, "set", "--file", str(path))
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["policy_version"])


def write_revision(kafka_bootstrap: str, t: TestTopics, routes: dict[str, str], revision: int,
                   policy: PolicySettings) -> None:
    """A policy record written straight to the control topic, unchecked (another operator's settings)."""
    from worker.config import load_settings
    from worker.control.records import POLICY, ControlRecord, policy_key
    from worker.kafka.control import ControlWriter

    settings = load_settings(env={}, overrides={"kafka": {"bootstrap_servers": kafka_bootstrap, "group_id": t.group},
                                                "topics": {"control": routes["control"]}})
    writer = ControlWriter(settings)
    try:
        writer.write(policy_key(t.group), ControlRecord(POLICY, t.group, revision, int(time.time() * 1000), "test",
                                                        policy=policy))
    finally:
        writer.close()


def worker_reports(kafka_bootstrap: str, t: TestTopics, routes: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    done = policy_cli(kafka_bootstrap, t, routes, tmp_path, "show", "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout)["workers"])


def pictures(count: int, first: int, run: str) -> list[FrameRecord]:
    """`count` random pictures, each sent once per tenant (the same bytes), on one stream per tenant."""
    rng = random.Random(first)
    now_ms = int(time.time() * 1000)
    out = []
    for i in range(first, first + count):
        data = bytes(rng.getrandbits(8) for _ in range(SIDE * SIDE * 3))
        out += [FrameRecord(stream_id=f"{run}-{tenant}", frame_index=i, capture_ts_ms=now_ms, tenant=tenant,
                            priority=Priority.STANDARD, width=SIDE, height=SIDE, channels=3,
                            encoding=Encoding.RAW_RGB8, data=data) for tenant in TENANTS]
    return out


def judged(metrics: str) -> float:
    """Results the worker judged so far: the sum of streamfer_verdicts_total."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("streamfer_verdicts_total{"))


def read(kafka_bootstrap: str, topic: str, count: int | None = None, idle_s: float = 3.0) -> list[dict[str, Any]]:
    if count is None:
        return read_results(kafka_bootstrap, topic, idle_timeout_s=idle_s)
    return read_results(kafka_bootstrap, topic, until=lambda rs: len(rs) >= count, timeout_s=WAIT_S)


def test_tenants_get_their_own_verdicts_copies_go_to_their_routes_and_a_policy_changes_mid_stream(
        kafka_bootstrap: str, topics: tuple[TestTopics, dict[str, str]], tmp_path: Path) -> None:
    t, routes = topics
    r1 = set_policy(kafka_bootstrap, t, routes, tmp_path, R1, "r1")
    assert r1 == "r1"
    worker = run_worker(kafka_bootstrap, t, tmp_path, env={
        "WORKER_TOPICS_REVIEW": routes["review"], "WORKER_TOPICS_FLAGGED": routes["flagged"],
        "WORKER_TOPICS_CONTROL": routes["control"]}, worker_id=f"{t.group}-w0")
    try:
        # The worker read the control topic before it served: it reports r1 applied.
        assert worker_reports(kafka_bootstrap, t, routes, tmp_path)[f"{t.group}-w0"]["policy_version"] == "r1"
        producer = FrameProducer(kafka_bootstrap, t)
        first = pictures(20, 0, "a")
        producer.publish(first)
        before = read(kafka_bootstrap, t.results, len(first))
        assert {r["policy_version"] for r in before} == {"r1"}

        # Mid-stream: frames flow at 30/s (for 10 s) while r2 is written.
        flowing = pictures(100, 1000, "b")
        sender = threading.Thread(target=producer.publish, args=(flowing,), kwargs={"rate_fps": 30.0})
        sender.start()
        wait_for(lambda: judged(worker.metrics()) >= len(first) + 30, WAIT_S,
                 "some of the flowing frames answered under r1")
        assert sender.is_alive(), "the frames stopped flowing before the policy changed: the test proves nothing"
        r2 = set_policy(kafka_bootstrap, t, routes, tmp_path, R2, "r2")
        sender.join()
        wait_for(lambda: worker_reports(kafka_bootstrap, t, routes, tmp_path)[f"{t.group}-w0"]["policy_version"]
                 == r2, WAIT_S, "the worker reports r2 applied")
        after = pictures(20, 2000, "c")
        producer.publish(after)
        total = len(first) + len(flowing) + len(after)
        results = read(kafka_bootstrap, t.results, total)
        metrics = worker.metrics()
        # A policy this worker's model cannot apply (a label it lacks): refused, r2 kept, still ready, and said.
        # `worker policy set` checks the labels of the model its settings name and refuses it (exit 2, the line) ...
        (tmp_path / "r3.toml").write_text(toml({"flag": {"colour": 0.5}, "tenants": {}}))
        refused_here = policy_cli(kafka_bootstrap, t, routes, tmp_path, "set", "--file", str(tmp_path / "r3.toml"))
        assert refused_here.returncode == 2 and "policy.flag.colour" in refused_here.stderr
        assert "line 2" in refused_here.stderr
        # ... but a writer with other settings (a model with that label) can write it: the worker refuses it.
        write_revision(kafka_bootstrap, t, routes, 3, PolicySettings(flag={"colour": 0.5}))
        wait_for(lambda: worker_reports(kafka_bootstrap, t, routes, tmp_path)[f"{t.group}-w0"]["state"]
                 == "refused", WAIT_S, "the worker reports r3 refused")
        report = worker_reports(kafka_bootstrap, t, routes, tmp_path)[f"{t.group}-w0"]
        status = worker.get("/readyz")
        refused_metric = worker.metrics()
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]
    assert worker_reports(kafka_bootstrap, t, routes, tmp_path) == {}  # a graceful stop removes its report
    results = read(kafka_bootstrap, t.results)
    assert len(results) == total and len({(r["stream_id"], r["frame_index"]) for r in results}) == total

    # Every result names the version that decided it, and its verdict is that version's for its tenant.
    policies = {"r1": Policy(settings_of(R1), "r1"), "r2": Policy(settings_of(R2), "r2")}
    for r in results:
        verdict = Verdict(r["scores"], tuple(r["flagged_labels"]))
        want = policies[r["policy_version"]].decide(r["tenant"], verdict)
        assert (r["verdict"], tuple(r["verdict_labels"])) == (want.verdict, want.labels), r
        assert r["flagged"] == (r["verdict"] == "flag")
    # The same pictures, three verdicts: kids flag, teen review, dating allow under r1.
    by_version = Counter((r["policy_version"], r["tenant"], r["verdict"]) for r in results)
    assert by_version[("r1", "kids", "flag")] >= len(first) // 3
    assert by_version[("r1", "teen", "review")] >= len(first) // 3
    assert by_version[("r2", "kids", "review")] >= len(after) // 3
    assert by_version[("r2", "teen", "flag")] >= len(after) // 3
    assert all(r["policy_version"] == "r2" for r in results if r["stream_id"].startswith("c-"))
    assert {r["policy_version"] for r in results if r["stream_id"].startswith("b-")} == {"r1", "r2"}
    # From a batch boundary: along each partition, r1 then r2, never back.
    for partition in {r["source_partition"] for r in results}:
        versions = [r["policy_version"] for r in sorted(results, key=lambda r: r["source_offset"])
                    if r["source_partition"] == partition and r["source_topic"] == t.standard]
        assert versions == sorted(versions), f"partition {partition}: {versions}"

    # Copies: exactly the review and flag results, each once, and nothing else.
    review, flagged = read(kafka_bootstrap, routes["review"]), read(kafka_bootstrap, routes["flagged"])
    key = lambda r: (r["stream_id"], r["frame_index"])  # noqa: E731
    assert Counter(map(key, review)) == Counter(key(r) for r in results if r["verdict"] == "review")
    assert Counter(map(key, flagged)) == Counter(key(r) for r in results if r["verdict"] == "flag")
    assert {r["verdict"] for r in review} == {"review"} and {r["verdict"] for r in flagged} == {"flag"}
    assert 'streamfer_verdicts_total{tenant="kids",verdict="flag"}' in metrics
    assert report["policy_version"] == "r2" and "no label 'colour'" in report["reason"]
    assert status[0] == 200 and "policy r3 refused, judging with r2" in status[1]
    assert "streamfer_policy_refused 1.0" in refused_metric
    assert worker.log().count("policy r3 refused") == 1


def test_exactly_once_after_a_sigkill_every_frame_has_one_result_and_at_most_one_copy_per_route(
        kafka_bootstrap: str, topics: tuple[TestTopics, dict[str, str]], tmp_path: Path) -> None:
    t, routes = topics
    set_policy(kafka_bootstrap, t, routes, tmp_path, R1, "r1")
    sent = pictures(100, 0, "k")
    FrameProducer(kafka_bootstrap, t).publish(sent)
    env = {"WORKER_TOPICS_REVIEW": routes["review"], "WORKER_TOPICS_FLAGGED": routes["flagged"],
           "WORKER_TOPICS_CONTROL": routes["control"], "WORKER_DELIVERY_MODE": "exactly_once",
           # Small batches, one in flight: the worker is visibly mid-stream when it is killed.
           "WORKER_BATCHING_MAX_BATCH_SIZE": "2", "WORKER_BATCHING_FALLBACK_MAX_BATCH_SIZE": "2",
           "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "1"}
    log = str(tmp_path / "worker.log")
    first = start_worker(kafka_bootstrap, t, extra_env=env, worker_id=f"{t.group}-w0", log_path=log)
    partial = read_results(kafka_bootstrap, t.results, until=lambda rs: len(rs) >= 40, timeout_s=WAIT_S)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert len(partial) < len(sent), "the worker finished before it was killed: the test proves nothing"

    # The same worker id: its producer fences the dead one's open transaction at once.
    second = start_worker(kafka_bootstrap, t, extra_env=env, worker_id=f"{t.group}-w0", exit_when_idle=3.0,
                          log_path=log)
    assert second.wait(timeout=240) == 0, Path(log).read_text()[-3000:]

    key = lambda r: (r["stream_id"], r["frame_index"])  # noqa: E731
    results = read(kafka_bootstrap, t.results)
    assert Counter(map(key, results)) == Counter((f.stream_id, f.frame_index) for f in sent)
    review, flagged = read(kafka_bootstrap, routes["review"]), read(kafka_bootstrap, routes["flagged"])
    assert Counter(map(key, review)) == Counter(key(r) for r in results if r["verdict"] == "review")
    assert Counter(map(key, flagged)) == Counter(key(r) for r in results if r["verdict"] == "flag")
    assert len(review) >= len(sent) // 3 and len(flagged) >= len(sent) // 3
    assert uncommitted(kafka_bootstrap, t.group, t.inputs) == {}
