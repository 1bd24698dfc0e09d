"""The [kafka], [topics], [delivery], [observability], [limits] and [dlq] sections: each field with its reference
entry (`setting`); cross-field checks are in worker/config/validate.py."""

from __future__ import annotations

from dataclasses import dataclass

from worker.config.fields import DeliveryMode, LogFormat, LogLevel, setting
from worker.frames import Priority

# Upper bounds of settings whose cost grows with them: 16384x16384 RGB is 805 MB decoded, 3.2 GB as float32.
MAX_FRAME_PIXELS_CEILING = 16384 * 16384
MAX_METRIC_TENANTS = 1000
MAX_INFLIGHT_PER_RUNNER = 8
MAX_INFLIGHT_BATCHES = 1024
# Slots of the default worker id per host (worker/identity.py): far more worker processes than one host runs.
MAX_WORKER_SLOTS = 1024
# 2000-01-01T00:00:00Z: a capture time before it is a producer bug (0, unset, or seconds sent as milliseconds).
_YEAR_2000_MS = 946_684_800_000


@dataclass(frozen=True)
class KafkaSettings:
    """How the worker reaches Kafka; secrets are read from files or an environment variable when a client is made
    (worker/kafka/client.py), so they never sit in Settings, logs or errors."""

    bootstrap_servers: str = setting("127.0.0.1:9092", doc=(
        "Kafka bootstrap servers"))
    group_id: str = setting("streamfer-worker", doc=(
        "consumer group shared by all workers"))
    static_membership: bool = setting(True, doc=(
        "join the group as a static member (KIP-345) whose `group.instance.id` is the worker id "
        "(`observability.worker_id`): a process restarted under the same id (the default `<hostname>-<slot>` on the "
        "same host, a container restarted in its pod) gets its partitions back at once, without a rebalance and "
        "without waiting out the dead one's session; a worker that stops gracefully (SIGTERM, scale-down, a rollout) "
        "still leaves the group, so its partitions move on at once. The worker id must then be unique in the group and"
        " 1-249 letters, digits, `.`, `_`, `-`: the broker fences a member when another joins under its id, and when a"
        " process frozen past its session (SIGSTOP, a paused VM) comes back; the worker answers a fence by joining "
        "again under a new consumer (its partitions were lost), and a second fence within 60 s (two processes under "
        "one id fencing each other) stops it with exit 2 naming `observability.worker_id`. `false`: dynamic "
        "membership, where a restarted process waits for its predecessor's session (`session_timeout_ms`) to expire. "
        "Replaces `group_instance_id` (refused with that hint). See [deploy.md](deploy.md#worker-ids-and-restarts)"))
    session_timeout_ms: int = setting(45_000, ge=6_000, le=1_800_000, unit="ms",
                                      hint=("the broker's default group.min/max.session.timeout.ms: outside them "
                                            "joining the group fails"), doc=(
        "group session timeout (6000..1800000, the broker's default bounds): how long a member that died without a "
        "successor under its id keeps its partitions"))
    heartbeat_interval_ms: int = setting(500, ge=100, range="at most session_timeout_ms / 3", unit="ms",
                                         doc=(
        "how often the consumer heartbeats to the group coordinator, which is also how soon a member notices that a "
        "rebalance began, so it bounds how long a partition that moves (a rollout, a scale-up or -down) has no owner. "
        "Measured (`bench/handover.py`, 3 workers, 18 partitions): with librdkafka's default 3000 every moved "
        "partition was unowned 3.0 s (longer than realtime's `max_age_ms`) and a join took 6.0 s to balance; with 500, "
        "at most 1.0 s and 1.5 s; 250 was no faster. The cost: one small request per worker per interval. See "
        "[deploy.md](deploy.md#what-a-rollout-costs)"))
    max_poll_interval_ms: int = setting(300_000, range=">= session_timeout_ms", unit="ms", doc=(
        "the worker keeps polling while batches run, so this only bounds a stuck loop; must be >= session_timeout_ms"))
    consumer_overrides: dict[str, str] = setting(default_factory=dict, doc=(
        "extra librdkafka consumer properties (fetch sizes, etc.); the worker sets `fetch.wait.max.ms=100` and "
        "`fetch.queue.backoff.ms=20` (librdkafka: 500 and 1000), which these may change: backpressure pauses and "
        "resumes partitions, and with the library's values each resume left the model idle for up to 0.5-1 s (on a "
        "mixed backlog, no batch in flight 22-29% of the time); the cost is an idle worker's fetch to each broker 10 "
        "times a second; refused: the security properties, which have settings of their own (`security.protocol`, "
        "`sasl.*`, `ssl.*.location`) and any secret-bearing one (`sasl.password`, `ssl.key.password`, ...; a secret is"
        " never written in the settings); also refused at start-up for the ones the delivery guarantees depend on: "
        "`enable.auto.commit`, `enable.auto.offset.store`, `isolation.level`, `auto.offset.reset` (always `earliest`: "
        "reset a group's offsets with `kafka-consumer-groups --reset-offsets` to skip a backlog), "
        "`partition.assignment.strategy`, and those with a setting of their own (`bootstrap.servers`, `group.id`, "
        "`group.instance.id`, `session.timeout.ms`, `heartbeat.interval.ms`, `max.poll.interval.ms`)"))
    producer_overrides: dict[str, str] = setting(default_factory=dict, doc=(
        "extra librdkafka producer properties; refused: the security and secret-bearing properties (as for "
        "`consumer_overrides`), `enable.idempotence`, `acks`, `transactional.id` (use "
        "`delivery.transactional_id_prefix`), `bootstrap.servers`"))
    security_protocol: str = setting("PLAINTEXT", range="`PLAINTEXT`, `SSL`, `SASL_PLAINTEXT`, `SASL_SSL`", doc=(
        "`PLAINTEXT`, `SSL`, `SASL_PLAINTEXT` or `SASL_SSL`, for every client of the worker (consumer, producer, "
        "admin, `worker produce/results/topics`); see [security.md](security.md)"))
    sasl_mechanism: str = setting("SCRAM-SHA-512", range="`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`", doc=(
        "`PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (SASL protocols only)"))
    sasl_username: str = setting("", doc=(
        "SASL user; the ACLs name it as `User:<name>`"))
    sasl_password_file: str = setting("", doc=(
        "file holding the SASL password (read when a client is made; never logged). Set this or `sasl_password_env`"))
    sasl_password_env: str = setting("", doc=(
        "the NAME of an environment variable holding the SASL password"))
    ssl_ca_location: str = setting("", doc=(
        "CA certificate(s) (PEM file or directory) that verify the brokers; empty: the system's"))
    ssl_certificate_location: str = setting("", doc=(
        "client certificate (PEM) for TLS client authentication; needs `ssl_key_location`"))
    ssl_key_location: str = setting("", doc=(
        "the client certificate's private key (PEM)"))
    ssl_key_password_file: str = setting("", doc=(
        "file holding the private key's password, if it is encrypted"))


