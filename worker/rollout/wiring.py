"""A worker's rollout, assembled (worker.app): which model it starts with (the group's desired primary when the
control topic names one, so a worker that joins after a promote serves the same revision), the swap the loop holds,
and the loader every later model goes through: the one runtime start path (worker.runtime.start.start_runtime)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.config import ConfigError, Settings
from worker.control.records import ControlRecord, ModelRef
from worker.errors import StreamferError
from worker.kafka.control import ControlUnavailable
from worker.kafka.rollout import ShadowPublisher, read_desired, skipped_counter
from worker.rollout.manager import Rollout
from worker.rollout.plan import contract_mismatch, file_ref, memory_refusal, rollout_settings, source_refusal
from worker.rollout.swap import ModelId, SwappableExecutor

log = logging.getLogger(__name__)


@dataclass
class StartChoice:
    """The settings the worker starts its model with, the record's model they name, and why the group's desired
    primary could not be used (then the settings file's model serves)."""

    settings: Settings
    ref: ModelRef
    desired: ControlRecord | None = None
    refused: str = ""


def choose_start(settings: Settings) -> StartChoice:
    """The group's desired primary when the control topic names one this worker may load, else the file's model."""
    try:
        desired = read_desired(settings)
    except ControlUnavailable as exc:
        log.warning("control topic not read before start-up, the settings file's model serves: %s", exc)
        return StartChoice(settings, file_ref(settings))
    primary = desired.models.primary if desired is not None and desired.models is not None else None
    if primary is None or primary == file_ref(settings):
        return StartChoice(settings, file_ref(settings), desired)
    refusal = source_refusal(primary.source, settings.model.allowed_sources)
    if refusal is not None:
        return StartChoice(settings, file_ref(settings), desired, refusal)
    try:
        chosen = rollout_settings(primary, settings)
    except ConfigError as exc:
        return StartChoice(settings, file_ref(settings), desired, "; ".join(exc.problems))
    log.info("the group's model set (control topic revision %d) names %s: it serves", desired.revision if desired
             else 0, primary.label)
    return StartChoice(chosen, primary, desired)


def policy_labels(settings: Settings) -> frozenset[str]:
    """The labels the settings file's policy judges: a candidate must score them."""
    p = settings.policy
    labels = set(p.flag) | set(p.review)
    for overrides in p.tenants.values():
        for table in overrides.values():
            labels |= set(table)
    return frozenset(labels)


def build_rollout(settings: Settings, start: StartChoice, executor: Any, metrics: Any,
                  on_promoted: Callable[[ModelId], None] | None = None) -> tuple[SwappableExecutor, Rollout, Any]:
    """The swap over the started executor, the rollout that drives it, and the shadow publisher (close it last)."""
    from worker.runtime.start import start_runtime  # torch loads with the runtime

    shadow = ShadowPublisher(settings, metrics)
    swap = SwappableExecutor(executor, start.ref, on_shadow=shadow, on_skipped=skipped_counter(metrics),
                             on_scored=lambda model, role, n, seconds: _scored(metrics, model, role, n, seconds))
    labels = policy_labels(settings)

    def load(ref: ModelRef, warming: Callable[[], None]) -> Any:
        try:
            chosen = rollout_settings(ref, settings)
        except ConfigError as exc:
            raise StreamferError("; ".join(exc.problems)) from None
        refusal = memory_refusal(*_device_memory(settings, chosen.model.source))
        if refusal is not None:
            raise StreamferError(refusal)

        def check(candidate: Any) -> None:
            mismatch = contract_mismatch(swap.model_input_hw, candidate.model_input_hw, tuple(executor.labels),
                                         tuple(candidate.labels), labels)
            if mismatch is not None:
                raise StreamferError(mismatch)
            warming()

        return start_runtime(chosen, before_warm_up=check, calibrate=False).executor

    rollout = Rollout(swap, file_ref(settings), settings.model.allowed_sources, load, lambda _r: None, metrics,
                      on_promoted=on_promoted)
    if start.refused and start.desired is not None and start.desired.models is not None \
            and start.desired.models.primary is not None:
        rollout.failed_at_start(start.desired.models.primary, start.desired.revision, start.refused)
    return swap, rollout, shadow


def _scored(metrics: Any, model: ModelId, role: str, n: int, seconds: float) -> None:
    metrics.model_frames.labels(model[0], model[1], role).inc(n)
    metrics.model_batch_seconds.labels(model[0], model[1]).observe(seconds)


def _device_memory(settings: Settings, source: str) -> tuple[int | None, int, int | None]:
    """(free bytes, bytes the candidate needs, the cap) on a CUDA device; (None, 0, None) on a CPU, which has no cap.
    The need is estimated by the model file's size (weights dominate a classifier's resident memory), twice over
    for the activations and graphs of its warm-up."""
    try:
        import torch
    except ImportError:
        return None, 0, None
    device = settings.runtime.device
    if device == "cpu" or not torch.cuda.is_available():
        return None, 0, None
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
    free, total = torch.cuda.mem_get_info(index)
    cap = int(total * settings.runtime.memory_fraction) - torch.cuda.memory_allocated(index)
    size = os.path.getsize(source) if os.path.isfile(source) else 0
    return free, 2 * size, max(0, cap)
