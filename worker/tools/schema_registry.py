"""A real Schema Registry for development, tests and CI: Apicurio Registry, which serves the Confluent API under
`/apis/ccompat/v7`, run with `java` from the ready-to-run archive Maven resolves from Maven Central once (then
unpacked under ~/.cache/streamfer), with in-memory storage, on loopback only. No Docker needed.

Version 3.0.9: its `-runner.jar` runs on Java 17 or newer (the Kafka broker's Java), where 3.3.x needs Java 21.
Run it by hand with `python -m worker.tools.schema_registry` (prints its URL, stops on Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from worker.tools.local_broker import free_port, serve_until_stopped

log = logging.getLogger(__name__)

APICURIO_VERSION = os.environ.get("STREAMFER_APICURIO_VERSION", "3.0.9")
ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
CACHE_DIR = Path(os.environ.get("STREAMFER_APICURIO_DIR",
                                Path.home() / ".cache" / "streamfer" / f"apicurio-registry-{APICURIO_VERSION}"))
# The oldest Java the 3.0.x runner jar runs on.
MIN_JAVA = 17
CCOMPAT_PATH = "/apis/ccompat/v7"
START_TIMEOUT_S = 120.0


class SchemaRegistryUnavailable(RuntimeError):
    """No Java this registry runs on: a test skips with this reason."""


class SchemaRegistryError(RuntimeError):
    """The registry could not be prepared or started; the message says what to install or check."""


def _java_major(java: str) -> int | None:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def find_java(min_major: int = MIN_JAVA) -> str | None:
    """A `java` of at least `min_major`: $JAVA_HOME's, the one on PATH, or any under /usr/lib/jvm."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(os.environ["JAVA_HOME"]) / "bin" / "java"))
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    candidates += sorted(str(p) for p in Path("/usr/lib/jvm").glob("*/bin/java"))
    for java in candidates:
        major = _java_major(java)
        if major is not None and major >= min_major:
            return java
    return None


def _launch_jar(directory: Path) -> Path | None:
    """The archive's launcher: `quarkus-run.jar` (3.1 and later) or `*-runner.jar` (3.0 and 2.x)."""
    if (directory / "quarkus-run.jar").is_file():
        return directory / "quarkus-run.jar"
    return next(iter(sorted(directory.glob("*-runner.jar"))), None)


def ensure_registry(cache_dir: Path = CACHE_DIR) -> Path:
    """The registry's launcher jar: resolved with Maven and unpacked into `cache_dir` once, reused after."""
    jar = _launch_jar(cache_dir)
    if jar is not None:
        return jar
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SchemaRegistryError(f"Maven (mvn) is needed once to fetch {ARTIFACT} from Maven Central: install "
                                  "maven, or point the tests at a running registry with STREAMFER_SCHEMA_REGISTRY_URL")
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir.parent) as tmp:
        log.info("resolving %s with Maven", ARTIFACT)
        proc = subprocess.run([mvn, "-q", "-B", "dependency:copy", f"-Dartifact={ARTIFACT}",
                               f"-DoutputDirectory={tmp}"], cwd=tmp, capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise SchemaRegistryError(f"mvn could not resolve {ARTIFACT}:\n{proc.stdout[-2000:]}\n"
                                      f"{proc.stderr[-2000:]}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(archives[0]) as tar:
            tar.extractall(unpacked, filter="data")
        if _launch_jar(unpacked) is None:
            raise SchemaRegistryError(f"{ARTIFACT} has neither quarkus-run.jar nor a -runner.jar")
        # Unpacked aside, then renamed: a half-unpacked archive is never taken for a ready one.
        os.replace(unpacked, cache_dir)
    jar = _launch_jar(cache_dir)
    assert jar is not None
    return jar


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/subjects", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class LocalSchemaRegistry:
    """One Apicurio Registry process on loopback with in-memory storage (all schemas go when it stops)."""

    def __init__(self, log_dir: Path, heap_mb: int = 384) -> None:
        self.log_dir = Path(log_dir)
        self.heap_mb = heap_mb
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """The Confluent-API base URL clients take (schema_registry.url)."""
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def pid(self) -> int:
        """The running registry's process id (a test freezes it with SIGSTOP to play an outage)."""
        if self._proc is None:
            raise SchemaRegistryError("the registry is not running")
        return self._proc.pid

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        java = find_java()
        if java is None:
            raise SchemaRegistryUnavailable(f"no Java {MIN_JAVA}+ found (JAVA_HOME, PATH, /usr/lib/jvm): Apicurio "
                                            f"Registry {APICURIO_VERSION} needs one")
        jar = ensure_registry()
        self.port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_dir / "schema-registry.log", "ab")
        cmd = [java, f"-Xmx{self.heap_mb}m", f"-Dquarkus.http.port={self.port}", "-Dquarkus.http.host=127.0.0.1",
               # Quarkus's management interface would listen on 0.0.0.0:9000: loopback and a free port instead.
               "-Dquarkus.management.host=127.0.0.1", f"-Dquarkus.management.port={free_port()}",
               "-jar", str(jar)]
        started = time.monotonic()
        self._proc = subprocess.Popen(cmd, cwd=jar.parent, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        while not _answers(self.url):
            if self._proc.poll() is not None:
                raise SchemaRegistryError(f"Apicurio Registry exited with {self._proc.returncode} while starting:\n"
                                          f"{self._log_tail()}")
            if time.monotonic() - started > timeout_s:
                self.stop()
                raise SchemaRegistryError(f"Apicurio Registry did not answer within {timeout_s:.0f} s:\n"
                                          f"{self._log_tail()}")
            time.sleep(0.1)
        log.info("Apicurio Registry %s up at %s in %.1f s", APICURIO_VERSION, self.url, time.monotonic() - started)
        return self.url

    def _log_tail(self) -> str:
        try:
            return (self.log_dir / "schema-registry.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalSchemaRegistry:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextmanager
def schema_registry(log_dir: Path) -> Iterator[str]:
    """The URL of a Schema Registry: STREAMFER_SCHEMA_REGISTRY_URL when set (the caller's own), else a local
    Apicurio Registry started here and stopped after."""
    url = os.environ.get("STREAMFER_SCHEMA_REGISTRY_URL")
    if url:
        yield url
        return
    with LocalSchemaRegistry(log_dir) as registry:
        yield registry.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run a local Apicurio Registry (Confluent API) until Ctrl-C")
    parser.add_argument("--fetch-only", action="store_true", help="resolve and unpack it with Maven, then exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.fetch_only:
        print(ensure_registry())
        return 0
    with LocalSchemaRegistry(Path(tempfile.mkdtemp(prefix="streamfer-registry-"))) as registry:
        print(registry.url, flush=True)
        serve_until_stopped()
    return 0


if __name__ == "__main__":
    sys.exit(main())
