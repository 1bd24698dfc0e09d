"""`Settings`, the one object every stage reads: one field per section of the TOML file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker.config.batching import BatchingSettings
from worker.config.fields import setting
from worker.config.model import ModelSettings, RuntimeSettings
from worker.config.policy import PolicySettings
from worker.config.sections import (
    DeadLetterSettings,
    DeliverySettings,
    KafkaSettings,
    LimitsSettings,
    ObservabilitySettings,
    SchemaRegistrySettings,
    TopicSettings,
    TracingSettings,
)

# The default bound of answered offsets held behind a commit point, per frame of the memory bound: a done offset costs
# no memory, so far more of them may wait for a stalled output partition than frames may be in flight.
DONE_OFFSETS_PER_UNCOMMITTED = 20
# The default bound of frames whose output awaits its acknowledgement, per frame of the memory bound: such a frame holds
# only its encoded output (in librdkafka's queue, bounded by its own settings), so an output partition down for minutes
# does not pause the healthy streams' input (issue 67).
UNACKNOWLEDGED_PER_UNCOMMITTED = 20


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = setting(default_factory=KafkaSettings, doc="the Kafka cluster and clients")
    topics: TopicSettings = setting(default_factory=TopicSettings, doc="the topics read and written")
    batching: BatchingSettings = setting(default_factory=BatchingSettings, doc="the micro-batcher and its classes")
    model: ModelSettings = setting(default_factory=ModelSettings, doc="the model and its preprocessing contract")
    runtime: RuntimeSettings = setting(default_factory=RuntimeSettings, doc="where and how the model runs")
    delivery: DeliverySettings = setting(default_factory=DeliverySettings, doc="the commit protocol")
    observability: ObservabilitySettings = setting(default_factory=ObservabilitySettings,
                                                   doc="logs, metrics and the worker's identity")
    limits: LimitsSettings = setting(default_factory=LimitsSettings, doc="what the worker accepts from producers")
    dlq: DeadLetterSettings = setting(default_factory=DeadLetterSettings, doc="what `worker dlq replay` may do")
    schema_registry: SchemaRegistrySettings = setting(default_factory=SchemaRegistrySettings,
                                                      doc="a Confluent-API Schema Registry for frames and results")
    tracing: TracingSettings = setting(default_factory=TracingSettings,
                                       doc="OpenTelemetry traces of frames through Kafka headers")
    policy: PolicySettings = setting(default_factory=PolicySettings,
                                     doc="each frame's verdict (allow, review, flag) per tenant")
    models: tuple[ModelSettings, ...] = setting(default_factory=tuple, shown_default="none",
                                                range="`[models.<name>]` tables, names unique", doc=(
        "a model set: `[models.<name>]` tables, in order, each with [model]'s fields (`model` is then the first); "
        "each frame is decoded once and runs through the models in order, a model with a `run_if_model` condition "
        "only where it holds (a cascade), and one verdict comes out (worker/runtime/modelset.py). Empty with a "
        "single [model], which runs as a set of one"))

    @property
    def max_uncommitted_frames(self) -> int:
        """`delivery.max_uncommitted_frames`, or by default what one worker holds when nothing is stuck: a full
        batcher and its batches running (the in-flight limit, resolved for the runners by
        `resolve_inflight_batches`, plus realtime's reserved slot)."""
        return self.delivery.max_uncommitted_frames or (
            self.batching.max_pending_frames
            + (self.delivery.max_inflight_batches + 1) * self.batching.largest_batch_size)

    @property
    def max_done_offsets_held(self) -> int:
        """`delivery.max_done_offsets_held`, or by default 20 x the resolved `max_uncommitted_frames`."""
        return self.delivery.max_done_offsets_held or DONE_OFFSETS_PER_UNCOMMITTED * self.max_uncommitted_frames

    @property
    def max_unacknowledged_outputs(self) -> int:
        """`delivery.max_unacknowledged_outputs`, or by default 20 x the resolved `max_uncommitted_frames`."""
        return (self.delivery.max_unacknowledged_outputs
                or UNACKNOWLEDGED_PER_UNCOMMITTED * self.max_uncommitted_frames)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Settings)}
# The sections that are one table of settings each; `models` is a table of [model]-like tables.
TABLE_SECTIONS = [name for name in SECTIONS if name != "models"]
