"""What operators see, checked against a real worker that has done real work: every dashboard query (and
every alert) uses series and labels its /metrics really has, and a real Prometheus on loopback scrapes the
worker, sees its series and loads the alert rules."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_alerts import ALERTS, rules
from tests.unit.test_deploy_manifests import dashboard_queries, promql_metric_names
from worker.frames import Encoding, Priority
from worker.testing import FrameProducer, ResultsReader, RunningWorker, http_get, make_topics, run_worker, wait_for
from worker.tools.local_broker import free_port
from worker.tools.publish_frames import synthetic_frames

pytestmark = pytest.mark.integration

# Labels Prometheus attaches to every scraped series (the worker does not export them).
TARGET_LABELS = {"instance", "job"}
# Series a CPU worker cannot have, and why.
ABSENT_ON_CPU = {"streamfer_gpu_memory_bytes": "GPU memory exists only on CUDA devices"}


@pytest.fixture(scope="module")
def busy_worker(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    """A worker after every kind of traffic a panel shows: results, flags (threshold 0 flags every label),
    expired realtime frames (captured a minute ago, budget 2 s) and a dead letter."""
    topics = make_topics(kafka_bootstrap, f"obs{time.monotonic_ns() % 10**8}")
    worker = run_worker(kafka_bootstrap, topics, tmp_path_factory.mktemp("observability"),
                        settings={"model": {"default_threshold": 0.0},
                                  "batching": {"realtime": {"max_age_ms": 2000}}})
    try:
        producer = FrameProducer(kafka_bootstrap, topics)
        fresh = list(synthetic_frames(40, [(32, 32), (40, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "fresh"))
        producer.publish(fresh)
        old_ms = int(time.time() * 1000) - 60_000
        stale = [dataclasses.replace(f, capture_ts_ms=old_ms)
                 for f in synthetic_frames(5, [(32, 32)], Encoding.RAW_RGB8, Priority.REALTIME, "stale")]
        producer.publish(stale, keep_capture_ts=True)
        producer.send_raw(topics.standard, b"not a frame")
        results = ResultsReader(kafka_bootstrap, topics).read(len(fresh) + len(stale))
        assert {r["status"] for r in results} == {"OK", "EXPIRED"}

        def counted() -> bool:
            families = scrape(worker)
            # The lag gauge is refreshed once a second from watermarks the consumer caches from its fetches.
            return all(families.get(n) for n in ("streamfer_frames_dead_lettered_total",
                                                 "streamfer_frames_expired_total", "streamfer_frames_flagged_total",
                                                 "streamfer_consumer_lag"))

        wait_for(counted, 60, "dead-letter, expiry and flag counters and the lag gauge on /metrics")
        yield worker
    finally:
        worker.stop()


def scrape(worker: RunningWorker) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, from one scrape of /metrics."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(worker.metrics()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def promql_label_names(expr: str) -> set[str]:
    """Label names an expression matches on or groups by."""
    names = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        names |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", re.sub(r'"(?:[^"\\]|\\.)*"', '""', matchers)))
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    return names


def check_query(expr: str, scraped: dict[str, set[str]]) -> list[str]:
    """What a query uses that the scrape does not have."""
    problems = []
    names = promql_metric_names(expr) - {"up"}
    missing = {n for n in names if n not in scraped and n not in ABSENT_ON_CPU}
    problems += [f"no series {n}" for n in sorted(missing)]
    have = set().union(*(scraped.get(n, set()) for n in names)) | TARGET_LABELS
    if any(n in ABSENT_ON_CPU for n in names):
        return problems  # its labels cannot be seen here
    problems += [f"no label {label!r} on {sorted(names)}" for label in sorted(promql_label_names(expr) - have)]
    return problems


def test_the_profiler_endpoint_is_off_unless_asked_for(busy_worker: RunningWorker) -> None:
    assert busy_worker.get("/debug/profile?batches=1")[0] == 404  # observability.profile_endpoint = false
    assert busy_worker.get("/healthz")[0] == 200


def test_the_label_check_catches_a_wrong_label() -> None:
    scraped = {"streamfer_frames_consumed_total": {"topic", "tenant"}}
    assert check_query('sum by (topic) (rate(streamfer_frames_consumed_total{instance=~"$i"}[5m]))', scraped) == []
    assert check_query("sum by (priority) (rate(streamfer_frames_consumed_total[5m]))", scraped) == [
        "no label 'priority' on ['streamfer_frames_consumed_total']"]
    assert check_query("streamfer_frames_consumed", scraped) == ["no series streamfer_frames_consumed"]


def test_every_dashboard_query_uses_series_and_labels_a_working_worker_has(busy_worker: RunningWorker) -> None:
    scraped = scrape(busy_worker)
    problems = {where: p for where, expr in dashboard_queries() if (p := check_query(expr, scraped))}
    assert problems == {}


def test_every_alert_uses_series_and_labels_a_working_worker_has(busy_worker: RunningWorker) -> None:
    scraped = scrape(busy_worker)
    problems = {rule["alert"]: p for rule in rules() if (p := check_query(rule["expr"], scraped))}
    assert problems == {}


# -- a real Prometheus -------------------------------------------------------------------------------------
def prometheus_api(port: int, path: str, **params: str) -> dict:
    status, body = http_get(port, f"/api/v1/{path}?{urllib.parse.urlencode(params)}")
    assert status == 200, (status, body)
    return json.loads(body)["data"]


@pytest.fixture
def prometheus(busy_worker: RunningWorker, tmp_path: Path) -> Iterator[int]:
    """Prometheus (Debian's package) on loopback, scraping the worker every second with the alert rules."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus; ./dev setup does it)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "streamfer-worker",
                            "static_configs": [{"targets": [f"127.0.0.1:{busy_worker.port}"]}]}],
    }))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: http_get(port, "/-/ready")[0] == 200 or proc.poll() is not None, 60, "Prometheus ready")
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_prometheus_scrapes_the_worker_and_loads_the_alerts(busy_worker: RunningWorker, prometheus: int) -> None:
    target = f"127.0.0.1:{busy_worker.port}"

    def scraped() -> bool:
        result = prometheus_api(prometheus, "query", query='up{job="streamfer-worker"}')["result"]
        return [r["value"][1] for r in result] == ["1"]

    wait_for(scraped, 60, "Prometheus to scrape the worker (up == 1)")
    series = prometheus_api(prometheus, "series", **{"match[]": '{job="streamfer-worker"}'})
    names = {s["__name__"] for s in series}
    assert set(scrape(busy_worker)) <= names
    assert {s["instance"] for s in series} == {target}
    consumed = prometheus_api(prometheus, "query", query="sum(streamfer_frames_consumed_total)")["result"]
    assert float(consumed[0]["value"][1]) >= 45

    def evaluated() -> list[dict]:
        groups = prometheus_api(prometheus, "rules")["groups"]
        return [r for g in groups for r in g["rules"] if r.get("lastEvaluation", "").startswith("20")]

    wait_for(lambda: len(evaluated()) == len(rules()), 30, "every alert rule evaluated")
    assert {r["name"]: r["health"] for r in evaluated()} == {r["alert"]: "ok" for r in rules()}
    # A healthy, ready worker: nothing that needs minutes to fire is firing, and nothing stalls or is down.
    firing = {r["name"] for r in evaluated() if r["state"] != "inactive"}
    assert not firing & {"StreamferWorkerDown", "StreamferLoopStalled", "StreamferWorkerNotReady"}