@dataclass(frozen=True)
class TopicSettings:
    realtime: str = setting("frames.realtime", doc=(
        "input topic of the realtime class"))
    standard: str = setting("frames.standard", doc=(
        "input topic of the standard class"))
    bulk: str = setting("frames.bulk", doc=(
        "input topic of the bulk class"))
    results: str = setting("moderation.results", doc=(
        "output topic of moderation results"))
    dead_letter: str = setting("frames.dlq", doc=(
        "messages that could not be processed: the original bytes and headers, then the reason and source coordinates "
        "in `streamfer.*` headers ([operations.md](operations.md)); `worker dlq replay` records what it replayed in "
        "`<dead_letter>.replayed`"))
    review: str = setting("", doc=(
        "where a copy of each result whose verdict is `review` goes (a review queue with its own consumers and "
        "retention; `[policy]`); empty: off. The results topic keeps every result either way"))
    flagged: str = setting("", doc=(
        "where a copy of each result whose verdict is `flag` goes; empty: off"))
    control: str = setting("streamfer.control", doc=(
        "the control topic (compacted, one partition, shared by every group): the desired policy under "
        "`<group_id>/policy` (`worker policy set`) and each worker's report under `<group_id>/worker/<worker_id>`; "
        "read by every worker outside the group (docs/operations.md)"))
    worker_status: str = setting("", doc=(
        "where workers write their reports (`<group_id>/worker/<worker_id>`: the policy and model revision they apply,"
        " their rollout state); empty: the control topic. Set it (compacted, one partition; `worker topics` creates "
        "it) to let only an operator's principal write the control topic (docs/security.md)"))
    shadow_results: str = setting("moderation.results.shadow", doc=(
        "the results of a candidate model in shadow (`worker rollout start --shadow`), in the results schema; the "
        "primary's results are unchanged ([Rolling out a model](operations.md#rolling-out-a-model))"))

    def routes(self) -> list[str]:
        """The route topics that are on: review, flagged."""
        return [t for t in (self.review, self.flagged) if t]

    def input_topics(self) -> dict[str, Priority]:
        return {self.realtime: Priority.REALTIME, self.standard: Priority.STANDARD, self.bulk: Priority.BULK}


