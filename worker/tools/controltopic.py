"""What the operator's commands (`worker policy`, `worker rollout`) do on the control topic: read it to its end, and
write one record as the operator, each through worker.kafka.control's reader and writer."""

from __future__ import annotations

import getpass
import socket
import time

from worker.config import ConfigError, Settings
from worker.control.records import ControlRecord
from worker.kafka.control import ControlReader, ControlWriter


def read_control(settings: Settings, required: bool = True) -> ControlReader:
    """The control topic read to its end (the reader closed; its `state` holds the last record per key). `required`:
    a missing topic is a ConfigError saying how to create it; otherwise the state stays empty."""
    reader = ControlReader(settings)
    try:
        reader.read_to_end()
    finally:
        reader.close()
    if required and not reader.assigned:
        raise ConfigError([f"topics.control: the control topic {settings.topics.control} does not exist (create it "
                           "with `worker topics`)"])
    return reader


def operator(written_by: str | None = None) -> str:
    """Who writes a record: `written_by`, else `<user>@<host>`."""
    return written_by or f"{getpass.getuser()}@{socket.gethostname()}"


def now_ms() -> int:
    return int(time.time() * 1000)


def write_control(settings: Settings, key: str, record: ControlRecord) -> None:
    """One record under `key`, acknowledged by the broker (an OperatorError when refused)."""
    writer = ControlWriter(settings)
    try:
        writer.write(key, record)
    finally:
        writer.close()
