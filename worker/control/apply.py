"""A worker applying the control topic's policy (pure: no Kafka): offered to the Judge, which takes it from the next
batch or refuses it; each outcome is one log line, the metrics, /readyz's text, and the report this worker writes
under its own key (`<group_id>/worker/<worker_id>`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.config import PolicySettings
from worker.control.records import APPLIED, REFUSED, WORKER_STATUS, ControlRecord, WorkerStatus, revision_version
from worker.metrics import Metrics
from worker.policy.judge import Judge
from worker.policy.verdicts import settings_version

log = logging.getLogger(__name__)


class PolicyApplier:
    """Applies each change of the group's desired policy once (no retry of a refused revision in a loop)."""

    def __init__(self, judge: Judge, file_policy: PolicySettings, group_id: str, worker_id: str,
                 metrics: Metrics | None = None, clock_ms: Callable[[], int] | None = None) -> None:
        self.judge = judge
        self.file_policy = file_policy
        self.group_id = group_id
        self.worker_id = worker_id
        self.metrics = metrics
        self.clock_ms = clock_ms or (lambda: 0)
        self.revision = 0  # the revision last offered (0: the settings file's policy)
        self.problem: str | None = None  # /readyz's text while a revision is refused

    def apply(self, desired: ControlRecord | None) -> ControlRecord:
        """Offer `desired` (None: no record, the settings file's policy decides) and return this worker's report."""
        if desired is None or desired.policy is None:
            revision, settings, version = 0, self.file_policy, ""
        else:
            revision, settings, version = desired.revision, desired.policy, revision_version(desired.revision)
        self.revision = revision
        if revision == 0:
            version = settings_version(settings)
        refusal = self.judge.offer(settings, version)
        if refusal is None:
            self.problem = None
            if self.metrics is not None:
                self.metrics.policy_refused.set(0)
                self.metrics.policy_applied.labels(APPLIED).inc()
            log.info("policy %s applied from the next batch (control topic revision %d)", version, revision)
            status = WorkerStatus(self.worker_id, version, APPLIED)
        else:
            kept = self.judge.version
            self.problem = f"policy {version} refused, judging with {kept}: {refusal.reason}"
            if self.metrics is not None:
                self.metrics.policy_refused.set(1)
                self.metrics.policy_applied.labels(REFUSED).inc()
            log.warning("policy %s refused (control topic revision %d), keeping %s: %s", version, revision, kept,
                        refusal.reason)
            status = WorkerStatus(self.worker_id, kept, REFUSED, f"revision {revision}: {refusal.reason}")
        return ControlRecord(WORKER_STATUS, self.group_id, revision, self.clock_ms(), self.worker_id, status=status)
