"""What a reader of the control topic knows: the last record of each key of its group (compaction keeps the same),
so a worker that starts late derives the same state as one that read every record. Pure."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from worker.control.records import (
    MODELS,
    POLICY,
    WORKER_STATUS,
    ControlRecord,
    RolloutReport,
    WorkerStatus,
    decode,
    models_key,
    policy_key,
)

log = logging.getLogger(__name__)


@dataclass
class ControlState:
    """The group's desired policy and its workers' reports, from the records read so far (in the topic's order)."""

    group_id: str
    policy: ControlRecord | None = None
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    skipped: int = 0  # records of this group that could not be read (logged once each)
    # issue 69: the desired model set (`<group_id>/models`), how often it changed, and each worker's model report.
    models: ControlRecord | None = None
    models_changes: int = 0
    rollouts: dict[str, RolloutReport] = field(default_factory=dict)

    def take(self, key: bytes | None, value: bytes | None) -> bool:
        """Take one record; True when it changed the desired policy. Other groups' keys are ignored; a tombstone
        (null value) deletes its key (a policy key deleted: the settings file decides again)."""
        name = (key or b"").decode(errors="replace")
        prefix = f"{self.group_id}/"
        if not name.startswith(prefix):
            return False
        if value is None:
            if name == models_key(self.group_id):
                self.models, self.models_changes = None, self.models_changes + 1
                return False
            if name == policy_key(self.group_id):
                changed, self.policy = self.policy is not None, None
                return changed
            self.workers.pop(name[len(prefix):].removeprefix("worker/"), None)
            self.rollouts.pop(name[len(prefix):].removeprefix("worker/"), None)
            return False
        try:
            record = decode(value)
        except ValueError as exc:
            self.skipped += 1
            log.warning("control topic: record %s skipped: %s", name, exc)
            return False
        if record.kind == POLICY and name == policy_key(self.group_id) and record.policy is not None:
            self.policy = record
            return True
        if record.kind == WORKER_STATUS and record.status is not None:
            self.workers[record.status.worker_id] = record.status
            if record.rollout is not None:
                self.rollouts[record.status.worker_id] = record.rollout
        if record.kind == MODELS and name == models_key(self.group_id) and record.models is not None:
            self.models, self.models_changes = record, self.models_changes + 1
        return False  # a kind this version does not know (rollouts' `models`): another reader's

    @property
    def revision(self) -> int:
        """The desired policy's revision, 0 without one."""
        return self.policy.revision if self.policy is not None else 0