@dataclass(frozen=True)
class DeliverySettings:
    mode: DeliveryMode = setting("at_least_once", doc=(
        "or `exactly_once`: results, dead letters and offsets in one transaction per loop turn "
        "(the outputs of every batch finished since the last turn, up to each partition's commit "
        "point; `worker.loop.delivery.ExactlyOnceDelivery`)"))
    transactional_id_prefix: str = setting("streamfer", range="non-empty", doc=(
        "exactly-once: the producer's transactional id is `<prefix>-<worker_id>`"))
    inflight_batches_per_runner: int = setting(2, ge=1, le=MAX_INFLIGHT_PER_RUNNER, unit="batches", doc=(
        "batches dispatched to the runtime and not yet finished, per runner (devices x "
        "`runtime.instances_per_device`), 1..8: with 2 each runner has one batch running and the next one prepared "
        "behind it (decoded, copied to its device), so on a backlog every runner is busy"))
    max_inflight_batches: int = setting(0,
        ge=0, le=MAX_INFLIGHT_BATCHES, range="0 or >= the runner count", unit="batches",
        hint="0 = inflight_batches_per_runner x runners", doc=(
        "all runners together: 0 = `inflight_batches_per_runner` x runners (logged at start-up); a number (1..1024) "
        "caps the total instead and must be at least the runner count, or start-up stops naming this setting (some "
        "runners would never get a batch). One more slot is always reserved for a realtime batch"))
    commit_interval_ms: float = setting(0.0, ge=0, unit="ms", doc=(
        "least time between two offset commits (0: after every batch whose results are acknowledged); at-least-once "
        "also waits for the last asynchronous commit's outcome before sending the next"))
    max_uncommitted_frames: int = setting(0,
        ge=0, range="0 or >= the largest class max_batch_size", unit="frames", doc=(
        "the most frames read and not yet answered (batching or running: what holds pixels), together with the "
        "answered frames below a commit point the broker has not confirmed yet; reading pauses there until batches "
        "finish or a commit lands, so while commits fail (a coordinator away) what a lost session or crash answers "
        "again stays bounded. Frames whose output was handed to the producer and awaits its acknowledgement do not "
        "count here: `max_unacknowledged_outputs` bounds them; nor do answered frames held behind an earlier one (its "
        "output partition down, say): `max_done_offsets_held` bounds them. What a crash or a lost session redoes is "
        "at most the sum of the three (the last only where the commit's metadata overflowed). 0: "
        "`batching.max_pending_frames` + (the in-flight limit, `max_inflight_batches` as resolved for the runners, + "
        "1, realtime's reserved slot) x the largest class `max_batch_size`. With a long `commit_interval_ms` the "
        "worker commits early once half of it is used. Offsets a frame held for its writer schema pins (it, and the "
        "frames of its partition answered past it) are bounded per partition instead: that partition pauses at this "
        "many (`schema_registry`). Until issue 67 this counted the answered frames held behind an earlier one and the "
        "unacknowledged outputs too, so one stalled output partition paused every input within a minute or two"))
    max_unacknowledged_outputs: int = setting(0, ge=0, unit="frames", hint="0 = 20 x max_uncommitted_frames", doc=(
        "at-least-once: the most frames whose output (result, route copies or dead letter) was handed to the "
        "producer and is not yet acknowledged, over all output partitions: an output partition down holds its "
        "outputs here, and librdkafka fails one after `message.timeout.ms` (300 s) and the worker produces it again, "
        "still counted once. Such a frame holds no pixels, only its encoded output: the bytes sit in librdkafka's "
        "local queue, bounded by `queue.buffering.max.kbytes` and `queue.buffering.max.messages` "
        "(`kafka.producer_overrides`), and input pauses while outputs wait for room there. Reading pauses at this "
        "many until acknowledgements come; a crash redoes them. Exactly-once acknowledges its outputs within each "
        "transaction's commit, so none wait between turns. 0: 20 x `max_uncommitted_frames` as resolved"))
    max_done_offsets_held: int = setting(0, ge=0, unit="offsets", hint="0 = 20 x max_uncommitted_frames", doc=(
        "the most offsets answered but not yet committable, over all partitions: done beyond their partition's commit "
        "point, which an earlier frame still holds (its output partition down, or it is still running). They cost no "
        "memory in at-least-once (a partition keeps only its offsets not yet done; in exactly-once each holds its "
        "output until the transaction that commits it). At-least-once commits them in the commit's metadata "
        "(`commit_metadata_max_bytes`), so a restart or a rebalance redoes only the frames not yet answered; where "
        "the metadata does not fit, they are redone. Reading pauses at this many until the held commit points move. "
        "0: 20 x `max_uncommitted_frames` as resolved"))
    commit_metadata_max_bytes: int = setting(4000, ge=0, le=1_048_576, unit="bytes",
                                             hint="0 = no metadata; at most the broker's offset.metadata.max.bytes",
                                             doc=(
        "at-least-once: the most bytes of a partition's commit metadata listing the offsets done beyond its commit "
        "point (worker/partitions/donemeta.py); the broker refuses a commit whose metadata is longer than its "
        "`offset.metadata.max.bytes` (default 4096). A partition whose list does not fit is committed without it "
        "(its done offsets are redone after a hand-over), counted by "
        "`streamfer_commit_metadata_overflows_total`. 0: never (every hand-over redoes what is past the commit point)"))
    transaction_call_timeout_ms: int = setting(10_000, ge=1_000, le=300_000, unit="ms", doc=(
        "exactly-once: how long sending a transaction's offsets and committing it may take; past it (plus 5 s for a "
        "call blocked inside librdkafka) the producer is replaced, which fences the old one and aborts its "
        "transaction, and the frames are read again from the committed offsets. The producer's "
        "`transaction.timeout.ms` is 3x this (30 s): a crashed worker's open transaction holds back its partitions and"
        " read_committed readers of the results at most that long, unless a worker with the same `worker_id` starts "
        "first and fences it at once"))


