"""The control topic, pure (worker/control/): its records, the state read from it, a worker applying a policy,
and `worker policy set`'s checks of a file (worker/tools/policy.py)."""

from __future__ import annotations

import copy
import io
import json

import fastavro
import pytest

from worker.codec.schemas import SCHEMA_DIR
from worker.config import ConfigError, PolicySettings, Settings
from worker.control.apply import PolicyApplier
from worker.control.records import (
    POLICY,
    WORKER_STATUS,
    ControlRecord,
    WorkerStatus,
    decode,
    encode,
    policy_key,
    worker_key,
)
from worker.control.state import ControlState
from worker.loop.answers import judge_of
from worker.metrics import Health, Metrics
from worker.tools.policy import line_of, read_policy_file
from worker.tools.read_results import result_filter

KIDS = PolicySettings(flag={"nudity": 0.8}, review={"nudity": 0.5},
                      tenants={"kids": {"flag": {"nudity": 0.3}, "review": {"nudity": 0.1}}})


def policy_record(revision: int, policy: PolicySettings = KIDS, group: str = "g") -> ControlRecord:
    return ControlRecord(POLICY, group, revision, 1_700_000_000_000 + revision, "ops@host", policy=policy)


def status_record(worker: str, version: str, group: str = "g") -> ControlRecord:
    return ControlRecord(WORKER_STATUS, group, 1, 1_700_000_000_000, worker,
                         status=WorkerStatus(worker, version, "applied"))


def test_a_policy_record_round_trips():
    got = decode(encode(policy_record(3)))
    assert (got.kind, got.group_id, got.revision, got.written_by) == (POLICY, "g", 3, "ops@host")
    assert got.written_at_ms == 1_700_000_000_003
    assert got.policy is not None and got.policy.flag == {"nudity": 0.8}
    assert got.policy.tenants["kids"] == {"flag": {"nudity": 0.3}, "review": {"nudity": 0.1}}
    assert decode(encode(status_record("w1", "r3"))).status == WorkerStatus("w1", "r3", "applied")


def test_a_record_with_a_later_models_field_is_still_read():
    """Rollouts (issue 69) append `models` (a union with null) to the record: this version reads past it."""
    schema = json.loads((SCHEMA_DIR / "control.avsc").read_text())
    later = copy.deepcopy(schema)
    later["fields"].append({"name": "later", "default": None, "type": ["null", {
        "type": "record", "name": "Later", "fields": [{"name": "primary", "type": "string"}]}]})
    out = io.BytesIO()
    raw = fastavro.schemaless_reader(io.BytesIO(encode(policy_record(4))), fastavro.parse_schema(schema), None)
    fastavro.schemaless_writer(out, fastavro.parse_schema(later), {**raw, "later": {"primary": "opennsfw"}})
    assert decode(out.getvalue()).revision == 4


def test_state_keeps_the_last_record_of_each_of_its_groups_keys():
    state = ControlState("g")
    assert state.take(policy_key("g").encode(), encode(policy_record(1)))
    assert not state.take(policy_key("other").encode(), encode(policy_record(9, group="other")))
    assert not state.take(worker_key("g", "w1").encode(), encode(status_record("w1", "r1")))
    assert state.take(policy_key("g").encode(), encode(policy_record(2)))
    assert state.revision == 2 and set(state.workers) == {"w1"}
    assert not state.take(worker_key("g", "w1").encode(), None)  # a tombstone deletes the key
    assert state.workers == {}
    assert state.take(policy_key("g").encode(), None) and state.policy is None and state.revision == 0


def test_a_record_that_is_not_a_control_record_is_skipped_and_counted():
    state = ControlState("g")
    assert not state.take(policy_key("g").encode(), b"\xff\xfe not avro")
    assert state.skipped == 1 and state.policy is None


