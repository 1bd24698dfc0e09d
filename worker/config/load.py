"""Reading settings: a TOML file, then `WORKER_<SECTION>_<FIELD>` environment variables, then explicit overrides
(CLI flags), each value converted to its field's type; then `validate` checks everything at once."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from worker.config.fields import ENV_PREFIX, ConfigError
from worker.config.model import MODEL_PRESETS, ModelSettings
from worker.config.settings import SECTIONS, TABLE_SECTIONS, Settings
from worker.config.validate import validate


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Merge file < environment < explicit overrides (CLI flags), then validate everything at once."""
    raw: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    if path is not None:
        try:
            with open(path, "rb") as fh:
                file_data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError([f"config file {path}: not found"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"config file {path}: not valid TOML ({exc})"]) from None
        for section, values in file_data.items():
            if section not in SECTIONS:
                problems.append(f"[{section}]: unknown section (known: {', '.join(SECTIONS)})")
            elif not isinstance(values, dict):
                problems.append(f"[{section}]: must be a table")
            else:
                raw.setdefault(section, {}).update(values)
    for key, value in (os.environ if env is None else env).items():
        if not key.startswith(ENV_PREFIX):
            continue
        rest = key[len(ENV_PREFIX):].lower()
        # The longest section the name starts with: WORKER_SCHEMA_REGISTRY_URL is [schema_registry] url.
        section = max((s for s in SECTIONS if rest.startswith(s + "_")), key=len, default="")
        name = rest[len(section) + 1:]
        if section and name:
            raw.setdefault(section, {})[name] = value
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    raw_models = _first_of_model_set(raw, raw.pop("models", None), problems)
    _apply_model_preset(raw)

    built: dict[str, Any] = {}
    for section, section_type in _section_types().items():
        built[section] = _build(section_type, raw.get(section, {}), section, problems)
    # Fields that failed to parse were left at their defaults, so range checks still run on the rest.
    settings = Settings(**built)
    if raw_models:
        settings = dataclasses.replace(settings, models=_build_model_set(raw_models, settings.model, problems))
    problems.extend(validate(settings))
    if problems:
        raise ConfigError(problems)
    return settings


def _apply_model_preset(raw: dict[str, dict[str, Any]]) -> None:
    """A preset's settings go beneath the ones given, so a config may still override any of them."""
    source = raw.get("model", {}).get("source")
    preset = MODEL_PRESETS.get(source.strip()) if isinstance(source, str) else None
    for section, values in (preset or {}).items():
        raw[section] = {**values, **raw.get(section, {})}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Settings)
    return {name: hints[name] for name in TABLE_SECTIONS}  # models: _build_model_set


# -- a model set: [models.<name>] tables (issue 50) -----------------------------------------------------------------
def _first_of_model_set(raw: dict[str, Any], raw_models: Any, problems: list[str]) -> dict[str, Any]:
    """[models.<name>] given: [model] must not be, and becomes the first model's (so settings.model is it).
    Returns the model tables ({} when none, or when they are not tables)."""
    if raw_models is None:
        return {}
    if not isinstance(raw_models, dict) or not raw_models or \
            not all(isinstance(v, dict) for v in raw_models.values()):
        problems.append("[models]: must hold one [models.<name>] table per model (declared in the config file)")
        return {}
    if raw.get("model"):
        problems.append("[model] and [models.<name>]: declare either one model ([model]) or a model set "
                        "([models.<name>] tables), not both")
    name, first = next(iter(raw_models.items()))
    raw["model"] = {"name": name, **first}
    return raw_models


