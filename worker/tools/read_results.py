"""Reading moderation results (and dead letters) back: for `worker results`, the demo and the tests'
verifier. Reads committed messages only, from the beginning of every partition, without joining a group
(worker.kafka.roles.result_reader), with the [kafka] settings given, or from a bare bootstrap address.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

from worker.codec.schemas import decode_result
from worker.kafka.client import Cluster
from worker.kafka.roles import result_reader


@dataclass(frozen=True)
class DeadLetterRecord:
    key: bytes | None
    value: bytes
    headers: dict[str, str]


def _consumer(cluster: Cluster, topic: str) -> Any:
    consumer = result_reader(cluster)
    md = consumer.list_topics(topic, timeout=10)
    partitions = md.topics[topic].partitions if topic in md.topics else {}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    return consumer


def iter_messages(cluster: Cluster, topic: str, count: int | None = None, idle_timeout_s: float = 5.0,
                  follow: bool = False, timeout_s: float | None = None) -> Iterator[Any]:
    """Yield raw messages until `count` are read, or (unless `follow`) all partitions hit their end and
    nothing new came for `idle_timeout_s`. Raises TimeoutError after `timeout_s` in total."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    consumer = _consumer(cluster, topic)
    n_parts = len(consumer.assignment())
    at_end: set[int] = set()
    seen = 0
    last = time.monotonic()
    try:
        while count is None or seen < count:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"read {seen} messages from {topic} in {timeout_s}s, expected more")
            msg = consumer.poll(0.2)
            if msg is None:
                if not follow and len(at_end) >= n_parts and time.monotonic() - last >= idle_timeout_s:
                    return
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition() or 0)
                    continue
                raise RuntimeError(err.str())
            at_end.discard(msg.partition())
            last = time.monotonic()
            seen += 1
            yield msg
    finally:
        consumer.close()


def result_filter(verdicts: Sequence[str] | None = None, tenants: Sequence[str] | None = None
                  ) -> Callable[[dict[str, Any]], bool] | None:
    """`worker results --verdict V --tenant T`: whether a decoded result is shown (None: every result is)."""
    if not verdicts and not tenants:
        return None
    wanted_verdicts, wanted_tenants = set(verdicts or ()), set(tenants or ())

    def keep(result: dict[str, Any]) -> bool:
        return ((not wanted_verdicts or result.get("verdict") in wanted_verdicts)
                and (not wanted_tenants or result.get("tenant") in wanted_tenants))

    return keep


def read_results(cluster: Cluster, topic: str = "moderation.results", count: int | None = None,
                 idle_timeout_s: float = 5.0, until: Callable[[list[dict[str, Any]]], bool] | None = None,
                 timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """All decoded results; stops early once `until(results)` is true, raises TimeoutError past timeout_s."""
    out: list[dict[str, Any]] = []
    for msg in iter_messages(cluster, topic, count, idle_timeout_s, follow=until is not None, timeout_s=timeout_s):
        out.append(decode_result(msg.value()))
        if until is not None and until(out):
            break
    return out


def read_dead_letters(cluster: Cluster, topic: str = "frames.dlq", idle_timeout_s: float = 3.0
                      ) -> list[DeadLetterRecord]:
    return [DeadLetterRecord(key=m.key(), value=m.value() or b"",
                             headers={k: (v or b"").decode(errors="replace") for k, v in (m.headers() or [])})
            for m in iter_messages(cluster, topic, None, idle_timeout_s)]
