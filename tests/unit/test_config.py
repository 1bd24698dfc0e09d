"""Settings: file < env < flags, and every bad field named in one error."""

import pytest

from worker.config import (
    ConfigError,
    DeliverySettings,
    Settings,
    inflight_batch_limit,
    load_settings,
    preprocess_thread_count,
    resolve_inflight_batches,
)
from worker.frames import Priority


def test_defaults_are_valid():
    assert load_settings(env={}) == Settings(observability=load_settings(env={}).observability)


def test_file_then_env_then_overrides(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[batching]\nmax_batch_size = 16\n[batching.realtime]\nmax_wait_ms = 3\n'
                   '[kafka]\nbootstrap_servers = "file:9092"\n')
    s = load_settings(cfg, env={"WORKER_KAFKA_BOOTSTRAP_SERVERS": "env:9092", "WORKER_BATCHING_BULK_WEIGHT": "2"},
                      overrides={"kafka": {"group_id": "flag-group", "bootstrap_servers": None}})
    assert s.batching.max_batch_size == 16
    assert s.batching.realtime.max_wait_ms == 3
    assert s.batching.realtime.max_age_ms == 2000  # untouched fields of a nested table keep their default
    assert s.batching.bulk.weight == 2
    assert s.kafka.bootstrap_servers == "env:9092"
    assert s.kafka.group_id == "flag-group"


def test_env_lists_and_maps():
    s = load_settings(env={"WORKER_RUNTIME_GRAPH_BATCH_SIZES": "1,4,16", "WORKER_MODEL_THRESHOLDS": "nudity=0.3",
                           "WORKER_RUNTIME_CUDA_GRAPHS": "false"})
    assert s.runtime.graph_batch_sizes == (1, 4, 16)
    assert s.model.thresholds == {"nudity": 0.3}
    assert s.runtime.cuda_graphs is False


def test_every_bad_field_is_named():
    with pytest.raises(ConfigError) as err:
        load_settings(env={"WORKER_BATCHING_MAX_BATCH_SIZE": "many", "WORKER_DELIVERY_MODE": "maybe",
                           "WORKER_BATCHING_REALTIME_MAX_WAIT_MS": "5000", "WORKER_MODEL_THRESHOLDS": "nope=0.5"})
    text = str(err.value)
    for field in ("batching.max_batch_size", "delivery.mode", "batching.realtime.max_wait_ms", "model.thresholds"):
        assert field in text
    assert all(p.split(":")[0].startswith(("batching", "delivery", "model")) for p in err.value.problems)


