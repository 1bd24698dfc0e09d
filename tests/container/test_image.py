"""The worker image, built and run for real: `./dev container-check` builds it and runs this module against
a real broker on loopback (every container on `--network host`). Skipped unless STREAMFER_CONTAINER_IMAGE
names the image to check, since a build takes minutes (docs/deploy.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from worker.testing import (
    FrameProducer,
    ResultsReader,
    TestTopics,
    http_get,
    ledger,
    make_topics,
    synthetic_frames,
    uncommitted,
    wait_for,
)
from worker.tools.local_broker import free_port

IMAGE = os.environ.get("STREAMFER_CONTAINER_IMAGE", "")
USER_ID = "10001"
# The drain must end well inside the shortest grace period we ship (compose's stop_grace_period: 60 s).
GRACE_PERIOD_S = 60

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(not IMAGE, reason="builds and runs the image: ./dev container-check"),
    pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client"),
]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"docker {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


def inspect(name: str) -> dict:
    return json.loads(docker("inspect", name).stdout)[0]


@dataclass
class Container:
    name: str
    port: int
    topics: TestTopics

    def logs(self) -> str:
        proc = docker("logs", self.name, check=False)
        return proc.stdout + proc.stderr


@pytest.fixture
def container(kafka_bootstrap: str, unique: str) -> Iterator[Container]:
    """`worker run` in the image, on the host's network (the broker listens on loopback), with its own
    metrics port; removed at the end whatever happened."""
    topics = make_topics(kafka_bootstrap, unique)
    port = free_port()
    env = {**topics.env(), "WORKER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "WORKER_OBSERVABILITY_METRICS_PORT": str(port), "WORKER_OBSERVABILITY_WORKER_ID": f"image-{unique}",
           "WORKER_RUNTIME_TORCH_THREADS": "1", "WORKER_RUNTIME_WARMUP_BATCHES": "1"}
    name = f"streamfer-check-{unique}"
    docker("run", "-d", "--network", "host", "--name", name, *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
           IMAGE)
    try:
        yield Container(name, port, topics)
    finally:
        docker("rm", "-f", name, check=False)


def test_image_is_built_to_run_as_the_unprivileged_user() -> None:
    config = inspect(IMAGE)["Config"]
    assert config["User"] == f"{USER_ID}:{USER_ID}"
    assert config["Entrypoint"] == ["worker"] and config["Cmd"] == ["run"]
    assert config["Healthcheck"]["Test"][0] == "CMD"


def test_worker_in_the_image_serves_drains_and_passes_its_healthcheck(container: Container, kafka_bootstrap: str
                                                                       ) -> None:
    name, port = container.name, container.port
    # The process itself runs as uid 10001, not only the image's metadata.
    status = docker("exec", name, "cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {USER_ID}, status

    seen: list[tuple[str, int]] = []

    def answered(path: str) -> bool:
        code = http_get(port, path)[0]
        seen.append((path, code))
        assert inspect(name)["State"]["Running"], container.logs()[-3000:]
        return code == 200

    wait_for(lambda: answered("/healthz"), 180, "/healthz to answer 200 (torch import, model load)", 0.2)
    wait_for(lambda: answered("/readyz"), 120, "/readyz to answer 200 (warmed up, partitions assigned)", 0.2)

    producer = FrameProducer(kafka_bootstrap, container.topics)
    frames = synthetic_frames(30, [(32, 32), (48, 32)], priority="realtime")
    frames += synthetic_frames(30, [(64, 48)], priority="standard")
    producer.publish(frames)
    results = ResultsReader(kafka_bootstrap, container.topics).read(len(frames), timeout_s=120)
    assert ledger(results) == {(f.stream_id, f.frame_index): 1 for f in frames}
    assert {r["worker_id"] for r in results} == {f"image-{name.rsplit('-', 1)[1]}"}

    # The image's own HEALTHCHECK (interval 15 s), as Docker runs it: healthy once a probe passed.
    def healthy() -> bool:
        health = inspect(name)["State"]["Health"]
        assert health["Status"] != "unhealthy", health
        return health["Status"] == "healthy"

    wait_for(healthy, 60, "docker's health status to turn healthy", 1.0)

    start = time.monotonic()
    docker("kill", "--signal", "TERM", name)
    code = int(docker("wait", name, timeout=GRACE_PERIOD_S + 30).stdout.strip())
    drained_in = time.monotonic() - start
    logs = container.logs()
    assert code == 0, logs[-3000:]
    assert drained_in < GRACE_PERIOD_S, f"the drain took {drained_in:.1f}s"
    assert uncommitted(kafka_bootstrap, container.topics.group, container.topics.inputs) == {}
    # `worker run` prints its summary on stdout as it exits (logs go to stderr).
    (summary,) = [json.loads(ln) for ln in docker("logs", name).stdout.splitlines() if ln.startswith('{"consumed"')]
    assert summary["results"] == len(frames), logs[-2000:]
