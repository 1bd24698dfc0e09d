"""Shared fixtures. The broker, topics, worker, producer and reader fixtures are the test kit's
(worker/testing/plugin.py, the pytest plugin users get): one implementation for users and for us. The Kafka broker
is chosen in this order: KAFKA_BOOTSTRAP_SERVERS if set; testcontainers' Kafka where a Docker engine
answers; else the project's own local Apache Kafka (KRaft) from Maven jars."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

# Registered under the same name as the `pytest11` entry point, so an installed streamfer (which loads the
# plugin by itself) and a plain checkout both get it exactly once.
pytest_plugins = ["worker.testing.plugin"]


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]


PROJECT_ROOT = Path(__file__).resolve().parent.parent
