"""Model rollouts, pure (issue 69): the control topic's model set and worker reports, which sources a record may
name, the sticky share of streams, and the ModelSettings a record's model becomes."""

from __future__ import annotations

import copy
import io
import json

import fastavro
import pytest

from worker.codec.schemas import SCHEMA_DIR
from worker.config import ConfigError, Settings
from worker.control.records import (
    MODELS,
    WORKER_STATUS,
    ControlRecord,
    DesiredModels,
    ModelRef,
    RolloutReport,
    WorkerStatus,
    decode,
    encode,
    models_key,
    worker_key,
)
from worker.control.state import ControlState
from worker.rollout.plan import (
    FAILED,
    LOADING,
    SHADOW,
    contract_mismatch,
    contract_of,
    file_ref,
    in_share,
    memory_refusal,
    model_settings,
    source_refusal,
    stream_share,
)

OLD = ModelRef("builtin", "streamfer-moderation-cnn", "1")
NEW = ModelRef("builtin", "streamfer-moderation-cnn", "2")


def models_record(revision: int, models: DesiredModels, group: str = "g") -> ControlRecord:
    return ControlRecord(MODELS, group, revision, 1_700_000_000_000, "ops@host", models=models)


# -- records and state ---------------------------------------------------------------------------------------------
def test_a_models_record_and_a_worker_report_round_trip():
    contract = contract_of({"labels": ["a", "b"], "input_size": [224, 224], "activation": "softmax"})
    desired = DesiredModels(OLD, ModelRef("/m/x.onnx", "x", "7", contract), SHADOW, 0.2)
    got = decode(encode(models_record(5, desired)))
    assert (got.kind, got.revision, got.models) == (MODELS, 5, desired)
    report = ControlRecord(WORKER_STATUS, "g", 1, 1, "w1", status=WorkerStatus("w1", "r1", "applied"),
                           rollout=RolloutReport(5, FAILED, "no such file", "cnn:1", "x:7"))
    assert decode(encode(report)).rollout == report.rollout


def test_a_reader_without_the_rollout_fields_reads_a_record_with_them():
    """The policy helper's readers (schema before issue 69) skip `models` and `rollout`: fields only ever trail."""
    schema = json.loads((SCHEMA_DIR / "control.avsc").read_text())
    older = copy.deepcopy(schema)
    older["fields"] = [f for f in older["fields"] if f["name"] not in ("models", "rollout")]
    value = encode(ControlRecord(WORKER_STATUS, "g", 3, 1, "w1", status=WorkerStatus("w1", "r3", "applied"),
                                 rollout=RolloutReport(2, SHADOW, "", "a:1", "a:2")))
    raw = fastavro.schemaless_reader(io.BytesIO(value), fastavro.parse_schema(older), None)
    assert raw["status"]["policy_version"] == "r3" and "rollout" not in raw


def test_state_follows_the_groups_models_key_and_worker_reports():
    state = ControlState("g")
    assert not state.take(models_key("g").encode(), encode(models_record(1, DesiredModels(None, NEW, SHADOW, 0.1))))
    assert state.models is not None and state.models.revision == 1 and state.models_changes == 1
    state.take(models_key("other").encode(), encode(models_record(9, DesiredModels(), group="other")))
    assert state.models.revision == 1 and state.models_changes == 1
    state.take(worker_key("g", "w1").encode(), encode(ControlRecord(
        WORKER_STATUS, "g", 0, 1, "w1", status=WorkerStatus("w1", "file-x", "applied"),
        rollout=RolloutReport(1, LOADING)))),
    assert state.rollouts["w1"].state == LOADING and state.policy is None
    state.take(models_key("g").encode(), None)  # a tombstone: the settings file decides again
    assert state.models is None and state.models_changes == 2


# -- sources, shares, settings ------------------------------------------------------------------------------------
def test_presets_are_always_allowed_and_the_default_allows_nothing_else(tmp_path):
    for preset in ("builtin", "opennsfw", "nudenet"):
        assert source_refusal(preset, ()) is None
    refusal = source_refusal(str(tmp_path / "m.onnx"), ())
    assert refusal is not None and "model.allowed_sources" in refusal and "presets only" in refusal
    assert source_refusal("evil.mod:build", ()) is not None


def test_allowed_path_and_module_prefixes(tmp_path):
    allowed = (f"{tmp_path}/models/", "acme.models")
    assert source_refusal(str(tmp_path / "models" / "a.onnx"), allowed) is None
    assert source_refusal(str(tmp_path / "models" / ".." / "elsewhere.onnx"), allowed) is not None  # no climbing out
    assert source_refusal("acme.models.nsfw:build", allowed) is None
    assert source_refusal("acme.models:build", allowed) is None
    assert source_refusal("acme.modelsevil:build", allowed) is not None
    assert source_refusal("acme:build", allowed) is not None
    assert source_refusal("models/a.onnx", ("models/",), cwd=tmp_path) is None


def test_the_share_is_sticky_monotone_and_near_its_ratio():
    streams = [f"cam-{i}" for i in range(20_000)]
    at_20 = {s for s in streams if in_share(s, 0.2)}
    assert 0.19 < len(at_20) / len(streams) < 0.21
    assert at_20 == {s for s in streams if in_share(s, 0.2)}  # the same every time, on every worker
    assert {s for s in streams if in_share(s, 0.1)} <= at_20  # widening a share keeps the streams already in
    assert not any(in_share(s, 0.0) for s in streams) and all(in_share(s, 1.0) for s in streams)
    assert all(0.0 <= stream_share(s) < 1.0 for s in streams[:100])


def test_a_record_model_becomes_settings_with_its_preset_beneath():
    m = model_settings(ModelRef("opennsfw", "", "v9"), Settings())
    assert (m.name, m.version, m.labels, m.input_size) == ("open_nsfw", "v9", ("sfw", "nsfw"), (224, 224))
    table = {"labels": ["a", "b"], "activation": "softmax", "thresholds": {"a": 0.7}}
    m = model_settings(ModelRef("/m/x.pt", "x", "3", contract_of(table)), Settings())
    assert (m.source, m.labels, m.thresholds, m.activation) == ("/m/x.pt", ("a", "b"), {"a": 0.7}, "softmax")
    with pytest.raises(ConfigError, match="model.never_flag"):
        model_settings(ModelRef("/m/x.pt", "x", "3", contract_of({"labels": ["a"], "never_flag": ["zz"]})),
                       Settings())


def test_contract_mismatch_and_memory_refusals_name_the_figures():
    assert contract_mismatch(None, None, ("a",), ("a", "b")) is None
    why = contract_mismatch((224, 224), (320, 320), ("a",), ("a",))
    assert why is not None and "320x320" in why and "224x224" in why
    why = contract_mismatch(None, None, ("nudity",), ("sfw", "nsfw"), frozenset({"nudity"}))
    assert why is not None and "nudity" in why
    assert memory_refusal(None, 10 << 30, None) is None  # a CPU: no cap
    why = memory_refusal(4 << 30, 6 << 30, 8 << 30)
    assert why is not None and "6144 MiB" in why and "4096 MiB" in why and "evicted" in why
    assert memory_refusal(8 << 30, 1 << 30, 8 << 30) is None




def test_the_settings_file_model_is_the_primary_without_a_record():
    assert file_ref(Settings()) == ModelRef("builtin", "streamfer-moderation-cnn", "1")
