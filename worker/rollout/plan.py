"""The pure parts of a rollout: which sources a record may name (`model.allowed_sources`), which streams a
candidate scores (a hash of the stream id: sticky), and the ModelSettings a record's model becomes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from worker.config import ConfigError, ModelSettings, Settings
from worker.config.load import _apply_model_preset, _build
from worker.config.model import MODEL_PRESETS
from worker.config.validate import validate
from worker.control.records import ModelRef

BUILTIN = "builtin"
PRESETS = (BUILTIN, *MODEL_PRESETS)
SHADOW, CANARY = "shadow", "canary"
# A worker's model states (reported under `<group_id>/worker/<worker_id>`, shown by `worker rollout status`).
LOADING, WARMING, SERVING, FAILED = "loading", "warming", "serving", "failed"
_HASH_SPACE = float(1 << 64)


def source_refusal(source: str, allowed: tuple[str, ...], cwd: Path | None = None) -> str | None:
    """None when `source` may be loaded from the control topic, else why not: the presets always may; a factory
    `package.module:function` when its module starts with an allowed module prefix; a file when it lies under an
    allowed path prefix (resolved, so `..` cannot climb out)."""
    source = source.strip()
    if not source:
        return "an empty model source"
    if source in PRESETS:
        return None
    shown = ", ".join(allowed) or "none: the presets only"
    if _looks_like_factory(source):
        module = source.split(":", 1)[0]
        for prefix in allowed:
            p = prefix.rstrip(".")
            if not _looks_like_path(prefix) and (module == p or module.startswith(p + ".")):
                return None
        return (f"model source {source!r}: module {module!r} is not under model.allowed_sources ({shown}); the "
                "presets are always allowed")
    base = cwd or Path.cwd()
    path = (base / source).resolve()
    for prefix in allowed:
        if _looks_like_path(prefix) and path.is_relative_to((base / prefix).resolve()):
            return None
    return (f"model source {source!r}: the file is not under model.allowed_sources ({shown}); the presets are "
            "always allowed")


def _looks_like_factory(source: str) -> bool:
    module, sep, function = source.partition(":")
    return bool(sep) and "/" not in source and "\\" not in source and module.replace(".", "").replace(
        "_", "").isalnum() and function.isidentifier()


def _looks_like_path(prefix: str) -> bool:
    return "/" in prefix or "\\" in prefix


def stream_share(stream_id: str) -> float:
    """Where a stream falls in [0, 1): the first 8 bytes of its BLAKE2b digest. Every worker computes the same, so a
    stream is all in a candidate's share or all out, whichever worker reads it."""
    digest = hashlib.blake2b(stream_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _HASH_SPACE


def in_share(stream_id: str, share: float) -> bool:
    """Whether the candidate scores this stream at `share` (0..1): sticky, and a stream in at 0.1 is in at 0.2."""
    return share > 0.0 and stream_share(stream_id) < share


def file_ref(settings: Settings) -> ModelRef:
    """The settings file's model as a record would name it."""
    m = settings.model
    return ModelRef(m.source, m.name, m.version)


def model_settings(ref: ModelRef, base: Settings) -> ModelSettings:
    """The [model] table a record names: its preset beneath, its contract (a [model] table's keys) and name and
    version over it, the worker's own `allowed_sources` and `cache_dir`. ConfigError names each problem as
    `model.<key>`, as the settings file's would."""
    table: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in ref.contract}
    table.update(source=ref.source, allowed_sources=list(base.model.allowed_sources),
                 cache_dir=base.model.cache_dir)
    if ref.name:
        table["name"] = ref.name
    if ref.version:
        table["version"] = ref.version
    raw: dict[str, dict[str, Any]] = {"model": table}
    _apply_model_preset(raw)
    problems: list[str] = []
    model = _build(ModelSettings, raw["model"], "model", problems)
    problems += [q for q in validate(dataclasses.replace(base, model=model, models=())) if q.startswith("model.")]
    if problems:
        raise ConfigError(problems)
    return model


def rollout_settings(ref: ModelRef, base: Settings) -> Settings:
    """The worker's settings with the record's model in place of the file's (a single model: a model set's
    rollout is not supported), for the one runtime start path (worker.runtime.start.start_runtime)."""
    return dataclasses.replace(base, model=model_settings(ref, base), models=())


def contract_of(table: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A [model] table's keys as a record's contract (source, name and version are the record's own fields)."""
    kept = {k: v for k, v in table.items() if k not in ("source", "name", "version", "allowed_sources")}
    json.dumps(kept)  # a TOML table of plain values: refused here, not on the worker, if it is not
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kept.items()))


def contract_mismatch(current_hw: tuple[int, int] | None, candidate_hw: tuple[int, int] | None,
                      current_labels: tuple[str, ...], candidate_labels: tuple[str, ...],
                      policy_labels: frozenset[str] = frozenset()) -> str | None:
    """Why a candidate cannot take the current model's place between batches, or None. The batcher groups frames
    by the model's fixed input, built at start-up: a candidate must take the same input size. The policy judges the
    labels it names: a candidate must score them."""
    if current_hw != candidate_hw:
        return (f"contract mismatch: the candidate's input size {_hw(candidate_hw)} differs from the serving model's "
                f"{_hw(current_hw)} (the batcher groups frames by it: change it with a restart)")
    missing = sorted(policy_labels - set(candidate_labels))
    if missing:
        return f"contract mismatch: the candidate lacks the labels {missing} the policy judges (it has " \
               f"{list(candidate_labels)})"
    del current_labels
    return None


def _hw(hw: tuple[int, int] | None) -> str:
    return "each frame's own" if hw is None else f"{hw[0]}x{hw[1]}"


def memory_refusal(free_bytes: int | None, need_bytes: int, cap_bytes: int | None) -> str | None:
    """Whether a candidate needing `need_bytes` of device memory fits beside the serving model: None, or the refusal
    with the figures. `free_bytes`/`cap_bytes` None: the device has no cap (a CPU), nothing is refused."""
    if free_bytes is None or cap_bytes is None:
        return None
    if need_bytes > min(free_bytes, cap_bytes):
        mib = 1 << 20
        return (f"does not fit: the candidate needs about {need_bytes / mib:.0f} MiB of device memory beside the "
                f"serving model, {min(free_bytes, cap_bytes) / mib:.0f} MiB is left under the cap "
                f"({cap_bytes / mib:.0f} MiB, runtime.memory_fraction; {free_bytes / mib:.0f} MiB free); no model is "
                "evicted to make room")
    return None
