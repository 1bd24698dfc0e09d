"""A real single-node Apache Kafka broker (KRaft, combined broker+controller) for development, the demo,
tests and CI, run with `java` from jars that Maven resolves from Maven Central. No Docker needed.

It is the real broker: consumer groups, transactions and rebalances behave as in production.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding, AclBindingFilter, AdminClient

    from worker.config import KafkaSettings
    from worker.kafka.client import Cluster

log = logging.getLogger(__name__)

# The source checkout's root: this file is worker/tools/local_broker.py.
ROOT_DIR = Path(__file__).resolve().parents[2]
PROJECT_DIR = ROOT_DIR / "deploy" / "local-kafka"
DEFAULT_STATE_DIR = Path(os.environ.get("STREAMFER_KAFKA_DIR", ROOT_DIR / ".local-kafka"))


class LocalKafkaError(RuntimeError):
    """The local broker could not be prepared or started; the message says what to install or check."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_until_stopped() -> None:
    """Block until SIGINT or SIGTERM (both raised as KeyboardInterrupt and caught here), so that the caller's `with`
    stops the server it runs and the process exits 0: the foreground mode of a local server's command."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


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


SECURITY_MODES = ("plaintext", "sasl_plaintext", "sasl_ssl", "ssl")
# The broker's own principal (inter-broker and controller traffic on its loopback PLAINTEXT listeners), and
# the SCRAM users created when the storage is formatted.
BROKER_PRINCIPAL = "User:ANONYMOUS"
ADMIN_USER = "admin"
WORKER_USER = "streamfer"
SCRAM_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
CLIENT_CERT_CN = "streamfer-client"
ADMIN_CERT_CN = "streamfer-admin"


@dataclass
class BrokerState:
    """Where a local broker (or cluster) listens and runs; `pid`/`port` are node 1's, the lists every node's."""

    pid: int
    port: int
    controller_port: int
    data_dir: str
    security: str = "plaintext"
    pids: list[int] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    controller_ports: list[int] = field(default_factory=list)
    internal_ports: list[int] = field(default_factory=list)

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in (self.ports or [self.port]))

    @property
    def nodes(self) -> int:
        return max(1, len(self.ports))


class LocalKafka:
    """Start, stop and restart one broker, or a KRaft quorum of `nodes` combined broker+controller nodes, whose
    data, ports and pids live in `state_dir`.

    `security` chooses the clients' listener: plaintext (no authentication, no ACLs), or sasl_plaintext /
    sasl_ssl (SCRAM users `admin`, a super user, and `streamfer`, with no ACLs) or ssl (TLS client
    certificates: `User:CN=streamfer-admin`, a super user, and `User:CN=streamfer-client`), all three with the
    StandardAuthorizer. The nodes talk to each other on loopback PLAINTEXT listeners as `User:ANONYMOUS`, a
    super user: a development broker.
    """

    def __init__(self, state_dir: Path | str = DEFAULT_STATE_DIR, heap_mb: int = 512, security: str = "plaintext",
                 nodes: int = 1) -> None:
        if security not in SECURITY_MODES:
            raise LocalKafkaError(f"security must be one of {', '.join(SECURITY_MODES)}, not {security!r}")
        if nodes not in (1, 3):
            raise LocalKafkaError("nodes must be 1 or 3 (a KRaft quorum of three tolerates one node down)")
        self.state_dir = Path(state_dir)
        self.heap_mb = heap_mb
        self.nodes = nodes
        self._state_file = self.state_dir / "broker.json"
        previous = self.state()
        # A state dir remembers how it was made: restarting it keeps its security and size.
        self.security = previous.security if previous is not None else security
        if previous is not None:
            self.nodes = previous.nodes

    # -- state -------------------------------------------------------------------------------------
    def state(self) -> BrokerState | None:
        try:
            return BrokerState(**json.loads(self._state_file.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    def running(self) -> BrokerState | None:
        """The state while any node runs (node 1 alone for a single broker)."""
        st = self.state()
        if st is None or not any(_alive(pid) for pid in (st.pids or [st.pid])):
            return None
        return st

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    def node_log_file(self, node_id: int) -> Path:
        return self.log_file if self.nodes == 1 else self.state_dir / f"node{node_id}.log"

    def _data_dir(self, node_id: int) -> Path:
        return self.state_dir / "data" if self.nodes == 1 else self.state_dir / f"node{node_id}"

    # -- clients ---------------------------------------------------------------------------------------
    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    def password_file(self, user: str = WORKER_USER) -> Path:
        """A file holding the SCRAM password of `user` (for kafka.sasl_password_file)."""
        return self.state_dir / "secrets" / f"{user}.password"

    def kafka_settings(self, user: str = ADMIN_USER, mechanism: str = "SCRAM-SHA-512") -> KafkaSettings:
        """The [kafka] settings that reach this broker as `user`, passwords by file (as the worker's are)."""
        from worker.config import KafkaSettings

        st = self.state()
        if st is None:
            raise LocalKafkaError("the local broker has never been started")
        k = KafkaSettings(bootstrap_servers=st.bootstrap_servers)
        if self.security == "plaintext":
            return k
        fields: dict[str, Any] = {"security_protocol": self.security.upper()}
        if self.security.startswith("sasl"):
            fields.update(sasl_mechanism=mechanism, sasl_username=user,
                          sasl_password_file=str(self.password_file(user)))
        if self.security.endswith("ssl"):
            fields["ssl_ca_location"] = str(self.tls_dir / "ca.pem")
        if self.security == "ssl":
            fields.update(ssl_certificate_location=str(self.tls_dir / f"{user}.pem"),
                          ssl_key_location=str(self.tls_dir / f"{user}.key"),
                          ssl_key_password_file=str(self.tls_dir / f"{user}.key.password"))
        return dataclasses.replace(k, **fields)

    def client_properties(self, user: str = ADMIN_USER, mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
        """librdkafka properties that reach this broker as `user` (bootstrap.servers not included)."""
        from worker.kafka.client import security_properties

        return security_properties(self.kafka_settings(user, mechanism))

    def worker_env(self, user: str = WORKER_USER, mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
        """WORKER_KAFKA_* settings that reach this broker as `user`, passwords by file (never by value)."""
        env: dict[str, str] = {}
        if self.security == "plaintext":
            return env
        env["WORKER_KAFKA_SECURITY_PROTOCOL"] = self.security.upper()
        if self.security.startswith("sasl"):
            env.update({"WORKER_KAFKA_SASL_MECHANISM": mechanism, "WORKER_KAFKA_SASL_USERNAME": user,
                        "WORKER_KAFKA_SASL_PASSWORD_FILE": str(self.password_file(user))})
        if self.security.endswith("ssl"):
            env["WORKER_KAFKA_SSL_CA_LOCATION"] = str(self.tls_dir / "ca.pem")
        if self.security == "ssl":
            env.update({"WORKER_KAFKA_SSL_CERTIFICATE_LOCATION": str(self.tls_dir / f"{user}.pem"),
                        "WORKER_KAFKA_SSL_KEY_LOCATION": str(self.tls_dir / f"{user}.key"),
                        "WORKER_KAFKA_SSL_KEY_PASSWORD_FILE": str(self.tls_dir / f"{user}.key.password")})
        return env

    def admin(self) -> AdminClient:
        """An admin client as the super user `admin`."""
        from worker.kafka.roles import admin_client

        return admin_client(self.kafka_settings(), log_level=0)

    # -- ACLs and users ----------------------------------------------------------------------------------
    def create_acls(self, acls: list[AclBinding], timeout_s: float = 30.0) -> None:
        """Grant ACLs (as the super user `admin`); they apply on every node within a moment."""
        if not acls:
            return
        admin = self.admin()  # kept alive until the futures resolve
        for fut in admin.create_acls(acls, request_timeout=timeout_s).values():
            fut.result(timeout_s)

    def delete_acls(self, filters: list[AclBindingFilter], timeout_s: float = 30.0) -> int:
        """Remove the ACLs matching these filters; returns how many were removed."""
        if not filters:
            return 0
        removed = 0
        admin = self.admin()
        for fut in admin.delete_acls(filters, request_timeout=timeout_s).values():
            removed += len(fut.result(timeout_s))
        return removed

    def add_user(self, name: str, password: str, timeout_s: float = 30.0) -> None:
        """Create (or change) a SCRAM user with both mechanisms; its password is written to password_file."""
        from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

        upserts = [UserScramCredentialUpsertion(name, ScramCredentialInfo(getattr(ScramMechanism, m.replace("-", "_")),
                                                                         8192), password.encode())
                   for m in SCRAM_MECHANISMS]
        admin = self.admin()
        for fut in admin.alter_user_scram_credentials(list(upserts), request_timeout=timeout_s).values():
            fut.result(timeout_s)
        _write_secret(self.password_file(name), password)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> BrokerState:
        """Start every node not running (or return the running cluster) and wait until clients are served."""
        st = self.running()
        if st is not None and all(_alive(pid) for pid in (st.pids or [st.pid])):
            return st
        java = shutil.which("java")
        if java is None:
            raise LocalKafkaError("Java 17+ is needed to run the local Kafka broker (apt-get install openjdk-17-jre)")
        lib = ensure_jars()
        previous = self.state()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        formatted = (self._data_dir(1) / "meta.properties").exists()
        # A restart keeps the data and the ports, so clients reconnect to the same address.
        if previous is not None and formatted:
            ports = previous.ports or [previous.port]
            cports = previous.controller_ports or [previous.controller_port]
            iports = previous.internal_ports or [0] * len(ports)
            pids = previous.pids or [previous.pid]
        else:
            for n in range(1, self.nodes + 1):
                shutil.rmtree(self._data_dir(n), ignore_errors=True)
            ports = [free_port() for _ in range(self.nodes)]
            cports = [free_port() for _ in range(self.nodes)]
            iports = [free_port() if self.security != "plaintext" else 0 for _ in range(self.nodes)]
            pids = [0] * self.nodes
            if self.security != "plaintext":
                self._make_credentials()
        classpath = f"{lib}/*"
        cluster_id = ""
        procs: dict[int, subprocess.Popen] = {}
        for i in range(self.nodes):
            node_id = i + 1
            if pids[i] and _alive(pids[i]):
                continue
            wanted = [ports[i], cports[i]] + ([iports[i]] if iports[i] else [])
            if not all(_port_free(p) for p in wanted):
                if self.nodes > 1:
                    raise LocalKafkaError(f"node {node_id}'s ports {wanted} are taken; destroy the cluster")
                ports[i], cports[i] = free_port(), free_port()
                iports[i] = free_port() if iports[i] else 0
            props = self.state_dir / f"server{node_id if self.nodes > 1 else ''}.properties"
            props.write_text(self._server_properties(node_id, ports, cports, iports))
            if not (self._data_dir(node_id) / "meta.properties").exists():
                if not cluster_id:
                    cluster_id = subprocess.run([java, "-cp", classpath, "kafka.tools.StorageTool", "random-uuid"],
                                                capture_output=True, text=True, check=True).stdout.strip()
                fmt = subprocess.run([java, "-Xmx256m", "-cp", classpath, "kafka.tools.StorageTool", "format",
                                      "-t", cluster_id, "-c", str(props), *self._scram_args()],
                                     capture_output=True, text=True)
                if fmt.returncode != 0:
                    raise LocalKafkaError(f"kafka storage format failed: {fmt.stderr[-2000:]}")
            with open(self.node_log_file(node_id), "ab") as out:
                procs[node_id] = subprocess.Popen(
                    [java, f"-Xmx{self.heap_mb}m", f"-Xms{self.heap_mb}m", "-XX:+UseG1GC",
                     "-XX:MaxGCPauseMillis=20", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", classpath,
                     "kafka.Kafka", str(props)],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            pids[i] = procs[node_id].pid
        st = BrokerState(pid=pids[0], port=ports[0], controller_port=cports[0], data_dir=str(self._data_dir(1)),
                         security=self.security, pids=pids, ports=ports, controller_ports=cports,
                         internal_ports=iports)
        self._state_file.write_text(json.dumps(st.__dict__))
        wait_until_ready(self.kafka_settings(), timeout_s, alive=lambda: all(p.poll() is None for p in procs.values()),
                         log_file=self.node_log_file(min(procs) if procs else 1), brokers=self.nodes)
        log.info("local kafka ready at %s (pids %s, security %s)", st.bootstrap_servers, pids, self.security)
        return st

    def stop(self, kill: bool = False, timeout_s: float = 30.0) -> bool:
        """Stop every node (SIGTERM, or SIGKILL with kill=True); data and ports are kept for a restart."""
        st = self.running()
        if st is None:
            return False
        for node_id in range(1, st.nodes + 1):
            self.stop_node(node_id, kill=kill, timeout_s=timeout_s)
        return True

    def stop_node(self, node_id: int, kill: bool = False, timeout_s: float = 30.0) -> bool:
        """Stop one node (a cluster keeps serving with the other two); `start()` brings it back."""
        st = self.state()
        pids = (st.pids or [st.pid]) if st else []
        if not 1 <= node_id <= len(pids) or not _alive(pids[node_id - 1]):
            return False
        pid = pids[node_id - 1]
        os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
        return True

    def destroy(self) -> None:
        """Stop the broker and delete its data."""
        self.stop(kill=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    # -- configuration -----------------------------------------------------------------------------------
    def _server_properties(self, node_id: int, ports: list[int], cports: list[int], iports: list[int]) -> str:
        i = node_id - 1
        rf = 3 if self.nodes == 3 else 1
        voters = ",".join(f"{n + 1}@127.0.0.1:{c}" for n, c in enumerate(cports))
        data_dir = self._data_dir(node_id)
        lines = ["process.roles=broker,controller", f"node.id={node_id}", f"controller.quorum.voters={voters}",
                 "controller.listener.names=CONTROLLER", f"log.dirs={data_dir}"]
        if self.security == "plaintext":
            lines += [f"listeners=PLAINTEXT://127.0.0.1:{ports[i]},CONTROLLER://127.0.0.1:{cports[i]}",
                      f"advertised.listeners=PLAINTEXT://127.0.0.1:{ports[i]}",
                      "inter.broker.listener.name=PLAINTEXT",
                      "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"]
        else:
            tls = self.tls_dir
            lines += [f"listeners=CLIENT://127.0.0.1:{ports[i]},INTERNAL://127.0.0.1:{iports[i]},"
                      f"CONTROLLER://127.0.0.1:{cports[i]}",
                      f"advertised.listeners=CLIENT://127.0.0.1:{ports[i]},INTERNAL://127.0.0.1:{iports[i]}",
                      "inter.broker.listener.name=INTERNAL",
                      "listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,"
                      f"CLIENT:{self.security.upper()}",
                      "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                      f"super.users=User:{ADMIN_USER};User:CN={ADMIN_CERT_CN};{BROKER_PRINCIPAL}"]
            if self.security.startswith("sasl"):
                lines.append(f"listener.name.client.sasl.enabled.mechanisms={','.join(SCRAM_MECHANISMS)}")
                lines += [f"listener.name.client.{m.lower()}.sasl.jaas.config="
                          "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                          for m in SCRAM_MECHANISMS]
            if self.security.endswith("ssl"):
                lines += ["listener.name.client.ssl.keystore.type=PEM",
                          f"listener.name.client.ssl.keystore.location={tls / 'broker.keystore.pem'}",
                          "listener.name.client.ssl.truststore.type=PEM",
                          f"listener.name.client.ssl.truststore.location={tls / 'ca.pem'}"]
            if self.security == "ssl":
                lines.append("listener.name.client.ssl.client.auth=required")
        lines += [
            "num.partitions=3",
            f"default.replication.factor={rf}",
            f"min.insync.replicas={2 if rf == 3 else 1}",
            f"offsets.topic.replication.factor={rf}",
            "offsets.topic.num.partitions=1",
            f"transaction.state.log.replication.factor={rf}",
            f"transaction.state.log.min.isr={2 if rf == 3 else 1}",
            "transaction.state.log.num.partitions=1",
            f"share.coordinator.state.topic.replication.factor={rf}",
            f"share.coordinator.state.topic.min.isr={2 if rf == 3 else 1}",
            "group.initial.rebalance.delay.ms=0",
            # Tests create many short-lived groups and transactional ids; keep them small and quick.
            "transaction.abort.timed.out.transaction.cleanup.interval.ms=5000",
            "auto.create.topics.enable=false",
            "",
        ]
        return "\n".join(lines)

    def _scram_args(self) -> list[str]:
        if not self.security.startswith("sasl"):
            return []
        args = []
        for user in (ADMIN_USER, WORKER_USER):
            password = self.password_file(user).read_text().strip()
            for mechanism in SCRAM_MECHANISMS:
                args += ["--add-scram", f"{mechanism}=[name={user},password={password}]"]
        return args

    def _make_credentials(self) -> None:
        """Random SCRAM passwords, and for TLS a CA, a broker certificate (127.0.0.1, localhost) and a client
        certificate whose key is encrypted with a password; all under the state dir, readable by its owner only."""
        for user in (ADMIN_USER, WORKER_USER):
            _write_secret(self.password_file(user), secrets.token_urlsafe(18))
        if not self.security.endswith("ssl"):
            return
        openssl = shutil.which("openssl")
        if openssl is None:
            raise LocalKafkaError("openssl is needed to make the local broker's TLS certificates")
        d = self.tls_dir
        d.mkdir(parents=True, exist_ok=True)

        def run(*args: str) -> None:
            proc = subprocess.run([openssl, *args], cwd=d, capture_output=True, text=True)
            if proc.returncode != 0:
                raise LocalKafkaError(f"openssl {args[0]} failed: {proc.stderr[-1500:]}")

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "3650",
            "-subj", "/CN=streamfer-local-ca")
        (d / "broker.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
            "-subj", "/CN=localhost")
        run("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "broker.pem", "-days", "3650", "-extfile", "broker.ext")
        # Kafka's PEM keystore: the (PKCS#8) private key, then the certificate chain.
        (d / "broker.keystore.pem").write_text((d / "broker.key").read_text() + (d / "broker.pem").read_text()
                                               + (d / "ca.pem").read_text())
        # One client certificate per user (the admin's is a super user's), each key encrypted with a password.
        for user, cn in ((ADMIN_USER, ADMIN_CERT_CN), (WORKER_USER, CLIENT_CERT_CN)):
            _write_secret(d / f"{user}.key.password", secrets.token_urlsafe(12))
            run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{user}.plain.key", "-out", f"{user}.csr",
                "-subj", f"/CN={cn}")
            run("x509", "-req", "-in", f"{user}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{user}.pem", "-days", "3650")
            run("pkey", "-in", f"{user}.plain.key", "-aes256", "-passout", f"file:{user}.key.password",
                "-out", f"{user}.key")
            (d / f"{user}.plain.key").unlink()
            os.chmod(d / f"{user}.key", 0o600)
        for name in ("ca.key", "broker.key", "broker.keystore.pem"):
            os.chmod(d / name, 0o600)


def wait_until_ready(cluster: Cluster, timeout_s: float, alive: Callable[[], bool] = lambda: True,
                     log_file: Path | None = None, brokers: int = 1) -> None:
    """Wait until `brokers` nodes answer a metadata request, failing fast if a process died."""
    from worker.kafka.client import bootstrap_of
    from worker.kafka.roles import admin_client

    bootstrap = bootstrap_of(cluster)
    admin = admin_client(cluster, log_level=0)
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            tail = log_file.read_text(errors="replace")[-3000:] if log_file and log_file.exists() else ""
            raise LocalKafkaError(f"the Kafka broker exited during start-up; log tail:\n{tail}")
        try:
            md = admin.list_topics(timeout=2)
            if len(md.brokers) >= brokers:
                return
        except Exception as exc:  # noqa: BLE001 ( KafkaException while the listener is not up yet)
            last_error = exc
        time.sleep(0.2)
    raise LocalKafkaError(f"Kafka at {bootstrap} not ready after {timeout_s:.0f}s ({last_error})")


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")


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
