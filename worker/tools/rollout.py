"""`worker rollout start|promote|abort|status`: the group's desired model set on the control topic (issue 69).

`start` names a candidate (what model.source takes; a non-preset's contract from `--config`'s [model] or
[models.<name>] table of that source or name) in shadow or canary at a share of streams; `promote` makes the
candidate the primary; `abort` withdraws it. Each writes the group's next revision under `<group_id>/models`.
`status` prints the desired set and each worker's revision and state."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from worker.config import ConfigError, Settings
from worker.control.records import MODELS, ControlRecord, DesiredModels, ModelRef, models_key
from worker.kafka.control import ControlReader
from worker.kafka.rollout import status_settings
from worker.rollout.plan import CANARY, SHADOW, contract_of, file_ref, model_settings, source_refusal
from worker.tools.controltopic import now_ms, operator, read_control, write_control


def _current(reader: ControlReader) -> tuple[int, DesiredModels]:
    record = reader.state.models
    return (0, DesiredModels()) if record is None or record.models is None else (record.revision, record.models)


def _write(settings: Settings, revision: int, models: DesiredModels, written_by: str | None) -> dict[str, Any]:
    group = settings.kafka.group_id
    record = ControlRecord(MODELS, group, revision, now_ms(), operator(written_by), models=models)
    write_control(settings, models_key(group), record)
    return {"group_id": group, "revision": revision, "topic": settings.topics.control, "written_by": record.written_by,
            "written_at_ms": record.written_at_ms, **describe(models)}


def describe(models: DesiredModels) -> dict[str, Any]:
    return {"primary": None if models.primary is None else models.primary.label,
            "candidate": None if models.candidate is None else models.candidate.label,
            "mode": models.mode, "share": models.share}


def contract_table(config: str | None, source: str, name: str) -> dict[str, Any]:
    """The [model] or [models.<name>] table of `config` that names this source (or this name): its keys are the
    candidate's contract. Empty when there is none (a preset needs none)."""
    if not config:
        return {}
    try:
        data = tomllib.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([f"{config}: cannot be read ({exc})"]) from None
    tables: list[tuple[str, dict[str, Any]]] = []
    if isinstance(data.get("model"), dict):
        tables.append(("", data["model"]))
    for key, table in (data.get("models") or {}).items():
        if isinstance(table, dict):
            tables.append((key, {"name": key, **table}))
    for key, table in tables:
        if (name and (table.get("name") == name or key == name)) or table.get("source") == source:
            return dict(table)
    return {}


def start(settings: Settings, source: str, name: str = "", version: str = "", shadow: float | None = None,
          canary: float | None = None, config: str | None = None, written_by: str | None = None) -> dict[str, Any]:
    """Check the candidate as a worker would (allowed source, its [model] table), then write it with its mode."""
    if (shadow is None) == (canary is None):
        raise ConfigError(["rollout start: give one of --shadow RATIO or --canary RATIO"])
    mode, share = (SHADOW, shadow) if shadow is not None else (CANARY, canary)
    assert share is not None
    if not 0.0 <= share <= 1.0:
        raise ConfigError([f"rollout start: --{mode} {share}: a share of streams in [0, 1]"])
    refusal = source_refusal(source, settings.model.allowed_sources)
    if refusal is not None:
        raise ConfigError([f"model.allowed_sources: {refusal}"])
    table = contract_table(config, source, name)
    ref = ModelRef(source, name or str(table.get("name", "")), version or str(table.get("version", "")),
                   contract_of(table))
    model = model_settings(ref, settings)  # ConfigError names each problem as the worker would
    ref = ModelRef(ref.source, model.name, model.version, ref.contract)
    reader = read_control(settings)
    revision, current = _current(reader)
    primary = current.primary
    if ref == (primary or file_ref(settings)):
        raise ConfigError([f"rollout start: {ref.label} is the primary already"])
    return _write(settings, revision + 1, DesiredModels(primary, ref, mode, share), written_by)


def promote(settings: Settings, written_by: str | None = None) -> dict[str, Any]:
    reader = read_control(settings)
    revision, current = _current(reader)
    if current.candidate is None:
        raise ConfigError(["rollout promote: no candidate to promote (start one with `worker rollout start`)"])
    return _write(settings, revision + 1, DesiredModels(current.candidate), written_by)


def abort(settings: Settings, written_by: str | None = None) -> dict[str, Any]:
    reader = read_control(settings)
    revision, current = _current(reader)
    if current.candidate is None:
        raise ConfigError(["rollout abort: no candidate is rolling out"])
    return _write(settings, revision + 1, DesiredModels(current.primary), written_by)


def status(settings: Settings) -> dict[str, Any]:
    reader = read_control(settings)
    revision, current = _current(reader)
    record = reader.state.models
    if settings.topics.worker_status:  # the workers' reports are there
        reader = read_control(status_settings(settings))
    return {
        "group_id": settings.kafka.group_id, "revision": revision, **describe(current),
        "written_by": None if record is None else record.written_by,
        "written_at_ms": None if record is None else record.written_at_ms,
        "workers": {w: {"revision": r.revision, "state": r.state, "reason": r.reason, "serving": r.serving,
                        "candidate": r.candidate} for w, r in sorted(reader.state.rollouts.items())},
    }


def format_status(shown: dict[str, Any]) -> str:
    desired = (f"revision {shown['revision']}: primary {shown['primary'] or 'the settings file model'}"
               + (f", candidate {shown['candidate']} in {shown['mode']} at {shown['share']:g}" if shown['candidate']
                  else ""))
    lines = [f"group {shown['group_id']}: {desired}"]
    for worker, s in shown["workers"].items():
        lines.append(f"  {worker:<30} r{s['revision']:<4} {s['state']:<8} serving {s['serving']}"
                     + (f", candidate {s['candidate']}" if s["candidate"] else "")
                     + (f": {s['reason']}" if s["reason"] else ""))
    if not shown["workers"]:
        lines.append("  no worker has reported yet")
    return "\n".join(lines)
