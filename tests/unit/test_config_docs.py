"""The configuration reference is generated from the fields: docs/configuration.md's tables and the JSON Schema are
what `python -m worker.config.docs` writes now, and each field's documented bounds are the ones validation holds."""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.config import ConfigError, FieldDoc, Settings, field_doc, load_settings
from worker.config import docs as config_docs
from worker.config.fields import setting
from worker.config.validate import bound_problems

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_reference_tables_and_json_schema_are_up_to_date():
    assert config_docs.stale(ROOT) == [], "run `python -m worker.config.docs` and commit docs/ and schemas/"


def test_the_check_command_names_a_stale_table_and_the_generator_rewrites_it(tmp_path, capsys):
    for path in (config_docs.DOCS_PATH, config_docs.SCHEMA_PATH):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    docs = tmp_path / config_docs.DOCS_PATH
    docs.write_text(docs.read_text().replace("| `max_batch_size` | 32 |", "| `max_batch_size` | 64 |"))
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/configuration.md: stale" in capsys.readouterr().err
    assert config_docs.main(["--root", str(tmp_path)]) == 0
    assert docs.read_text() == (ROOT / config_docs.DOCS_PATH).read_text()
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 0


def test_a_section_without_its_markers_is_refused():
    text = (ROOT / config_docs.DOCS_PATH).read_text().replace("<!-- /reference:dlq -->", "")
    with pytest.raises(ValueError, match=r"markers missing for \['dlq'\]"):
        config_docs.render_docs(text)


def test_the_prose_around_the_tables_is_kept():
    text = "intro\n<!-- reference:kafka (x) -->\nold table\n<!-- /reference:kafka -->\nafter\n"
    tables = config_docs.reference_tables()
    full = text + "".join(f"<!-- reference:{k} (x) -->\n<!-- /reference:{k} -->\n" for k in tables if k != "kafka")
    rendered = config_docs.render_docs(full)
    assert rendered.startswith("intro\n<!-- reference:kafka (x) -->\n| field | default | range | meaning |")
    assert "old table" not in rendered and "-->\nafter\n" in rendered


def test_the_json_schema_describes_every_setting_with_its_default_and_bounds():
    schema = json.loads((ROOT / config_docs.SCHEMA_PATH).read_text())
    batching = schema["properties"]["batching"]["properties"]
    assert batching["max_batch_size"] | {"description": ""} == {
        "type": "integer", "minimum": 1, "maximum": 4096, "default": 32, "description": ""}
    assert batching["realtime"]["properties"]["pending_share"]["exclusiveMinimum"] == 0
    assert schema["properties"]["observability"]["properties"]["log_level"]["enum"] == ["DEBUG", "INFO", "WARNING",
                                                                                        "ERROR"]
    threads = schema["properties"]["runtime"]["properties"]["preprocess_threads"]
    assert threads["anyOf"] == [{"type": "integer", "minimum": 0, "maximum": 256}, {"enum": ["auto"]}]
    assert schema["additionalProperties"] is False
    for section, path in _settings_paths():
        assert path[-1] in _schema_at(schema, section)["properties"], f"{'.'.join(path)} missing from the schema"


def _settings_paths() -> Iterator[tuple[list[str], list[str]]]:
    """(section path, field path) of every leaf setting."""
    pending: list[tuple[type, list[str]]] = [(Settings, [])]
    while pending:
        cls, prefix = pending.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                pending.append((hints[f.name], [*prefix, f.name]))
            else:
                yield prefix, [*prefix, f.name]


def _schema_at(schema: dict[str, Any], section: list[str]) -> dict[str, Any]:
    for name in section:
        schema = schema["properties"][name]
    return schema


def _bounded_fields() -> Iterator[tuple[str, Any, FieldDoc, Any]]:
    """(dotted name, type, entry, default) of every field with a numeric bound."""
    pending: list[tuple[type, Any, str]] = [(Settings, Settings(), "")]
    while pending:
        cls, value, prefix = pending.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                pending.append((hints[f.name], getattr(value, f.name), f"{prefix}{f.name}."))
                continue
            entry = field_doc(f)
            if (entry.ge, entry.gt, entry.le, entry.lt) != (None,) * 4:
                yield f"{prefix}{f.name}", hints[f.name], entry, getattr(value, f.name)