def _build_model_set(raw_models: dict[str, Any], first: ModelSettings,
                     problems: list[str]) -> tuple[ModelSettings, ...]:
    """Each [models.<name>] table as a ModelSettings (its preset beneath, `name` the table's name unless set),
    checked as [model] is, and the cascade conditions against the models declared before it."""
    out = [first]
    for name, values in list(raw_models.items())[1:]:
        section = {"model": {"name": name, **values}}
        _apply_model_preset(section)
        where = f"models.{name}"
        inner: list[str] = []
        member = _build(ModelSettings, section["model"], "model", inner)
        inner.extend(q for q in validate(dataclasses.replace(Settings(), model=member)) if q.startswith("model"))
        problems.extend(q.replace("model.", f"{where}.", 1) for q in inner if "a cascade needs a model set" not in q)
        out.append(member)
    for position, m in enumerate(out):
        if not (m.run_if_model or m.run_if_label):
            continue
        earlier = {e.name: e for e in out[:position]}
        where = f"models.{m.name}"
        if m.run_if_model not in earlier:
            problems.append(f"{where}.run_if_model: {m.run_if_model!r} is not a model declared before it "
                            f"({', '.join(earlier) or 'none'})")
        elif m.run_if_label not in earlier[m.run_if_model].labels:
            problems.append(f"{where}.run_if_label: {m.run_if_label!r} is not a label of {m.run_if_model!r} "
                            f"({list(earlier[m.run_if_model].labels)})")
    if len({m.name for m in out}) != len(out):
        problems.append(f"[models.<name>]: model names must differ (got {[m.name for m in out]})")
    return tuple(out)




# Settings that were removed, with what replaced them: a config written for an older worker is told what to change.
RETIRED_SETTINGS = {
    "kafka.group_instance_id": ("removed: the group.instance.id is now the worker id (observability.worker_id), "
                                "static by default; set kafka.static_membership = false for dynamic membership"),
}
def _build(cls: type, values: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    nested_prefixes = {n for n in known if dataclasses.is_dataclass(hints[n])}
    nested_values: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        # Env vars flatten nested tables: WORKER_BATCHING_REALTIME_MAX_WAIT_MS -> realtime.max_wait_ms.
        prefix, _, sub = key.partition("_")
        if key not in known and prefix in nested_prefixes and sub:
            nested_values.setdefault(prefix, {})[sub] = value
            continue
        if key not in known and f"{where}.{key}" in RETIRED_SETTINGS:
            problems.append(f"{where}.{key}: {RETIRED_SETTINGS[f'{where}.{key}']}")
            continue
        if key not in known:
            problems.append(f"{where}.{key}: unknown setting (known: {', '.join(sorted(known))})")
            continue
        if key in nested_prefixes:
            if not isinstance(value, Mapping):
                problems.append(f"{where}.{key}: must be a table")
                continue
            nested_values.setdefault(key, {}).update(value)
            continue
        try:
            kwargs[key] = _coerce(value, hints[key])
        except (TypeError, ValueError) as exc:
            # librdkafka overrides may carry a secret: never echo them.
            shown = "a value not shown" if key.endswith("_overrides") else repr(value)
            problems.append(f"{where}.{key}: {exc} (got {shown})")
    for name, sub_values in nested_values.items():
        default = next(f for f in dataclasses.fields(cls) if f.name == name)
        factory = default.default_factory
        base = dataclasses.asdict(factory()) if factory is not dataclasses.MISSING else {}
        base.update(sub_values)
        kwargs[name] = _build(hints[name], base, f"{where}.{name}", problems)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        problems.append(f"{where}: {exc}")
        return cls()


def _coerce(value: Any, hint: Any) -> Any:
    """Turn a TOML value or an env-var string into the declared type, or raise with what was expected."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin is Literal:
        # Case-insensitive, returning the declared spelling: WORKER_OBSERVABILITY_LOG_LEVEL=debug is "DEBUG".
        allowed = typing.get_args(hint)
        match = next((a for a in allowed if isinstance(value, str) and a.lower() == value.lower()), None)
        if match is None:
            raise ValueError(f"must be one of {', '.join(repr(a) for a in allowed)}")
        return match
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError("expected true or false")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError("expected an integer") from None
    if hint is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError("expected a number") from None
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError("expected a string")
        return str(value)
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected a list")
        return tuple(_coerce(v, item_type) for v in value)
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if isinstance(value, str):
            pairs = [p for p in value.split(",") if p.strip()]
            try:
                value = dict(p.split("=", 1) for p in pairs)
            except ValueError:
                raise ValueError("expected key=value pairs separated by commas") from None
        if not isinstance(value, Mapping):
            raise ValueError("expected a table of key = value")
        return {_coerce(k, key_type): _coerce(v, value_type) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        # The first alternative the value converts to wins (int | Literal["auto"]: "4" is 4, "auto" is "auto").
        expected = []
        for alternative in typing.get_args(hint):
            try:
                return _coerce(value, alternative)
            except ValueError as exc:
                expected.append(str(exc))
        raise ValueError(" or ".join(expected))
    raise TypeError(f"unsupported setting type {hint}")
