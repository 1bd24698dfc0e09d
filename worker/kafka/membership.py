"""The worker's place in its consumer group: joining, rejoining after the broker fenced it, leaving on a stop.

With static membership (`kafka.static_membership`, KIP-345) the consumer's group.instance.id is the worker id, so a
process restarted under the same id takes its predecessor's place and partitions at once. Two things follow:

- A static member does not leave the group when it closes: its partitions would wait out the session. A graceful
  stop therefore unsubscribes first and serves the final revoke; librdkafka sends a static member's LeaveGroup then.
- The broker fences a static member (FENCED_INSTANCE_ID, fatal to a librdkafka consumer) when another consumer joins
  under its id, and also when the member itself comes back after its session expired (a process frozen past
  `kafka.session_timeout_ms`: SIGSTOP, a paused VM). Its partitions are lost either way. The second is survived:
  a new consumer joins under the same id. A second fence soon after means two processes share one worker id,
  which no restart fixes: the worker stops, naming the setting.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from worker.config import Settings
from worker.errors import OperatorError, StreamferError
from worker.frames import TP

log = logging.getLogger(__name__)

# How long a graceful stop waits for the revoke that lets a static member leave the group.
LEAVE_GROUP_TIMEOUT_S = 5.0
# A fence this soon after the last one comes from another process under the same id, not from a frozen past.
REFENCED_WITHIN_S = 60.0

RebalanceCallback = Callable[[Any, list[TopicPartition]], None]


class SourceError(StreamferError):
    """The consumer hit an error it cannot continue from (bad config, fatal broker error)."""


def is_fenced_instance(err: KafkaError) -> bool:
    """Whether a fatal consumer error is the broker fencing this static member (librdkafka reports it as _FATAL,
    naming the underlying error only in its text)."""
    return KafkaError(KafkaError.FENCED_INSTANCE_ID).str() in err.str()


class GroupMembership:
    """Owns the consumer (replaced after a fence) and its subscription; counts the revokes served, for `leave`."""

    def __init__(self, settings: Settings, make_consumer: Callable[[], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._make_consumer = make_consumer
        self._static = settings.kafka.static_membership
        self._group_id = settings.kafka.group_id
        self._worker_id = settings.observability.worker_id
        self._clock = clock
        self.consumer = make_consumer()
        self._subscription: tuple[list[str], dict[str, RebalanceCallback]] | None = None
        self._revokes = 0
        self._fenced_at: float | None = None

    def subscribe(self, topics: list[str], on_assign: RebalanceCallback, on_revoke: RebalanceCallback,
                  on_lost: RebalanceCallback) -> None:
        def revoked(consumer: Any, partitions: list[TopicPartition]) -> None:
            self._revokes += 1
            on_revoke(consumer, partitions)

        def lost(consumer: Any, partitions: list[TopicPartition]) -> None:
            self._revokes += 1
            on_lost(consumer, partitions)

        self._subscription = (topics, {"on_assign": on_assign, "on_revoke": revoked, "on_lost": lost})
        self.consumer.subscribe(topics, **self._subscription[1])

    def on_fatal_error(self, err: KafkaError, held: list[TP]) -> None:
        """A fatal consumer error: after a first fence, the partitions still `held` are lost (through the
        subscription's lost callback) and a new consumer joins under the same id; anything else stops the worker."""
        if not (self._static and is_fenced_instance(err)):
            raise SourceError(f"fatal consumer error: {err.str()}")
        now = self._clock()
        if self._fenced_at is not None and now - self._fenced_at < REFENCED_WITHIN_S:
            raise OperatorError(
                f"the broker fenced this consumer twice within {REFENCED_WITHIN_S:.0f} s: another consumer joins group "
                f"{self._group_id!r} as {self._worker_id!r} (the worker id is the group.instance.id), so two processes "
                "share one observability.worker_id. Give each its own (the default <hostname>-<slot> is unique on a "
                "host), or set kafka.static_membership = false", setting="observability.worker_id")
        self._fenced_at = now
        log.warning("the broker fenced this static member (%s): its session expired while the process was stopped, "
                    "or another process uses worker id %r; its partitions are lost, rejoining under a new consumer",
                    err.str(), self._worker_id)
        if held and self._subscription is not None:
            self._subscription[1]["on_lost"](self.consumer, [TopicPartition(t, p) for t, p in held])
        with contextlib.suppress(KafkaException):
            self.consumer.close()
        self.consumer = self._make_consumer()
        if self._subscription is not None:
            topics, callbacks = self._subscription
            self.consumer.subscribe(topics, **callbacks)

    def close(self, holds_partitions: bool) -> None:
        """Leave the group and close the consumer. A killed process never gets here: its partitions wait for its
        successor, which (a static member under the same id) takes its place at once."""
        try:
            if self._static and holds_partitions:
                self._leave()
        finally:
            self.consumer.close()

    def _leave(self) -> None:
        revokes = self._revokes
        try:
            self.consumer.unsubscribe()
        except KafkaException as exc:  # a consumer already failed (fatal): its error is the one to report
            log.warning("could not leave the group: %s", exc)
            return
        deadline = time.monotonic() + LEAVE_GROUP_TIMEOUT_S
        while self._revokes == revokes:
            if time.monotonic() >= deadline:
                log.warning("leaving the group: no revoke within %.0f s; the partitions wait out the session",
                            LEAVE_GROUP_TIMEOUT_S)
                return
            # Nothing is read after an unsubscribe; a message fetched before it is dropped, uncommitted.
            for msg in self.consumer.consume(num_messages=100, timeout=0.05):
                if msg.error() is not None:
                    log.warning("leaving the group: %s", msg.error())