@dataclass(frozen=True)
class ObservabilitySettings:
    metrics_enabled: bool = setting(True, doc=(
        "serve `/metrics`, `/healthz`, `/readyz`"))
    metrics_port: int = setting(9400, ge=0, le=65535, hint="0 picks a free port", doc=(
        "their port (0 picks a free one and logs it)"))
    metrics_host: str = setting("0.0.0.0", doc=(
        "bind address"))
    profile_endpoint: bool = setting(False, doc=(
        "serve `/debug/profile?batches=N` on the metrics port (records N batches with the torch profiler; "
        "unauthenticated like `/metrics`, see docs/security.md)"))
    log_format: LogFormat = setting("text", doc=(
        "`text` or `json` (one JSON object per line, with the worker id)"))
    log_level: LogLevel = setting("INFO", doc=(
        "`DEBUG`, `INFO`, `WARNING`, `ERROR`"))
    worker_id: str = setting("",
        range="1-249 of `A-Za-z0-9._-` with kafka.static_membership", shown_default="`<hostname>-<slot>`", doc=(
        "names this process in logs, results (`worker_id`), dead letters (`streamfer.worker_id`), the Kafka clients' "
        "`client.id` the exactly-once transactional id (`<transactional_id_prefix>-<worker_id>`) and, with "
        "`kafka.static_membership`, the consumer's `group.instance.id`. Unset, it is the host name and the lowest slot"
        " free on this host (`worker_slot`), held by a lock while the process runs: a process restarted on the same "
        "host gets the same id, so its producer fences the dead one's open transaction at once and its consumer takes "
        "the dead member's place in the group (see [deploy.md](deploy.md#worker-ids-and-restarts)). Set it, and it "
        "wins (no slot is taken); it must then be unique among the running workers of a transactional id prefix and of"
        " a consumer group"))
    worker_slot: int = setting(-1, ge=-1, le=MAX_WORKER_SLOTS - 1, range="only with worker_id unset",
                               hint="-1: the lowest slot free on this host", doc=(
        "the slot of the default worker id: -1 takes the lowest one free on this host; N takes slot N, and start-up "
        "fails (exit 2, naming the process holding it) while another process holds it. Only with `worker_id` unset. "
        "`worker run --processes N` gives its children slots S..S+N-1 (S is this setting, 0 when -1)"))
    worker_slot_dir: str = setting("",
        shown_default="`$XDG_RUNTIME_DIR/streamfer`, else `<temp dir>/streamfer-<uid>`", doc=(
        "where the slots' lock files live (one per slot and transactional id prefix, removed on a clean exit; the "
        "lock, not the file, holds the slot, and the kernel drops it when the process dies). Made (mode 0700) if "
        "missing; the default one must belong to this user. A directory the worker cannot write (read-only root file "
        "system without a writable `/tmp`) stops start-up with exit 2 naming this setting: point it at a writable "
        "local directory, or set `worker_id`"))
    metric_tenants: tuple[str, ...] = setting((), range="at most 1000, each 1..limits.max_identifier_bytes bytes", doc=(
        "tenants that get a `tenant` label value of their own on the per-tenant metrics; when set, every other tenant "
        "is counted as `other` (see docs/metrics.md, Tenant label)"))
    max_metric_tenants: int = setting(100, ge=0, le=MAX_METRIC_TENANTS,
                                      hint="each tenant adds series to every scrape", doc=(
        "when `metric_tenants` is empty: the first this many tenants seen (each at most `limits.max_identifier_bytes` "
        "long) get a label of their own, the rest are `other`; 0..1000"))


