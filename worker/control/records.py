"""Control-topic records (schemas/control.avsc): keys, values, and their Avro encoding. No Kafka.

Keys: `<group_id>/policy` holds the policy the group's workers should apply; `<group_id>/worker/<worker_id>` what
that worker applies. Several groups share the topic, each reading its own keys."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fastavro

from worker.codec.schemas import SCHEMA_DIR
from worker.config import PolicySettings

POLICY = "policy"
WORKER_STATUS = "worker_status"
APPLIED, REFUSED = "applied", "refused"
MODELS = "models"  # issue 69: the group's desired model set (worker/control/models.py)

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
class ModelRef:
    """A model as `worker rollout start` names it: `source` as model.source takes it, with its name, version and (a
    non-preset's) contract, the [model] table's other keys."""

    source: str
    name: str = ""
    version: str = ""
    contract: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs of the [model] table, JSON values

    @property
    def label(self) -> str:
        return f"{self.name or self.source}:{self.version or '?'}"

    def as_avro(self) -> dict[str, Any]:
        return {"source": self.source, "name": self.name, "version": self.version,
                "contract": json.dumps(dict(self.contract), sort_keys=True)}

    @classmethod
    def from_avro(cls, raw: dict[str, Any]) -> ModelRef:
        table = json.loads(raw.get("contract") or "{}")
        return cls(raw["source"], raw["name"], raw["version"], tuple(sorted(_frozen(table).items())))


def _frozen(table: dict[str, Any]) -> dict[str, Any]:
    """JSON lists as tuples, so a ModelRef is hashable and compares by value."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


@dataclass(frozen=True)
class DesiredModels:
    """The group's desired model set: the primary (None: the settings file's model) and a candidate with its mode
    (shadow | canary) and share of streams while one rolls out."""

    primary: ModelRef | None = None
    candidate: ModelRef | None = None
    mode: str = ""
    share: float = 0.0

    def as_avro(self) -> dict[str, Any]:
        return {"primary": None if self.primary is None else self.primary.as_avro(),
                "candidate": None if self.candidate is None else self.candidate.as_avro(),
                "mode": self.mode, "share": self.share}

    @classmethod
    def from_avro(cls, raw: dict[str, Any]) -> DesiredModels:
        return cls(None if raw["primary"] is None else ModelRef.from_avro(raw["primary"]),
                   None if raw["candidate"] is None else ModelRef.from_avro(raw["candidate"]), raw["mode"],
                   float(raw["share"]))


@dataclass(frozen=True)
class RolloutReport:
    """A worker's model state: loading | warming | shadow | canary | serving | failed (with the reason)."""

    revision: int
    state: str
    reason: str = ""
    serving: str = ""
    candidate: str = ""


def models_key(group_id: str) -> str:
    return f"{group_id}/models"


@dataclass(frozen=True)
class ControlRecord:
    kind: str
    group_id: str
    revision: int
    written_at_ms: int
    written_by: str
    policy: PolicySettings | None = None
    status: WorkerStatus | None = None
    models: DesiredModels | None = None  # kind `models` (issue 69)
    rollout: RolloutReport | None = None  # a worker_status's model part (issue 69)


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
    parts = {name: None if raw.get(name) is None else from_avro(raw[name]) for name, (_, from_avro) in _PARTS.items()}
    return ControlRecord(kind=raw["kind"], group_id=raw["group_id"], revision=raw["revision"],
                         written_at_ms=int(written_at), written_by=raw["written_by"], **parts)


def _as_dict(record: ControlRecord) -> dict[str, Any]:
    parts = {name: None if getattr(record, name) is None else as_avro(getattr(record, name))
             for name, (as_avro, _) in _PARTS.items()}
    return {"kind": record.kind, "group_id": record.group_id, "revision": record.revision,
            "written_at": record.written_at_ms, "written_by": record.written_by, **parts}


def _policy_as_avro(p: PolicySettings) -> dict[str, Any]:
    return {"flag": dict(p.flag), "review": dict(p.review),
            "tenants": {t: {"flag": dict(v.get("flag", {})), "review": dict(v.get("review", {}))}
                        for t, v in p.tenants.items()},
            "expired": p.expired}


def _policy_from_avro(raw: dict[str, Any]) -> PolicySettings:
    return PolicySettings(flag=dict(raw["flag"]), review=dict(raw["review"]), expired=raw["expired"],
                          tenants={t: {"flag": dict(v["flag"]), "review": dict(v["review"])}
                                   for t, v in raw["tenants"].items()})


# A record's optional parts, each with its Avro form both ways (the schema's field names).
_PARTS: dict[str, tuple[Callable[[Any], dict[str, Any]], Callable[[dict[str, Any]], Any]]] = {
    "policy": (_policy_as_avro, _policy_from_avro),
    "status": (dataclasses.asdict, lambda raw: WorkerStatus(**raw)),
    "models": (DesiredModels.as_avro, DesiredModels.from_avro),
    "rollout": (dataclasses.asdict, lambda raw: RolloutReport(**raw)),
}
