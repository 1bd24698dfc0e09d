"""A worker's side of a model rollout (issue 69), pure: it reads the group's desired model set (the control topic's
`<group_id>/models`, or the settings file's model without one) and brings the swap (worker.rollout.swap) to it.

- A candidate (or a primary this worker does not serve yet, as for a worker that joins after a promote) is loaded,
  warmed and made ready by `load` on a thread of its own while the current model serves; one load at a time.
- A load that fails (missing or corrupt file, contract mismatch, failed int8 gate, does not fit) leaves the serving
  model serving: the state is `failed` with the reason (the report, /readyz's text, a metric, one log line) and the
  same revision is not tried again; a new revision is.
- States reported: loading, warming, shadow, canary, serving, failed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from worker.control.records import ControlRecord, DesiredModels, ModelRef, RolloutReport
from worker.frames import BatchOutcome, Frame, ModelId
from worker.rollout.plan import FAILED, LOADING, SERVING, WARMING, source_refusal
from worker.rollout.swap import Held, SwappableExecutor

log = logging.getLogger(__name__)

# load(ref, warming) -> a ready executor (call warming() once loaded, before warm-up); raises with the reason.
Loader = Callable[[ModelRef, Callable[[], None]], Any]


def _spawn(run: Callable[[], None]) -> None:
    threading.Thread(target=run, name="model-rollout", daemon=True).start()


class Rollout:
    """Brings the worker's models to the group's desired set, one step at a time (`apply` on each change)."""

    def __init__(self, swap: SwappableExecutor, file_model: ModelRef, allowed: tuple[str, ...], load: Loader,
                 report: Callable[[RolloutReport], None], metrics: Any = None,
                 spawn: Callable[[Callable[[], None]], None] = _spawn,
                 on_promoted: Callable[[ModelId], None] | None = None) -> None:
        self.swap = swap
        self.file_model = file_model
        self.allowed = allowed
        self.load = load
        self.report = report
        self.metrics = metrics
        self.spawn = spawn
        self.on_promoted = on_promoted
        self._lock = threading.RLock()
        self.revision = 0
        self.desired = DesiredModels()
        self.state = SERVING
        self.reason = ""
        self._loading: ModelRef | None = None
        self._failed: dict[tuple[int, ModelRef], str] = {}
        swap.on_swap = self._swapped

    # -- the follower's thread -----------------------------------------------------------------------------------
    def apply(self, record: ControlRecord | None) -> None:
        """The group's desired model set changed (None: no record, the settings file's model)."""
        with self._lock:
            self.revision = 0 if record is None else record.revision
            self.desired = (record.models if record is not None and record.models is not None else DesiredModels())
            self._step()

    def failed_at_start(self, ref: ModelRef, revision: int, reason: str) -> None:
        """The desired primary could not be started with the worker (it serves the settings file's model)."""
        with self._lock:
            self._fail(revision, ref, reason)

    @property
    def problem(self) -> str | None:
        """/readyz's text while this worker's part of the rollout failed (the worker stays ready)."""
        with self._lock:
            if self.state != FAILED:
                return None
            return f"model rollout revision {self.revision} failed, {self.swap.serving.ref.label} serves: {self.reason}"

    def current_report(self) -> RolloutReport:
        with self._lock:
            candidate = self.swap.candidate
            pending = self._loading
            return RolloutReport(self.revision, self.state, self.reason, _label(self.swap.serving.model),
                                 _label(candidate.model) if candidate is not None else
                                 (pending.label if pending is not None else ""))

    # -- the steps (under the lock) ---------------------------------------------------------------------------------
    def _step(self) -> None:
        desired, revision = self.desired, self.revision
        if self.swap.promoting:
            return  # the loop takes the promoted model at its next batch, then steps again (_swapped)
        target = desired.primary or self.file_model
        if target != self.swap.serving.ref:
            candidate = self.swap.candidate
            if candidate is not None and candidate.ref == target:
                log.info("model rollout revision %d: promoting %s from the next batch", revision, target.label)
                self.swap.promote(candidate.executor, candidate.ref)
                self._count("promoted")
                return  # reported as serving once the loop takes it (_swapped)
            self._bring(target, revision)
            return
        want = desired.candidate
        candidate = self.swap.candidate
        if want is None:
            if candidate is not None:
                log.info("model rollout revision %d: candidate %s withdrawn, closed after its last batch", revision,
                         candidate.ref.label)
                self.swap.clear_candidate()
                self._count("aborted")
            if self._loading is None and (self.state != FAILED or not self._failed_now()):
                self._set(SERVING)
            return
        if candidate is not None and candidate.ref == want:
            self.swap.set_candidate(candidate.executor, candidate.ref, desired.mode, desired.share)
            self._set(desired.mode)
            return
        if candidate is not None:
            self.swap.clear_candidate()
        self._bring(want, revision)

    def _failed_now(self) -> bool:
        return any(rev == self.revision for rev, _ in self._failed)

    def _bring(self, ref: ModelRef, revision: int) -> None:
        """Load `ref` in the background unless it loads now or failed at this revision."""
        if self._loading is not None:
            return  # one load at a time: the step runs again when it ends
        reason = self._failed.get((revision, ref))
        if reason is not None:
            return  # not tried again at this revision
        refusal = source_refusal(ref.source, self.allowed)
        if refusal is not None:
            self._fail(revision, ref, refusal)
            return
        self._loading = ref
        self._set(LOADING)
        log.info("model rollout revision %d: loading %s from %s while %s serves", revision, ref.label, ref.source,
                 self.swap.serving.ref.label)
        self.spawn(lambda: self._load(ref, revision))

    def _load(self, ref: ModelRef, revision: int) -> None:
        def warming() -> None:
            with self._lock:
                self._set(WARMING)

        try:
            executor = self.load(ref, warming)
        except Exception as exc:  # noqa: BLE001 (any failure ends the same way: the serving model serves)
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            with self._lock:
                self._loading = None
                self._fail(revision, ref, text)
                self._step()
            return
        with self._lock:
            self._loading = None
            wanted = self.desired.candidate == ref or (self.desired.primary or self.file_model) == ref
            if not wanted:
                log.info("model rollout: %s loaded but no longer wanted: closed", ref.label)
                executor.close()
            else:
                self._count("ready")
                log.info("model rollout revision %d: %s:%s ready", self.revision, executor.model_name,
                         executor.model_version)
                mode = self.desired.mode if self.desired.candidate == ref else ""
                self.swap.set_candidate(executor, ref, mode, self.desired.share if mode else 0.0)
                self.state, self.reason = SERVING, ""  # the step below says what it is now
            self._step()

    def _fail(self, revision: int, ref: ModelRef, reason: str) -> None:
        self._failed[(revision, ref)] = reason
        self.state, self.reason = FAILED, f"{ref.label} ({ref.source}): {reason}"
        if self.metrics is not None:
            self.metrics.rollout_failed.set(1)
            self.metrics.rollout_changes.labels("failed").inc()
        log.warning("model rollout revision %d failed, %s keeps serving: %s", revision, self.swap.serving.ref.label,
                    self.reason)
        self.report(self.current_report())

    def _set(self, state: str) -> None:
        if state == self.state and state != FAILED:
            return
        self.state, self.reason = state, ""
        if self.metrics is not None:
            self.metrics.rollout_failed.set(0)
        self.report(self.current_report())

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.rollout_changes.labels(outcome).inc()

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def _swapped(self, held: Held) -> None:
        """The loop took the promoted model at this batch."""
        if self.on_promoted is not None:
            self.on_promoted(held.model)
        with self._lock:
            self._set(SERVING)
            self._step()


def _label(model: ModelId) -> str:
    return f"{model[0]}:{model[1]}"


def compare_shadow(frames: Sequence[Frame], primary: BatchOutcome, shadow: BatchOutcome,
                   metrics: Any) -> list[tuple[Frame, Any]]:
    """The shadow outcome's verdicts, counted against the serving model's for the same frames: per label, whether
    the flag agreed, and the score difference (candidate minus serving). Returns the shadow verdicts."""
    served = {(f.stream_id, f.frame_index): v for f, v in primary.verdicts}
    shadowed = list(shadow.verdicts)
    if metrics is not None:
        metrics.shadow_frames.labels("scored").inc(len(shadowed))
    for frame, verdict in shadowed:
        mine = served.get((frame.stream_id, frame.frame_index))
        if mine is None or metrics is None:
            continue
        for label, score in verdict.scores.items():
            if label not in mine.scores:
                continue
            agree = (label in verdict.flagged_labels) == (label in mine.flagged_labels)
            metrics.shadow_agreement.labels(label, "agree" if agree else "disagree").inc()
            metrics.shadow_score_difference.labels(label).observe(score - mine.scores[label])
    del frames
    return shadowed