@dataclass(frozen=True)
class LimitsSettings:
    """What the worker accepts from producers: bounds that keep one bad or hostile message cheap."""

    max_frame_pixels: int = setting(4096 * 4096, ge=1, le=MAX_FRAME_PIXELS_CEILING, unit="pixels",
                                    hint="16384x16384 at most", doc=(
        "largest frame, width x height (4096x4096: takes 1920x1080, 3840x2160 and 4096x2160; raise to 33177600 for "
        "8K); 1..268435456. Checked on the message header (`MessageDecodeError`) and, for a JPEG, on the JPEG's own "
        "header before any pixel is decoded (`FrameDecodeError`)"))
    max_identifier_bytes: int = setting(256, ge=1, le=65_536, unit="bytes", doc=(
        "longest `stream_id` and `tenant`, in UTF-8 bytes; both become result keys and metric labels; 1..65536"))
    min_capture_ts_ms: int = setting(_YEAR_2000_MS, ge=1, unit="ms since the epoch", doc=(
        "earliest `capture_ts_ms` accepted (2000-01-01T00:00:00Z): an earlier one is a producer bug (0, unset, "
        "negative, or seconds sent as milliseconds)"))
    max_capture_skew_ms: int = setting(60_000, ge=0, le=86_400_000, unit="ms", hint="one day at most", doc=(
        "how far in the future (by the worker's clock) `capture_ts_ms` may be: producer clock skew; 0..86400000. "
        "Further ahead is a broken clock or a wrong unit (microseconds)"))
    duplicate_window_frames: int = setting(4096, ge=0, le=1_000_000, unit="frames", hint="0 = off", doc=(
        "per input partition, how many recent frame identities `(stream_id, frame_index)` are remembered to catch a "
        "repeated frame (see Repeated frames below); 0 turns detection off; 0..1000000"))


@dataclass(frozen=True)
class DeadLetterSettings:
    """How `worker dlq replay` treats the dead-letter topic (the worker itself only writes it)."""

    max_replays: int = setting(3, ge=0, le=1000, hint="0 = no replays", doc=(
        "how many times one frame may be published again: a replayed frame that fails again is dead-lettered with its "
        "replay count, and a dead letter whose frame was replayed this many times is not replayed again (`worker dlq "
        "show` counts them), so a frame that keeps failing never loops; 0..1000, 0: no replays"))


