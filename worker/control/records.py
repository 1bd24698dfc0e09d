"""Control-topic records (schemas/control.avsc): keys, values, and their Avro encoding. No Kafka.

Keys: `<group_id>/policy` holds the policy the group's workers should apply; `<group_id>/worker/<worker_id>` what
that worker applies. Several groups share the topic, each reading its own keys."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import fastavro

from worker.codec.schemas import SCHEMA_DIR
from worker.config import PolicySettings

POLICY = "policy"
WORKER_STATUS = "worker_status"
APPLIED, REFUSED = "applied", "refused"

with open(SCHEMA_DIR / "control.avsc", encoding="utf-8") as _fh:
    CONTROL_SCHEMA = fastavro.parse_schema(json.load(_fh))


def policy_key(group_id: str) -> str:
    return f"{group_id}/policy"


def worker_key(group_id: str, worker_id: str) -> str:
    return f"{group_id}/worker/{worker_id}"


def revision_version(revision: int) -> str:
    """The `policy_version` results carry for a policy from the control topic."""
    return f"r{revision}"


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    policy_version: str
    state: str  # applied | refused
    reason: str = ""


@dataclass(frozen=True)
class ControlRecord:
    kind: str
    group_id: str
    revision: int
    written_at_ms: int
    written_by: str
    policy: PolicySettings | None = None
    status: WorkerStatus | None = None


def encode(record: ControlRecord) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, CONTROL_SCHEMA, _as_dict(record))
    return out.getvalue()


def decode(value: bytes) -> ControlRecord:
    """A record of this schema (a newer writer's: its extra fields are not read). Raises ValueError when the bytes
    are not a control record."""
    try:
        raw = fastavro.schemaless_reader(io.BytesIO(value), CONTROL_SCHEMA, None)
    except Exception as exc:  # noqa: BLE001 (any decoding failure: not a control record)
        raise ValueError(f"not a control record: {type(exc).__name__}: {exc}") from None
    assert isinstance(raw, dict)
    written_at = raw["written_at"]
    if hasattr(written_at, "timestamp"):
        written_at = int(round(written_at.timestamp() * 1000))
    policy = raw.get("policy")
    status = raw.get("status")
    return ControlRecord(
        kind=raw["kind"], group_id=raw["group_id"], revision=raw["revision"], written_at_ms=int(written_at),
        written_by=raw["written_by"],
        policy=None if policy is None else PolicySettings(
            flag=dict(policy["flag"]), review=dict(policy["review"]),
            tenants={t: {"flag": dict(v["flag"]), "review": dict(v["review"])} for t, v in policy["tenants"].items()},
            expired=policy["expired"]),
        status=None if status is None else WorkerStatus(status["worker_id"], status["policy_version"], status["state"],
                                                        status["reason"]))


def _as_dict(record: ControlRecord) -> dict[str, Any]:
    p, s = record.policy, record.status
    return {
        "kind": record.kind, "group_id": record.group_id, "revision": record.revision,
        "written_at": record.written_at_ms, "written_by": record.written_by,
        "policy": None if p is None else {
            "flag": dict(p.flag), "review": dict(p.review),
            "tenants": {t: {"flag": dict(v.get("flag", {})), "review": dict(v.get("review", {}))}
                        for t, v in p.tenants.items()},
            "expired": p.expired},
        "status": None if s is None else {"worker_id": s.worker_id, "policy_version": s.policy_version,
                                          "state": s.state, "reason": s.reason},
    }
