"""The [batching] section and its per-class tables ([batching.realtime], [batching.standard], [batching.bulk])."""

from __future__ import annotations

from dataclasses import dataclass

from worker.config.fields import setting
from worker.frames import Priority

# The default change threshold of verdict reuse (bench/reuse.py measured it; docs/operations.md).
REUSE_CHANGE_THRESHOLD = 8.0


@dataclass(frozen=True)
class ClassSettings:
    """Latency budget, weight, backpressure share and batch size of one priority class."""

    max_wait_ms: float = setting(ge=0, le=1000, unit="ms", doc=(
        "longest a frame waits for its batch to fill (0..1000)"))
    max_age_ms: float = setting(range="0 or >= max_wait_ms", unit="ms", doc=(
        "a frame older than this since capture is not run but reported `EXPIRED`; 0 = never"))
    weight: int = setting(ge=1, doc=(
        "share of dispatch turns when several classes have due batches and every more urgent one has slack (under "
        "overload, classes with a deadline go first: bulk waits)"))
    latency_budget_ms: float = setting(0.0, ge=0, unit="ms", hint="0 = no budget", doc=(
        "end-to-end target (capture to result): batches are cut and released early enough for the oldest frame to "
        "finish within it (by the cost model), and the class goes ahead of less urgent ones when it is at risk; 0 = no"
        " budget"))
    pending_share: float = setting(1.0, gt=0, le=1, doc=(
        "share of `max_pending_frames` / `max_pending_bytes` the class's own frames may hold before it pauses and "
        "waits in Kafka; `standard + bulk` must stay below 1 so realtime always has room"))
    max_batch_size: int = setting(0, ge=0, le=4096, unit="frames", hint="0 = batching.max_batch_size", doc=(
        "most frames in one batch of this class (0..4096; 0 = `batching.max_batch_size`), e.g. realtime 8 while bulk "
        "runs 32. The batcher (full trigger, preferred sizes and runner buckets above it ignored for the class), the "
        "cost model's choice (within it) and a realtime backlog (counted in realtime batches) follow it; CUDA graphs "
        "are captured up to the largest of the classes', since a runner runs every class's batches, and warm-up "
        "calibrates sizes up to it. `max_pending_frames` and `delivery.max_uncommitted_frames` must hold the largest"))
    reuse_max_age_ms: float = setting(0.0, ge=0, unit="ms", hint="0 = off", doc=(
        "verdict reuse (opt-in): a frame whose picture differs from its stream's last scored frame (the reference) by "
        "less than `batching.reuse_change_threshold`, with the same shape, captured at most this long after the "
        "reference, is answered with the reference's verdict (`reused_from_frame` in the result) without running the "
        "model; any larger change is scored and becomes the reference. A change smaller than the threshold that "
        "lasts less than this is missed. 0 = off (no thumbnail is computed). See [operations.md](operations.md)"))


