"""ResultSink's guard around librdkafka's blocking transactional calls. librdkafka can block in
send_offsets_to_transaction past its timeout after a broker restart (issues #5456, #5511; reproduced by
tests/reliability/test_broker_faults.py against a real broker); here a fake producer blocks on purpose so the
guard is tested in milliseconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError, KafkaException

import worker.kafka.producer as sink_module
from worker.config import Settings
from worker.frames import DeadLetter, SourceRef
from worker.kafka.producer import DeliveryReports, Refusal, ResultSink, SinkError, TransactionStuckError
from worker.testing import FakeProducer as KitProducer


@dataclass
class FakeProducer:
    release: threading.Event = field(default_factory=threading.Event)
    block_send_offsets: bool = False
    commit_errors: list[KafkaError] = field(default_factory=list)
    init_errors: list[KafkaError] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    # Delivery reports poll() serves: each produced message's callback with the next of these errors (None: ok).
    report_errors: list[KafkaError | None] = field(default_factory=list)
    _unreported: list[Callable[[KafkaError | None, object], None]] = field(default_factory=list)

    def produce(self, topic: str, value: bytes, key: bytes | None, headers: object,
                on_delivery: Callable[[KafkaError | None, object], None]) -> None:
        self._unreported.append(on_delivery)

    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")
        if self.init_errors:
            raise KafkaException(self.init_errors.pop(0))

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets: object, metadata: object, timeout: float) -> None:
        self.calls.append("send_offsets")
        if self.block_send_offsets:
            self.release.wait()  # as librdkafka does when its coordinator request is never re-triggered

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        if self.commit_errors:
            raise KafkaException(self.commit_errors.pop(0))

    def flush(self, timeout: float) -> int:
        self.calls.append("flush")
        return 0

    def poll(self, timeout: float) -> int:
        served, self._unreported = self._unreported, []
        for on_delivery in served:
            on_delivery(self.report_errors.pop(0) if self.report_errors else None, None)
        return len(served)

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")


@pytest.fixture
def producer():
    fake = FakeProducer()
    yield fake
    fake.release.set()  # let an abandoned call's thread end


def transactional_sink(producer: FakeProducer, sleep: Callable[[float], None] = time.sleep) -> ResultSink:
    """A transactional sink over the fake producer; a call stuck past its timeout is given up 0.05 s later."""
    return ResultSink(Settings(), transactional_id="streamfer-w0", producer_factory=lambda conf, logger=None: producer,
                      stuck_grace_s=0.05, sleep=sleep)


def test_a_call_blocked_past_its_timeout_raises_instead_of_hanging(producer: FakeProducer) -> None:
    producer.block_send_offsets = True
    sink = transactional_sink(producer)
    sink.begin()
    started = time.monotonic()
    with pytest.raises(TransactionStuckError, match="still blocked"):
        sink.send_offsets({("frames.standard", 0): 5}, object(), timeout_s=0.1)
    assert time.monotonic() - started < 5.0
    assert sink.stuck
    sink.close()  # a stuck producer is abandoned: flushing it could block as well
    assert "flush" not in producer.calls and "commit" not in producer.calls


def test_a_retriable_commit_error_is_retried_until_it_succeeds(producer: FakeProducer) -> None:
    producer.commit_errors = [KafkaError(KafkaError._TIMED_OUT, retriable=True)] * 2
    sink = transactional_sink(producer)
    sink.begin()
    sink.send_offsets({("frames.standard", 0): 5}, object(), timeout_s=5.0)
    sink.commit_transaction(timeout_s=5.0)
    assert producer.calls.count("commit") == 3 and not sink.stuck


def test_a_commit_still_failing_at_its_deadline_has_an_unknown_outcome(producer: FakeProducer) -> None:
    producer.commit_errors = [KafkaError(KafkaError._TIMED_OUT, retriable=True)] * 1000
    sink = transactional_sink(producer)
    sink.begin()
    with pytest.raises(TransactionStuckError, match="still fails"):
        sink.commit_transaction(timeout_s=0.3)
    assert sink.stuck


def test_an_abortable_error_is_left_to_the_caller_to_abort(producer: FakeProducer) -> None:
    producer.commit_errors = [KafkaError(KafkaError._TIMED_OUT, retriable=True, txn_requires_abort=True)]
    sink = transactional_sink(producer)
    sink.begin()
    with pytest.raises(KafkaException) as info:
        sink.commit_transaction(timeout_s=5.0)
    assert info.value.args[0].txn_requires_abort() and not sink.stuck


def test_a_transaction_with_a_refused_message_is_given_up_not_aborted_even_when_its_report_comes_late(
        producer: FakeProducer) -> None:
    """commit_transaction can fail before the refused message's delivery report is served; aborting then makes
    librdkafka bump the epoch in the background, which can fence the producer that replaces this one."""
    refused = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    producer.report_errors = [None, refused]
    producer.commit_errors = [KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, txn_requires_abort=True)]
    sink = transactional_sink(producer)
    sink.begin()
    for offset in (1, 2):
        sink.send_result(SourceRef("frames.standard", 0, offset), b"k", b"v")
    with pytest.raises(TransactionStuckError, match="refused a message"):
        sink.commit_transaction(timeout_s=5.0)
    reports = sink.reports()  # served inside the call, returned to the caller (delivery) afterwards
    assert sink.stuck and [r.source for r in reports.refused] == [SourceRef("frames.standard", 0, 2)]
    assert reports.acknowledged == [SourceRef("frames.standard", 0, 1)]
    sink.close()
    assert "abort" not in producer.calls and "flush" not in producer.calls


def test_init_transactions_waits_for_the_broker_then_gives_a_named_error(producer: FakeProducer,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    producer.init_errors = [KafkaError(KafkaError._TRANSPORT, retriable=True)] * 2
    transactional_sink(producer)
    assert producer.calls.count("init") == 3
    producer.init_errors = [KafkaError(KafkaError._TRANSPORT, retriable=True)] * 1000
    monkeypatch.setattr(sink_module, "INIT_TRANSACTIONS_TIMEOUT_S", 0.0)
    with pytest.raises(SinkError, match="streamfer-w0"):
        transactional_sink(producer)


def test_concurrent_transactions_at_init_is_retried_with_backoff_not_fatal(producer: FakeProducer) -> None:
    # A replaced producer's init after a coordinator kill: the coordinator is still aborting the old producer's
    # transaction. The broker's code may come without librdkafka's retriable flag.
    producer.init_errors = [KafkaError(KafkaError.CONCURRENT_TRANSACTIONS)] * 4
    delays: list[float] = []
    transactional_sink(producer, sleep=delays.append)
    assert producer.calls.count("init") == 5
    assert delays == [0.1, 0.2, 0.4, 0.8]


def test_init_backoff_is_capped(producer: FakeProducer) -> None:
    producer.init_errors = [KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)] * 8
    delays: list[float] = []
    transactional_sink(producer, sleep=delays.append)
    assert max(delays) == sink_module.INIT_RETRY_MAX_S and delays[-2:] == [2.0, 2.0]


def test_init_retries_are_bounded_and_end_in_a_named_error(producer: FakeProducer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    producer.init_errors = [KafkaError(KafkaError.CONCURRENT_TRANSACTIONS)] * 1000
    monkeypatch.setattr(sink_module, "INIT_TRANSACTIONS_TIMEOUT_S", 0.05)
    with pytest.raises(SinkError, match=r"'streamfer-w0' within 0s.*"):
        transactional_sink(producer, sleep=lambda s: None)
    assert producer.calls.count("init") < 1000


def test_a_fatal_init_error_is_not_retried(producer: FakeProducer) -> None:
    producer.init_errors = [KafkaError(KafkaError.CONCURRENT_TRANSACTIONS, fatal=True)]
    with pytest.raises(SinkError, match="streamfer-w0"):
        transactional_sink(producer, sleep=lambda s: None)
    assert producer.calls.count("init") == 1


# -- the error keeps librdkafka's ---------------------------------------------------------------------------------
def test_a_sink_error_keeps_the_kafka_error_that_caused_it(producer: FakeProducer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Code, retriable and fatal travel on the error, not only in its message."""
    producer.init_errors = [KafkaError(KafkaError._TRANSPORT, retriable=True)] * 1000
    monkeypatch.setattr(sink_module, "INIT_TRANSACTIONS_TIMEOUT_S", 0.0)
    with pytest.raises(SinkError) as transient:
        transactional_sink(producer)
    assert transient.value.kafka_error is not None and transient.value.code == KafkaError._TRANSPORT
    assert transient.value.retriable and not transient.value.fatal
    producer.init_errors = [KafkaError(KafkaError.CONCURRENT_TRANSACTIONS, fatal=True)]
    with pytest.raises(SinkError) as fatal:
        transactional_sink(producer, sleep=lambda s: None)
    assert fatal.value.code == KafkaError.CONCURRENT_TRANSACTIONS and fatal.value.fatal and not fatal.value.retriable