def test_unknown_setting_and_section_in_file(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text("[batching]\nmax_wait = 3\n[nonsense]\nx = 1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, env={})
    assert "batching.max_wait: unknown setting" in str(err.value)
    assert "[nonsense]: unknown section" in str(err.value)


def test_a_retired_setting_says_what_replaced_it():
    with pytest.raises(ConfigError) as err:
        load_settings(env={"WORKER_KAFKA_GROUP_INSTANCE_ID": "pod-0"})
    assert "kafka.group_instance_id: removed" in str(err.value) and "kafka.static_membership" in str(err.value)
    assert "unknown setting" not in str(err.value)


def test_a_worker_id_kafka_refuses_as_an_instance_id_is_refused_unless_membership_is_dynamic():
    with pytest.raises(ConfigError, match="observability.worker_id: 'pod 0' is.*group.instance.id") as err:
        load_settings(env={"WORKER_OBSERVABILITY_WORKER_ID": "pod 0"})
    assert err.value.setting == "observability.worker_id"
    with pytest.raises(ConfigError, match="group.instance.id"):
        load_settings(env={"WORKER_OBSERVABILITY_WORKER_ID": "x" * 250})
    dynamic = load_settings(env={"WORKER_OBSERVABILITY_WORKER_ID": "pod 0", "WORKER_KAFKA_STATIC_MEMBERSHIP": "false"})
    assert dynamic.observability.worker_id == "pod 0"
    assert load_settings(env={"WORKER_OBSERVABILITY_WORKER_ID": "pod-0.a_b"}).kafka.static_membership


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad, env={})


def test_topics_must_differ():
    with pytest.raises(ConfigError, match="topics"):
        load_settings(env={"WORKER_TOPICS_RESULTS": "frames.bulk"})


def test_warmup_shapes_are_frame_sizes():
    from worker.config import warmup_frame_shapes

    s = load_settings(env={"WORKER_RUNTIME_WARMUP_SHAPES": "1280x720,64x48"})
    assert warmup_frame_shapes(s) == [(720, 1280, 3), (48, 64, 3)]
    with pytest.raises(ConfigError, match="runtime.warmup_shapes"):
        load_settings(env={"WORKER_RUNTIME_WARMUP_SHAPES": "1280by720"})


def test_overrides_of_properties_the_guarantees_depend_on_are_refused():
    with pytest.raises(ConfigError) as info:
        load_settings(env={"WORKER_KAFKA_CONSUMER_OVERRIDES": "enable.auto.commit=true,auto.offset.reset=latest,"
                                                              "client.rack=r1",
                           "WORKER_KAFKA_PRODUCER_OVERRIDES": "acks=1,linger.ms=5"})
    text = str(info.value)
    assert "kafka.consumer_overrides: 'enable.auto.commit' is managed by the worker" in text
    assert "kafka.consumer_overrides: 'auto.offset.reset'" in text and "--reset-offsets" in text
    assert "kafka.producer_overrides: 'acks'" in text
    assert "client.rack" not in text and "linger.ms" not in text  # the rest pass through
    assert len(info.value.problems) == 3


def test_the_heartbeat_is_at_most_a_third_of_the_session_and_has_its_own_setting():
    """Kafka's rule: two heartbeats may be lost before the session ends. The worker owns heartbeat.interval.ms: the
    hand-over of a moved partition waits for it (bench/handover.py)."""
    assert load_settings(env={}).kafka.heartbeat_interval_ms == 500
    assert load_settings(env={"WORKER_KAFKA_SESSION_TIMEOUT_MS": "6000",
                              "WORKER_KAFKA_HEARTBEAT_INTERVAL_MS": "2000"}).kafka.heartbeat_interval_ms == 2000
    with pytest.raises(ConfigError, match=r"kafka.heartbeat_interval_ms: must be at most kafka.session_timeout_ms / 3 "
                                          r"\(2000 with a session of 6000 ms\), got 2001"):
        load_settings(env={"WORKER_KAFKA_SESSION_TIMEOUT_MS": "6000", "WORKER_KAFKA_HEARTBEAT_INTERVAL_MS": "2001"})
    with pytest.raises(ConfigError, match="kafka.consumer_overrides: 'heartbeat.interval.ms' is managed by the worker "
                                          r"\(use kafka.heartbeat_interval_ms\)"):
        load_settings(env={"WORKER_KAFKA_CONSUMER_OVERRIDES": "heartbeat.interval.ms=100"})


def test_transaction_call_timeout_is_bounded():
    with pytest.raises(ConfigError, match="delivery.transaction_call_timeout_ms"):
        load_settings(env={"WORKER_DELIVERY_TRANSACTION_CALL_TIMEOUT_MS": "50"})


def test_limits_come_from_file_and_env(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[limits]\nmax_frame_pixels = 33177600\nmax_capture_skew_ms = 5000\n'
                   '[observability]\nmetric_tenants = ["acme", "globex"]\n')
    s = load_settings(cfg, env={"WORKER_LIMITS_DUPLICATE_WINDOW_FRAMES": "0",
                                "WORKER_OBSERVABILITY_MAX_METRIC_TENANTS": "7"})
    assert s.limits.max_frame_pixels == 7680 * 4320  # 8K, raised from the default
    assert s.limits.max_capture_skew_ms == 5000 and s.limits.duplicate_window_frames == 0
    assert s.observability.metric_tenants == ("acme", "globex") and s.observability.max_metric_tenants == 7


def test_default_pixel_limit_takes_4k_frames():
    assert Settings().limits.max_frame_pixels >= 4096 * 2160


@pytest.mark.parametrize("env, field", [
    ({"WORKER_LIMITS_MAX_FRAME_PIXELS": "0"}, "limits.max_frame_pixels"),
    ({"WORKER_LIMITS_MAX_FRAME_PIXELS": str(16384 * 16384 + 1)}, "limits.max_frame_pixels"),
    ({"WORKER_LIMITS_MAX_IDENTIFIER_BYTES": "0"}, "limits.max_identifier_bytes"),
    ({"WORKER_LIMITS_MIN_CAPTURE_TS_MS": "0"}, "limits.min_capture_ts_ms"),
    ({"WORKER_LIMITS_MAX_CAPTURE_SKEW_MS": "-1"}, "limits.max_capture_skew_ms"),
    ({"WORKER_LIMITS_DUPLICATE_WINDOW_FRAMES": "-1"}, "limits.duplicate_window_frames"),
    ({"WORKER_OBSERVABILITY_MAX_METRIC_TENANTS": "1001"}, "observability.max_metric_tenants"),
    ({"WORKER_OBSERVABILITY_METRIC_TENANTS": "a," + "b" * 300}, "observability.metric_tenants"),
])
def test_limits_out_of_range_are_named(env, field):
    with pytest.raises(ConfigError) as err:
        load_settings(env=env)
    assert err.value.setting == field


@pytest.mark.parametrize("value", ["auto", "0"])
def test_preprocess_threads_auto_or_zero_is_one_per_usable_core(value, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    runtime = load_settings(env={"WORKER_RUNTIME_PREPROCESS_THREADS": value}).runtime
    assert preprocess_thread_count(runtime) == 3


def test_preprocess_threads_default_to_auto_and_a_number_is_kept():
    assert Settings().runtime.preprocess_threads == "auto"
    assert preprocess_thread_count(load_settings(env={"WORKER_RUNTIME_PREPROCESS_THREADS": "5"}).runtime) == 5


@pytest.mark.parametrize("value", ["-1", "257", "many", "2.5"])
def test_preprocess_threads_other_than_auto_or_0_to_256_are_refused(value):
    with pytest.raises(ConfigError, match="runtime.preprocess_threads"):
        load_settings(env={"WORKER_RUNTIME_PREPROCESS_THREADS": value})


# -- batch size per class --------------------------------------------------------------------------------------
def test_a_class_max_batch_size_overrides_the_global_one_and_the_others_keep_it(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text("[batching]\nmax_batch_size = 32\n[batching.realtime]\nmax_batch_size = 8\n")
    s = load_settings(cfg, env={"WORKER_BATCHING_BULK_MAX_BATCH_SIZE": "64"}).batching
    assert [s.max_batch_size_for(p) for p in Priority] == [8, 32, 64]
    assert s.largest_batch_size == 64


def test_class_max_batch_sizes_default_to_the_global_one():
    s = load_settings(env={"WORKER_BATCHING_MAX_BATCH_SIZE": "16"}).batching
    assert [s.max_batch_size_for(p) for p in Priority] == [16, 16, 16] and s.largest_batch_size == 16


@pytest.mark.parametrize("value", ["-1", "4097"])
def test_a_class_max_batch_size_out_of_range_is_named(value):
    with pytest.raises(ConfigError) as err:
        load_settings(env={"WORKER_BATCHING_REALTIME_MAX_BATCH_SIZE": value})
    assert err.value.problems == [
        "batching.realtime.max_batch_size: must be 0..4096 frames (0 = batching.max_batch_size)"]
    assert err.value.setting == "batching.realtime.max_batch_size"


def test_the_pending_frames_cap_must_hold_the_largest_class_batch():
    with pytest.raises(ConfigError, match="batching.max_pending_frames: must be >= the largest max_batch_size"):
        load_settings(env={"WORKER_BATCHING_BULK_MAX_BATCH_SIZE": "256", "WORKER_BATCHING_MAX_PENDING_FRAMES": "128"})


# -- in-flight batches -----------------------------------------------------------------------------------------
def test_by_default_the_inflight_limit_is_two_batches_per_runner():
    delivery = load_settings(env={}).delivery
    assert (delivery.max_inflight_batches, delivery.inflight_batches_per_runner) == (0, 2)
    assert [inflight_batch_limit(delivery, runners) for runners in (1, 3, 8)] == [2, 6, 16]
    assert inflight_batch_limit(DeliverySettings(inflight_batches_per_runner=3), 4) == 12


def test_a_set_inflight_limit_is_kept_when_it_feeds_every_runner():
    assert inflight_batch_limit(DeliverySettings(max_inflight_batches=5), 3) == 5


def test_a_set_inflight_limit_below_the_runner_count_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as err:
        inflight_batch_limit(DeliverySettings(max_inflight_batches=2), 4)
    assert err.value.setting == "delivery.max_inflight_batches"
    assert "4 runners" in str(err.value) and "set 0 (derived" in str(err.value) and "at least 4" in str(err.value)


@pytest.mark.parametrize(("env", "field"), [
    ({"WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "-1"}, "delivery.max_inflight_batches"),
    ({"WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "1025"}, "delivery.max_inflight_batches"),
    ({"WORKER_DELIVERY_INFLIGHT_BATCHES_PER_RUNNER": "0"}, "delivery.inflight_batches_per_runner"),
    ({"WORKER_DELIVERY_INFLIGHT_BATCHES_PER_RUNNER": "9"}, "delivery.inflight_batches_per_runner"),
])
def test_inflight_settings_out_of_range_are_named(env, field):
    with pytest.raises(ConfigError, match=field):
        load_settings(env=env)


def test_resolved_settings_carry_the_runners_limit_into_the_uncommitted_cap_and_resolve_again_to_themselves():
    s = load_settings(env={"WORKER_BATCHING_MAX_PENDING_FRAMES": "100", "WORKER_BATCHING_BULK_MAX_BATCH_SIZE": "64"})
    resolved = resolve_inflight_batches(s, runners=3)
    assert resolved.delivery.max_inflight_batches == 6
    assert resolved.max_uncommitted_frames == 100 + (6 + 1) * 64  # and realtime's slot, at the largest batch
    assert resolve_inflight_batches(resolved, runners=3) == resolved


def test_reading_by_priority_is_on_with_a_small_floor_and_both_come_from_env():
    assert Settings().batching.read_by_priority and Settings().batching.lower_class_read_floor == 0.05
    s = load_settings(env={"WORKER_BATCHING_READ_BY_PRIORITY": "false", "WORKER_BATCHING_LOWER_CLASS_READ_FLOOR": "0"})
    assert not s.batching.read_by_priority and s.batching.lower_class_read_floor == 0.0


@pytest.mark.parametrize("value", ["-0.01", "0.51", "1"])
def test_a_lower_class_read_floor_outside_0_to_half_is_refused(value):
    with pytest.raises(ConfigError) as err:
        load_settings(env={"WORKER_BATCHING_LOWER_CLASS_READ_FLOOR": value})
    assert err.value.setting == "batching.lower_class_read_floor"


# -- enumerated settings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["debug", "Debug", "DEBUG"])
def test_a_log_level_loads_in_any_case_as_its_declared_spelling(value):
    assert load_settings(env={"WORKER_OBSERVABILITY_LOG_LEVEL": value}).observability.log_level == "DEBUG"


def test_every_enumerated_setting_is_case_insensitive():
    s = load_settings(env={"WORKER_DELIVERY_MODE": "Exactly_Once", "WORKER_MODEL_INPUT_LAYOUT": "nhwc",
                           "WORKER_RUNTIME_PREPROCESS_THREADS": "AUTO", "WORKER_OBSERVABILITY_LOG_FORMAT": "JSON"})
    assert (s.delivery.mode, s.model.input_layout) == ("exactly_once", "NHWC")
    assert (s.runtime.preprocess_threads, s.observability.log_format) == ("auto", "json")


def test_an_unknown_log_level_is_refused_listing_the_choices():
    with pytest.raises(ConfigError) as err:
        load_settings(env={"WORKER_OBSERVABILITY_LOG_LEVEL": "verbose"})
    assert err.value.problems == ["observability.log_level: must be one of 'DEBUG', 'INFO', 'WARNING', 'ERROR' "
                                  "(got 'verbose')"]