def _outside(kind: Any, entry: FieldDoc) -> list[float]:
    step = 1 if int in (kind, *typing.get_args(kind)) else 0.01
    values = []
    if entry.ge is not None:
        values.append(entry.ge - step)
    if entry.gt is not None:
        values.append(entry.gt)
    if entry.le is not None:
        values.append(entry.le + step)
    if entry.lt is not None:
        values.append(entry.lt)
    return values


BOUNDED = sorted(_bounded_fields(), key=lambda row: row[0])
# Fields whose bound a check across fields words better, and so replaces: `0 (derived) or >= the largest batch`.
CROSS_CHECKED = {"delivery.max_uncommitted_frames", "model.resize_shorter_side"}


@pytest.mark.parametrize(("name", "kind", "entry", "default"), BOUNDED, ids=[row[0] for row in BOUNDED])
def test_a_value_just_outside_a_documented_bound_is_refused_naming_the_setting(name, kind, entry, default):
    assert isinstance(default, str) or all(v != default for v in _outside(kind, entry)), "the default is out of range"
    for value in _outside(kind, entry):
        env = {"WORKER_" + name.replace(".", "_").upper(): str(value)}
        with pytest.raises(ConfigError) as err:
            load_settings(env=env)
        about = [p for p in err.value.problems if name in p.split(":", 1)[0]]
        assert about, (env, err.value.problems)
        # The bound's own problem, not a hand-written one restating it (validate holds only what a bound cannot say).
        assert entry.bound_problem(name) in about or name in CROSS_CHECKED, (env, about)


def test_every_documented_bound_holds_its_default():
    for name, _kind, entry, default in BOUNDED:
        if isinstance(default, str):  # preprocess_threads = "auto"
            continue
        assert entry.ge is None or default >= entry.ge, name
        assert entry.gt is None or default > entry.gt, name
        assert entry.le is None or default <= entry.le, name
        assert entry.lt is None or default < entry.lt, name


@dataclasses.dataclass(frozen=True)
class _Inner:
    share: float = setting(0.5, gt=0, le=1, doc="a share")


@dataclasses.dataclass(frozen=True)
class _Section:
    frames: int = setting(5, ge=1, le=10, unit="frames", doc="a count")
    wait_ms: float = setting(0.0, ge=0, unit="ms", hint="0 = no wait", doc="a wait")
    inner: _Inner = setting(default_factory=_Inner, doc="a table")


def test_a_field_declared_with_bounds_is_checked_without_a_check_of_its_own():
    assert bound_problems(_Section(), named=[]) == []
    assert bound_problems(_Section(frames=11, inner=_Inner(share=0)), named=[]) == [
        "frames: must be 1..10 frames", "inner.share: must be (0, 1]"]


def test_a_bound_problem_names_the_setting_its_bounds_and_its_hint_and_the_docs_show_the_hint():
    assert bound_problems(_Section(wait_ms=-1), named=[]) == ["wait_ms: must be >= 0 ms (0 = no wait)"]
    wait = field_doc(next(f for f in dataclasses.fields(_Section) if f.name == "wait_ms"))
    assert wait.range_text() == ">= 0 ms; 0 = no wait"


def test_a_bound_violation_at_load_is_refused_naming_the_setting_with_its_hint():
    with pytest.raises(ConfigError) as err:
        load_settings(env={"WORKER_LIMITS_DUPLICATE_WINDOW_FRAMES": "-1"})
    assert err.value.problems == ["limits.duplicate_window_frames: must be 0..1000000 frames (0 = off)"]
    assert err.value.setting == "limits.duplicate_window_frames"
    assert "limits.duplicate_window_frames: must be 0..1000000 frames (0 = off)" in str(err.value)


def test_a_check_across_fields_about_the_field_wins_over_its_bound():
    assert bound_problems(_Section(frames=0), named=["frames: must be 1..inner.share x 20"]) == []