def test_a_fenced_producer_names_the_setting_and_keeps_the_error(producer: FakeProducer) -> None:
    producer.commit_errors = [KafkaError(KafkaError._FENCED, fatal=True)]
    sink = transactional_sink(producer)
    sink.begin()
    with pytest.raises(SinkError, match="fenced") as fenced:
        sink.commit_transaction(timeout_s=1.0)
    assert fenced.value.code == KafkaError._FENCED and fenced.value.fatal
    assert fenced.value.setting == "observability.worker_id"


def test_a_stuck_transaction_keeps_the_error_it_kept_failing_with(producer: FakeProducer) -> None:
    producer.commit_errors = [KafkaError(KafkaError._TIMED_OUT, retriable=True)] * 1000
    sink = transactional_sink(producer)
    sink.begin()
    with pytest.raises(TransactionStuckError, match="still fails") as stuck:
        sink.commit_transaction(timeout_s=0.0)
    assert stuck.value.code == KafkaError._TIMED_OUT and stuck.value.retriable


def test_a_fatal_delivery_report_is_raised_with_its_kafka_error() -> None:
    fake = FakeProducer(report_errors=[KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True)])
    sink = ResultSink(Settings(), producer_factory=lambda conf, logger=None: fake)
    sink.send_dead_letter(DeadLetter(SourceRef("frames.standard", 0, 3, 1), "bad", "decode", b"x"))
    assert sink.poll(0).error is sink.fatal_error
    assert sink.fatal_error is not None and sink.fatal_error.code == KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER
    assert sink.fatal_error.fatal and "frames.standard" in str(sink.fatal_error)


