"""The values derived from valid settings: what a setting resolves to once the machine (CPU cores) or the runtime
(its runner count) is known, and the parsed forms of settings written as text. Start-up resolves them here, once;
`validate` checks the settings they start from. A value one section gives from its own fields alone stays a
property of that section (`BatchingSettings.largest_batch_size`, `max_batch_size_for`, `blocking_limit_ms`;
`Settings.max_uncommitted_frames`, which reads the in-flight limit as `resolve_inflight_batches` leaves it)."""

from __future__ import annotations

import dataclasses
import os

from worker.config.fields import ConfigError
from worker.config.model import MAX_PREPROCESS_THREADS, RuntimeSettings
from worker.config.sections import DeliverySettings
from worker.config.settings import Settings


def parse_size(text: str) -> tuple[int, int] | None:
    """`WIDTHxHEIGHT` (runtime.warmup_shapes) as (width, height), or None when it is not two positive integers."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        return None
    return (w, h) if w > 0 and h > 0 else None


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def preprocess_thread_count(runtime: RuntimeSettings) -> int:
    """runtime.preprocess_threads resolved: "auto" and 0 mean the CPU cores this process may run on."""
    if runtime.preprocess_threads not in ("auto", 0):
        return int(runtime.preprocess_threads)
    return max(1, min(usable_cores(), MAX_PREPROCESS_THREADS))


def inflight_batch_limit(delivery: DeliverySettings, runners: int) -> int:
    """Batches the loop keeps in flight, besides realtime's reserved slot: delivery.max_inflight_batches, or (0)
    inflight_batches_per_runner for each runner, so every runner has work on a backlog. ConfigError when a set
    limit is below the runner count: some runners would never get a batch."""
    if delivery.max_inflight_batches == 0:
        return delivery.inflight_batches_per_runner * runners
    if delivery.max_inflight_batches < runners:
        raise ConfigError([
            f"delivery.max_inflight_batches: {delivery.max_inflight_batches} leaves runners idle: the runtime has "
            f"{runners} runners (runtime.instances_per_device x devices); set 0 (derived: "
            f"delivery.inflight_batches_per_runner x runners = {delivery.inflight_batches_per_runner * runners}) "
            f"or at least {runners}"])
    return delivery.max_inflight_batches


def resolve_inflight_batches(s: Settings, runners: int) -> Settings:
    """The settings with delivery.max_inflight_batches resolved for the runtime's `runners` (inflight_batch_limit),
    so every stage reads one limit (the loop, and the uncommitted cap derived from it). Idempotent."""
    limit = inflight_batch_limit(s.delivery, runners)
    return dataclasses.replace(s, delivery=dataclasses.replace(s.delivery, max_inflight_batches=limit))


def warmup_frame_shapes(s: Settings) -> list[tuple[int, int, int]]:
    """runtime.warmup_shapes as (height, width, channels) frame shapes; channels follow the model's mean."""
    channels = len(s.model.mean)
    sizes = [size for size in map(parse_size, s.runtime.warmup_shapes) if size is not None]
    return [(h, w, channels) for w, h in sizes]