def test_a_late_reader_derives_the_same_state_as_one_that_read_every_record():
    records = [(policy_key("g"), policy_record(1)), (worker_key("g", "w1"), status_record("w1", "r1")),
               (policy_key("g"), policy_record(2)), (worker_key("g", "w1"), status_record("w1", "r2"))]
    everything, compacted = ControlState("g"), ControlState("g")
    for key, record in records:
        everything.take(key.encode(), encode(record))
    for key, record in dict(records).items():  # what compaction keeps: the last record per key
        compacted.take(key.encode(), encode(record))
    assert everything == compacted


def applier() -> tuple[PolicyApplier, Metrics, Health]:
    metrics, health = Metrics(), Health()
    a = PolicyApplier(judge_of(Settings()), Settings().policy, "g", "w1", metrics, clock_ms=lambda: 5)
    health.policy_problem = lambda: a.problem
    return a, metrics, health


def test_a_worker_applies_the_groups_policy_and_reports_it():
    a, metrics, health = applier()
    report = a.apply(policy_record(3))
    assert report.status == WorkerStatus("w1", "r3", "applied") and report.revision == 3
    assert a.judge.policy().version == "r3"
    assert metrics.policy_refused._value.get() == 0 and health.degraded == ""


def test_a_policy_the_model_cannot_apply_is_refused_and_the_last_good_one_stays(caplog):
    a, metrics, health = applier()
    a.apply(policy_record(3))
    a.judge.policy()
    with caplog.at_level("WARNING", logger="worker.control.apply"):
        report = a.apply(policy_record(4, PolicySettings(flag={"colour": 0.5})))
    assert report.status is not None and report.status.state == "refused"
    assert report.status.policy_version == "r3" and "no label 'colour'" in report.status.reason
    assert a.judge.policy().version == "r3"
    assert metrics.policy_refused._value.get() == 1
    assert "policy r4 refused, judging with r3" in health.degraded
    assert [r.message for r in caplog.records if "refused" in r.message][0].startswith("policy r4 refused")
    assert len([r for r in caplog.records if "refused" in r.message]) == 1
    a.apply(policy_record(5))
    assert a.judge.policy().version == "r5" and health.degraded == "" and metrics.policy_refused._value.get() == 0


def test_without_a_record_the_settings_files_policy_decides():
    a, _, _ = applier()
    a.apply(policy_record(2))
    report = a.apply(None)
    assert report.status is not None and report.status.policy_version.startswith("file-")
    assert a.judge.policy().version == report.status.policy_version


def test_a_policy_file_is_checked_and_each_problem_names_its_line(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('[policy]\nflag = { nudity = 0.8 }\nreview = { nudity = 0.5 }\n'
                    '[policy.tenants.kids]\nflag = { nudity = 0.3 }\nreview = { nudity = 0.4 }\n')
    with pytest.raises(ConfigError) as err:
        read_policy_file(path, Settings())
    assert "policy.tenants.kids.review.nudity: 0.4 is above its flag threshold 0.3" in str(err.value)
    assert "line 6" in str(err.value)
    path.write_text('[policy]\nflag = { colour = 0.8 }\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_policy_file(path, Settings())
    path.write_text('[policy]\nflag = { nudity = 0.8 }\n[kafka]\nx = 1\n')
    with pytest.raises(ConfigError, match="a policy file holds"):
        read_policy_file(path)
    path.write_text('[policy]\nflag = { nudity = 0.8 }\n')
    assert read_policy_file(path, Settings()).flag == {"nudity": 0.8}


def test_line_of_finds_each_part_of_the_setting_in_turn():
    text = "[policy]\nflag = { nudity = 0.9 }\n[policy.tenants.kids]\nflag = { nudity = 0.3 }\n"
    assert line_of(text, "policy.tenants.kids.flag.nudity: ...") == 4
    assert line_of(text, "policy.flag.nudity: ...") == 2


def test_results_are_filtered_by_verdict_and_tenant():
    keep = result_filter(verdicts=["review"], tenants=["kids"])
    assert keep is not None
    assert keep({"verdict": "review", "tenant": "kids"})
    assert not keep({"verdict": "flag", "tenant": "kids"})
    assert not keep({"verdict": "review", "tenant": "dating"})
    assert result_filter() is None