@dataclass(frozen=True)
class BatchingSettings:
    max_batch_size: int = setting(32, ge=1, le=4096, unit="frames", doc=(
        "most frames in one batch (1..4096), for every class that sets no `max_batch_size` of its own (below); with "
        "`adaptive_batch_size` the upper bound of the sizes the scheduler picks"))
    preferred_batch_sizes: tuple[int, ...] = setting((),
        range="each 1..the largest class max_batch_size", unit="frames", doc=(
        "sizes to release at rather than one frame past them; the runner's CUDA-graph buckets are added"))
    padding_waste_max: float = setting(0.20, ge=0, lt=1, doc=(
        "frames of close shapes share a batch padded to the largest only while padded pixels stay under this share of "
        "the batch. For a model with a fixed `input_size` no batch is padded: every frame becomes that input, so "
        "frames are grouped by it (720p and 1080p frames for a 224x224 model share batches) and the waste is 0"))
    max_batch_bytes: int = setting(256 * 1024 * 1024, ge=1024, unit="bytes", doc=(
        "cap of one batch's padded input tensor (batch x H x W x C x tensor_dtype_bytes; H x W is the model's fixed "
        "`input_size` when it has one, else the batch's own)"))
    tensor_dtype_bytes: int = setting(4, range="1, 2, 4 or 8", unit="bytes", doc=(
        "bytes per element of the model input tensor (fp32)"))
    rare_shape_min_count: int = setting(2, ge=1, doc=(
        "a shape seen fewer times than this within the window goes to the fallback lane"))
    rare_shape_window_ms: float = setting(10_000.0, gt=0, unit="ms", doc=(
        "window for counting shapes"))
    fallback_max_batch_size: int = setting(4, ge=1, range="<= max_batch_size", unit="frames", doc=(
        "largest batch of the fallback lane"))
    max_pending_frames: int = setting(8192, range=">= the largest class max_batch_size", unit="frames", doc=(
        "frames held before every class pauses (backpressure); each class pauses earlier at its `pending_share`. A "
        "pause drops the paused partitions' prefetched messages (librdkafka) and a resume waits a fetch round trip, so"
        " this must hold what the worker runs in that time: with 2048 (the default until issue 37) a worker reading "
        "small frames on a backlog paused and resumed several times a second and 80-90% of its polls took all the "
        "consumer had queued. `max_pending_bytes` still bounds memory for large frames. It also sets the default "
        "`delivery.max_uncommitted_frames`"))
    max_pending_bytes: int = setting(512 * 1024 * 1024, ge=1024, unit="bytes", doc=(
        "tensor bytes (counted as for `max_batch_bytes`) held before the source pauses; a poll reads no more than fit "
        "at the largest frame seen, so only frames larger than any before can pass it, by one poll"))
    reuse_change_threshold: float = setting(REUSE_CHANGE_THRESHOLD, gt=0, le=255, doc=(
        "for classes with `reuse_max_age_ms`: the largest difference (0..255) between the cells of two frames' "
        "grayscale thumbnails (at most 32x32 cells, each the mean of its block of the frame) below which a frame "
        "counts as unchanged from its reference. On H.264 clips of real photos (bench/reuse.py) sensor noise moved "
        "it at most 1.3 from frame to frame and every cut, flash, or object of 5% of the frame entering or leaving "
        "at least 84; at 8 no reused frame's open_nsfw score differed from its own by more than 0.016. Higher "
        "reuses more of a slow pan (16: 72% of that clip against 54%) and lets smaller changes through: a change "
        "must move one cell's mean brightness (a block of about 40x23 pixels at 720p) by the threshold to be scored"))
    realtime: ClassSettings = setting(default_factory=lambda: ClassSettings(
        max_wait_ms=5, max_age_ms=2_000, weight=8, latency_budget_ms=250, pending_share=1.0), doc=(
        "the realtime class: the [batching.realtime] table"))
    standard: ClassSettings = setting(default_factory=lambda: ClassSettings(
        max_wait_ms=15, max_age_ms=30_000, weight=3, latency_budget_ms=1_000, pending_share=0.5), doc=(
        "the standard class: the [batching.standard] table"))
    bulk: ClassSettings = setting(default_factory=lambda: ClassSettings(
        max_wait_ms=100, max_age_ms=0, weight=1, latency_budget_ms=0, pending_share=0.25), doc=(
        "the bulk class: the [batching.bulk] table"))
    adaptive_batch_size: bool = setting(True, doc=(
        "release each group at the size the learned cost model measures the most frames per device second for (on a "
        "CPU device, per CPU second of the batch's own threads) (sizes "
        "within 5% of the best count as equal: the one in use is kept, else the largest, as per-batch loop, produce "
        "and commit costs are outside the measurement) (warm-up times sizes 1, 2, 4 … `max_batch_size`; every batch "
        "updates it; a size known only from warm-up is scaled by how much slower live batches ran than their warm-up "
        "timing), within each class's `latency_budget_ms`; false: the static sizes (`max_batch_size`, "
        "`preferred_batch_sizes`) trigger releases"))
    max_blocking_ms: float = setting(0.0, ge=0, unit="ms", hint="0 = half of realtime.latency_budget_ms", doc=(
        "longest a standard or bulk batch may be predicted to run, so a realtime batch waits behind at most one such "
        "batch (a running batch cannot be preempted); 0 = half of `realtime.latency_budget_ms`"))
    realtime_quiet_ms: float = setting(2_000.0, ge=0, unit="ms", hint="0 = standard and bulk always bounded", doc=(
        "the `max_blocking_ms` bound holds while realtime is present: a realtime frame pending, or one arrived within "
        "this long. After a quiet spell standard and bulk batches fill to full size (throughput on a backlog with no "
        "realtime traffic); the first realtime frame after it may wait behind one such batch. 0 = always bounded"))
    release_when_idle: bool = setting(True, doc=(
        "when no batch is running and the last poll took everything the consumer had fetched, send the most urgent "
        "pending group now (reason `idle`) instead of holding it for its `max_wait_ms`: a fuller batch only saves time"
        " while the runtime is busy, and on a backlog (polls come back full) or with a batch running this never fires."
        " false: every partial group waits for its wait or budget"))
    read_by_priority: bool = setting(True, doc=(
        "read the most urgent class's backlog first: while a class has a backlog in Kafka (its partitions' high "
        "watermarks minus positions, from the consumer's cached watermarks) that it can still serve within its "
        "`max_age_ms`, the partitions of every less urgent class are paused (`docs/architecture.md`, Scheduling). A "
        "steady stream within capacity pauses nothing. false: every assigned partition is read and only the batcher's "
        "rules (`pending_share`, a realtime backlog in the batcher) pause classes"))
    lower_class_read_floor: float = setting(0.05, ge=0, le=0.5, hint="a share of the messages read; 0 = none", doc=(
        "the share of the messages read (over the last 5 s) that a class paused for a more urgent class's backlog "
        "still reads, so it never starves; it holds only while no more urgent backlogged class expires frames. 0..0.5;"
        " 0 = none"))
    tenant_weights: dict[str, int] = setting(default_factory=dict, range="each weight >= 1", doc=(
        "per-tenant weights for fair filling within a class; unknown tenants weigh 1"))

    def for_class(self, priority: Priority) -> ClassSettings:
        return {Priority.REALTIME: self.realtime, Priority.STANDARD: self.standard, Priority.BULK: self.bulk}[priority]

    def max_batch_size_for(self, priority: Priority) -> int:
        """The class's own max_batch_size, or max_batch_size when it sets none (0)."""
        return self.for_class(priority).max_batch_size or self.max_batch_size

    @property
    def largest_batch_size(self) -> int:
        """The most frames a batch of any class may hold: what the runtime must be ready to run."""
        return max(self.max_batch_size_for(p) for p in Priority)

    @property
    def blocking_limit_ms(self) -> float:
        """max_blocking_ms, or half the realtime budget when 0; 0 means no bound."""
        return self.max_blocking_ms or self.realtime.latency_budget_ms / 2.0