@dataclass(frozen=True)
class SchemaRegistrySettings:
    """A Confluent-API Schema Registry (docs/configuration.md, Schema evolution). Empty `url`: plain Avro bodies
    in and out, as without a registry. Secrets are read from files or an environment variable when the client is
    made, so they never sit in Settings, logs or errors."""

    url: str = setting("", doc=(
        "comma-separated `http://` or `https://` base URLs (env `WORKER_SCHEMA_REGISTRY_URL`; Apicurio: "
        "`http://host:8080/apis/ccompat/v7`); empty: no registry"))
    basic_auth_user_info_file: str = setting("", doc=(
        "a file holding `user:password` for HTTP basic auth (a hosted registry's API key and secret)"))
    basic_auth_user_info_env: str = setting("", doc=(
        "the NAME of an environment variable holding `user:password` instead (at most one of the two)"))
    ssl_ca_location: str = setting("", doc=(
        "CA file or directory the registry's certificate is checked against (empty: the system's); `https://` only"))
    ssl_certificate_location: str = setting("", doc=(
        "client certificate (PEM) for mutual TLS, with `ssl_key_location`"))
    ssl_key_location: str = setting("", doc="the client certificate's private key (PEM)")
    ssl_key_password_file: str = setting("", doc="a file holding the key's password, if it has one")
    timeout_ms: int = setting(5_000, ge=100, le=60_000, unit="ms", doc=(
        "each registry request's timeout. Start-up tries a request twice, then waits for a registry that does not "
        "answer (with backoff, `/readyz` saying why); a writer-schema lookup is tried once, off the loop, and asked "
        "again with backoff while its frames wait"))
    auto_register: bool = setting(True, doc=(
        "register the results schema under `<topics.results>-value` at start; false: only look it up (credentials "
        "that may not write the registry: register it in the roll-out), and exit 2 if it is not there"))
    max_held_bytes_per_partition: int = setting(16 * 1024 * 1024, ge=1, unit="bytes", doc=(
        "framed frames whose writer schema the registry has not given yet (it is down, or slow) wait on their "
        "partition, in order, never dead-lettered (unframed frames flow on); a partition holding this many message "
        "bytes of them is paused, its unframed frames too, until they are released. Other partitions read on"))


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry traces of frames (worker/tracing.py, docs/troubleshooting.md): W3C trace context read from and
    written to Kafka headers, spans exported over OTLP/HTTP. Off (no spans, no header changes) with `endpoint`
    empty."""

    endpoint: str = setting("", doc=(
        "the OTLP/HTTP collector's base URL, e.g. `http://127.0.0.1:4318` (spans are posted to `<endpoint>/v1/traces`"
        "; a URL already ending in `/v1/traces` is used as it is); empty: tracing off"))
    sample_ratio: float = setting(0.01, ge=0.0, le=1.0, hint="a share of frames; NaN is refused too", doc=(
        "share of frames without a `traceparent` header the worker starts a trace for; parent-based: a frame whose "
        "`traceparent` is sampled is always traced, one whose `traceparent` is not sampled never (its result still "
        "carries the header). Measured cost (`bench/tracing_cost.py`): see docs/troubleshooting.md"))
    service_name: str = setting("streamfer-worker", doc=(
        "the `service.name` resource attribute of the worker's spans"))
    resource_attributes: dict[str, str] = setting(default_factory=dict, doc=(
        "more resource attributes on every span (`deployment.environment`, `k8s.pod.name`, ...)"))
    max_queued_spans: int = setting(8192, ge=64, le=1_000_000, unit="spans", doc=(
        "finished spans held for export; beyond, new spans are dropped and counted in "
        "`streamfer_trace_spans_dropped_total{reason=\"queue_full\"}`, so a collector that is slow or gone never "
        "holds the worker back"))
    export_timeout_ms: int = setting(5_000, ge=100, le=60_000, unit="ms", doc=(
        "each export request's timeout; a failed export's spans are dropped and counted "
        "(`reason=\"export_failed\"`)"))
