"""A real single-node Apache Kafka broker (KRaft, combined broker+controller) for development, the demo,
tests and CI, run with `java` from jars that Maven resolves from Maven Central. No Docker needed.

It is the real broker: consumer groups, transactions and rebalances behave as in production.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parent.parent / "deploy" / "local-kafka"
DEFAULT_STATE_DIR = Path(os.environ.get("STREAMFER_KAFKA_DIR", Path(__file__).resolve().parent.parent / ".local-kafka"))


class LocalKafkaError(RuntimeError):
    """The local broker could not be prepared or started; the message says what to install or check."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_jars(project_dir: Path = PROJECT_DIR) -> Path:
    """Resolve the broker's jars with Maven once; later calls reuse deploy/local-kafka/lib."""
    lib = project_dir / "lib"
    if lib.is_dir() and any(lib.glob("kafka_2.13-*.jar")):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise LocalKafkaError("Maven (mvn) is needed once to fetch the Kafka jars: install maven, or set "
                              "KAFKA_BOOTSTRAP_SERVERS to an existing broker")
    log.info("resolving Kafka jars with Maven into %s", lib)
    proc = subprocess.run(
        [mvn, "-q", "-B", "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={lib}"],
        cwd=project_dir, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise LocalKafkaError(f"mvn could not resolve the Kafka jars:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return lib


@dataclass
class BrokerState:
    pid: int
    port: int
    controller_port: int
    data_dir: str

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"


class LocalKafka:
    """Start, stop and restart one broker whose data, ports and pid live in `state_dir`."""

    def __init__(self, state_dir: Path | str = DEFAULT_STATE_DIR, heap_mb: int = 512) -> None:
        self.state_dir = Path(state_dir)
        self.heap_mb = heap_mb
        self._state_file = self.state_dir / "broker.json"

    # -- state -------------------------------------------------------------------------------------
    def state(self) -> BrokerState | None:
        try:
            return BrokerState(**json.loads(self._state_file.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    def running(self) -> BrokerState | None:
        st = self.state()
        if st is None or not _alive(st.pid):
            return None
        return st

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> BrokerState:
        """Start the broker (or return the running one) and wait until it answers metadata requests."""
        st = self.running()
        if st is not None:
            return st
        java = shutil.which("java")
        if java is None:
            raise LocalKafkaError("Java 17+ is needed to run the local Kafka broker (apt-get install openjdk-17-jre)")
        lib = ensure_jars()
        previous = self.state()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data_dir = self.state_dir / "data"
        # A restart keeps the data and the ports, so clients reconnect to the same address.
        if previous is not None and (data_dir / "meta.properties").exists():
            port, cport = previous.port, previous.controller_port
            if not (_port_free(port) and _port_free(cport)):
                port, cport = free_port(), free_port()
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
            port, cport = free_port(), free_port()
        props = self.state_dir / "server.properties"
        props.write_text(_server_properties(port, cport, data_dir))
        classpath = f"{lib}/*"
        if not (data_dir / "meta.properties").exists():
            cluster_id = subprocess.run([java, "-cp", classpath, "kafka.tools.StorageTool", "random-uuid"],
                                        capture_output=True, text=True, check=True).stdout.strip()
            fmt = subprocess.run([java, "-cp", classpath, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                                  "-c", str(props)], capture_output=True, text=True)
            if fmt.returncode != 0:
                raise LocalKafkaError(f"kafka storage format failed: {fmt.stderr[-2000:]}")
        with open(self.log_file, "ab") as out:
            proc = subprocess.Popen(
                [java, f"-Xmx{self.heap_mb}m", f"-Xms{self.heap_mb}m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                 "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", classpath, "kafka.Kafka", str(props)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        st = BrokerState(pid=proc.pid, port=port, controller_port=cport, data_dir=str(data_dir))
        self._state_file.write_text(json.dumps(st.__dict__))
        wait_until_ready(st.bootstrap_servers, timeout_s, alive=lambda: proc.poll() is None, log_file=self.log_file)
        log.info("local kafka ready at %s (pid %d)", st.bootstrap_servers, st.pid)
        return st

    def stop(self, kill: bool = False, timeout_s: float = 30.0) -> bool:
        """Stop the broker (SIGTERM, or SIGKILL with kill=True); data and ports are kept for a restart."""
        st = self.running()
        if st is None:
            return False
        os.kill(st.pid, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(st.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(st.pid):
            os.kill(st.pid, signal.SIGKILL)
            while _alive(st.pid):
                time.sleep(0.05)
        return True

    def destroy(self) -> None:
        """Stop the broker and delete its data."""
        self.stop(kill=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def wait_until_ready(bootstrap: str, timeout_s: float, alive=lambda: True, log_file: Path | None = None) -> None:
    """Wait until the broker answers a metadata request, failing fast if its process died."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            tail = log_file.read_text(errors="replace")[-3000:] if log_file and log_file.exists() else ""
            raise LocalKafkaError(f"the Kafka broker exited during start-up; log tail:\n{tail}")
        try:
            md = admin.list_topics(timeout=2)
            if md.brokers:
                return
        except Exception as exc:  # KafkaException while the listener is not up yet
            last_error = exc
        time.sleep(0.2)
    raise LocalKafkaError(f"Kafka at {bootstrap} not ready after {timeout_s:.0f}s ({last_error})")


def _server_properties(port: int, cport: int, data_dir: Path) -> str:
    return "\n".join([
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@127.0.0.1:{cport}",
        f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        f"log.dirs={data_dir}",
        "num.partitions=3",
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=1",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "transaction.state.log.num.partitions=1",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        # Tests create many short-lived groups and transactional ids; keep them small and quick.
        "transaction.abort.timed.out.transaction.cleanup.interval.ms=5000",
        "auto.create.topics.enable=false",
        "",
    ])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited child not yet reaped) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the JVM's listener does: a port whose old connections sit in TIME_WAIT can be listened on again.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
