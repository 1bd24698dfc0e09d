"""`worker policy set` and `worker policy show`: the group's policy on the control topic (issue 66).

`set` checks a file's [policy] section as the worker would (with `--config`, against the model's labels too), then
writes it as the group's next revision under `<group_id>/policy`; every worker of the group applies it from its
next batch. `show` prints the group's desired revision and what each worker reports it applies."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from worker.config import ConfigError, PolicySettings, Settings, model_label_thresholds, policy_problems
from worker.config.load import _build
from worker.control.records import POLICY, ControlRecord, policy_key, revision_version
from worker.tools.controltopic import now_ms, operator, read_control, write_control


def read_policy_file(path: str | Path, settings: Settings | None = None) -> PolicySettings:
    """The [policy] section of a TOML file, checked (against the model's labels with `settings`); ConfigError names
    each problem with its line in the file."""
    text = _read(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML ({exc})"]) from None
    problems = [f"{path}: [{name}]: unknown section (a policy file holds [policy] only)"
                for name in data if name != "policy"]
    raw = data.get("policy")
    if not isinstance(raw, dict):
        raise ConfigError([*problems, f"{path}: no [policy] table"])
    built: list[str] = []
    policy = _build(PolicySettings, raw, "policy", built)
    models = (settings.models or (settings.model,)) if settings is not None else None
    built += policy_problems(policy, model_label_thresholds(models) if models else None)
    problems += [f"{problem} ({path}, line {line_of(text, problem)})" for problem in built]
    if problems:
        raise ConfigError(problems)
    return policy


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot be read ({exc.strerror})"]) from None


def line_of(text: str, problem: str) -> int:
    """The line of the file a problem's setting (`policy.tenants.kids.review.nudity: ...`) is written on: each part
    of its name found in turn, from the line the one before was found on (1 when not found)."""
    parts = problem.split(":", 1)[0].strip().split(".")
    lines = text.splitlines()
    at = 0
    for part in parts:
        for n in range(at, len(lines)):
            if part in lines[n]:
                at = n
                break
    return at + 1


def set_policy(settings: Settings, path: str, written_by: str | None = None) -> dict[str, Any]:
    """Check the file, then write it as the group's next revision; returns what was written."""
    policy = read_policy_file(path, settings)
    reader = read_control(settings)
    revision = reader.state.revision + 1
    group = settings.kafka.group_id
    record = ControlRecord(POLICY, group, revision, now_ms(), operator(written_by), policy=policy)
    write_control(settings, policy_key(group), record)
    return {"group_id": group, "revision": revision, "policy_version": revision_version(revision),
            "topic": settings.topics.control, "written_by": record.written_by}


def show_policy(settings: Settings) -> dict[str, Any]:
    """The group's desired policy (revision, version, who wrote it when) and each worker's report."""
    state = read_control(settings, required=False).state
    desired = state.policy
    return {
        "group_id": settings.kafka.group_id,
        "desired": None if desired is None else {
            "revision": desired.revision, "policy_version": revision_version(desired.revision),
            "written_by": desired.written_by, "written_at_ms": desired.written_at_ms},
        "workers": {w: {"policy_version": s.policy_version, "state": s.state, "reason": s.reason}
                    for w, s in sorted(state.workers.items())},
    }


def format_show(shown: dict[str, Any]) -> str:
    desired = shown["desired"]
    lines = [f"group {shown['group_id']}: desired "
             + ("the settings file's policy (no revision written)" if desired is None else
                f"{desired['policy_version']} by {desired['written_by']}")]
    for worker, s in shown["workers"].items():
        lines.append(f"  {worker:<30} {s['policy_version']:<20} {s['state']}" + (f": {s['reason']}" if s["reason"]
                                                                               else ""))
    if not shown["workers"]:
        lines.append("  no worker has reported yet")
    return "\n".join(lines)


def dumps(value: Any) -> str:
    return json.dumps(value)