def test_delivery_reports_are_returned_by_the_next_poll_once_those_a_flush_served_too() -> None:
    """The sink calls nobody back: what librdkafka reported (in a flush as well) is what its next poll returns."""
    kit = KitProducer({}, refuse=lambda produced: KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
                      if produced.value == b"big" else None)
    sink = ResultSink(Settings(), producer_factory=lambda conf, logger=None: kit)
    first, second, third = (SourceRef("frames.bulk", 0, offset, 1) for offset in (1, 2, 3))
    sink.send_result(first, b"k", b"v")
    assert sink.poll(0) == DeliveryReports(acknowledged=[first])
    sink.send_result(second, b"k", b"big")
    sink.send_result(third, b"k", b"v")
    assert sink.flush(1.0) == 0
    reports = sink.poll(0)
    assert reports.acknowledged == [third] and [r.source for r in reports.refused] == [second]
    assert isinstance(reports.refused[0], Refusal) and "refused it" in reports.refused[0].reason
    assert sink.poll(0) == DeliveryReports()


def test_a_corrupt_message_report_is_retried_as_transient_not_refused() -> None:
    """INVALID_MSG (CORRUPT_MESSAGE: a CRC mismatch on the way) is damage in transit: producing the message again
    fixes it. It once made a good frame a reference dead letter (issue 67)."""
    fake = FakeProducer(report_errors=[KafkaError(KafkaError.INVALID_MSG), None])
    sink = ResultSink(Settings(), producer_factory=lambda conf, logger=None: fake)
    source = SourceRef("frames.standard", 0, 3, 1)
    sink.send_result(source, b"k", b"v")
    assert sink.poll(0) == DeliveryReports()  # the corrupt report: produced again, nothing refused
    assert sink.poll(0) == DeliveryReports(acknowledged=[source])


@dataclass
class FullQueueProducer(FakeProducer):
    """librdkafka with a local queue of `capacity` messages; poll serves no report while `stalled`."""

    capacity: int = 2
    stalled: bool = True
    poll_timeouts: list[float] = field(default_factory=list)
    produced: list[bytes] = field(default_factory=list)

    def produce(self, topic: str, value: bytes, key: bytes | None, headers: object,
                on_delivery: Callable[[KafkaError | None, object], None]) -> None:
        if len(self._unreported) >= self.capacity:
            raise BufferError("Local: Queue full")
        self.produced.append(value)
        super().produce(topic, value, key, headers, on_delivery)

    def poll(self, timeout: float) -> int:
        self.poll_timeouts.append(timeout)
        return 0 if self.stalled else super().poll(timeout)


def test_a_full_local_queue_keeps_the_output_for_a_later_poll_instead_of_waiting_in_the_loop() -> None:
    fake = FullQueueProducer()
    sink = ResultSink(Settings(), producer_factory=lambda conf, logger=None: fake)
    sources = [SourceRef("frames.standard", 0, offset, 1) for offset in range(5)]
    for source in sources:
        sink.send_result(source, b"k", str(source.offset).encode())
    assert fake.produced == [b"0", b"1"] and sink.backlog == 3
    assert all(t == 0 for t in fake.poll_timeouts)  # reports served, never waited for
    assert sink.poll(0) == DeliveryReports() and sink.backlog == 3  # still full: kept, in order
    fake.stalled = False
    acknowledged = []
    for _ in range(4):
        acknowledged += sink.poll(0).acknowledged
    assert fake.produced == [b"0", b"1", b"2", b"3", b"4"] and sink.backlog == 0
    assert acknowledged == sources  # every output once, in order


def test_a_flush_produces_what_waited_for_room_first() -> None:
    fake = FullQueueProducer(capacity=1, stalled=False)
    sink = ResultSink(Settings(), producer_factory=lambda conf, logger=None: fake)
    for offset in range(3):
        sink.send_result(SourceRef("frames.standard", 0, offset, 1), b"k", b"v")
    assert sink.backlog == 2
    assert sink.flush(5.0) == 0 and fake.produced == [b"v"] * 3
