"""Metric labels stay bounded whatever the producers send: tenants through Metrics.tenant_label, dead-letter
error types through Metrics.error_type_label (worker/metrics.py, docs/metrics.md)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from worker.config import Settings
from worker.metrics import DEAD_LETTER_ERROR_TYPES, OTHER, Children, Metrics


def metrics_with(**observability) -> Metrics:
    s = Settings()
    return Metrics(settings=dataclasses.replace(s, observability=dataclasses.replace(s.observability,
                                                                                       **observability)))


def count_like_the_pipeline(m: Metrics, tenant: str) -> None:
    """Every per-tenant series the pipeline touches for one frame (consumed, expired, produced)."""
    label = m.tenant_label(tenant)
    for topic in ("frames.realtime", "frames.standard", "frames.bulk"):
        m.frames_consumed.labels(topic, label).inc()
        m.frames_expired.labels(topic, label).inc()
    for status in ("OK", "EXPIRED"):
        m.results_produced.labels("moderation.results", label, status).inc()


def test_ten_thousand_900_kb_tenants_keep_the_scrape_under_1_mb():
    m = Metrics()
    for i in range(10_000):
        count_like_the_pipeline(m, f"{i:06d}" + "x" * 900_000)
    size = len(generate_latest(m.registry))
    assert size < 1_000_000, size


def test_ten_thousand_tenants_at_the_identifier_limit_keep_the_scrape_under_1_mb():
    """The worst the default settings allow: max_metric_tenants tenants of limits.max_identifier_bytes."""
    m = Metrics()
    longest = Settings().limits.max_identifier_bytes
    for i in range(10_000):
        count_like_the_pipeline(m, f"{i:06d}".ljust(longest, "x"))
    size = len(generate_latest(m.registry))
    assert size < 1_000_000, size
    tenants = {s.labels["tenant"] for metric in m.registry.collect() for s in metric.samples if "tenant" in s.labels}
    assert len(tenants) == Settings().observability.max_metric_tenants + 1  # and "other"


def test_the_first_tenants_seen_keep_their_label_and_later_ones_are_other():
    m = metrics_with(max_metric_tenants=2)
    assert [m.tenant_label(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]


def test_listed_tenants_are_the_only_labels_when_a_list_is_set():
    m = metrics_with(metric_tenants=("acme", "globex"), max_metric_tenants=100)
    assert [m.tenant_label(t) for t in ("x", "acme", "y", "globex")] == [OTHER, "acme", OTHER, "globex"]


def test_a_tenant_longer_than_the_identifier_limit_never_gets_a_label_of_its_own():
    m = Metrics()
    assert m.tenant_label("t" * (Settings().limits.max_identifier_bytes + 1)) == OTHER
    assert m.tenant_label("short") == "short"


def test_zero_max_metric_tenants_counts_every_tenant_as_other():
    m = metrics_with(max_metric_tenants=0)
    assert {m.tenant_label(t) for t in ("a", "b")} == {OTHER}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=300), st.integers(0, 20))
def test_at_most_max_metric_tenants_labels_besides_other(tenants, cap):
    m = metrics_with(max_metric_tenants=cap)
    labels = {m.tenant_label(t) for t in tenants}
    assert len(labels - {OTHER}) <= cap
    assert labels - {OTHER} <= set(tenants)


def test_error_types_outside_the_known_set_are_other():
    assert Metrics.error_type_label("FrameDecodeError") == "FrameDecodeError"
    assert Metrics.error_type_label("DuplicateFrame") == "DuplicateFrame"
    assert Metrics.error_type_label("ValueError: something a producer wrote") == OTHER
    assert OTHER not in DEAD_LETTER_ERROR_TYPES


def test_every_error_type_the_worker_dead_letters_has_a_label_of_its_own():
    from worker.frames import DECODE_ERROR, DUPLICATE_FRAME, MODEL_ERROR, NON_FINITE_OUTPUT, OUTPUT_REJECTED

    assert {DECODE_ERROR, MODEL_ERROR, NON_FINITE_OUTPUT, "MessageDecodeError", DUPLICATE_FRAME,
            OUTPUT_REJECTED} <= DEAD_LETTER_ERROR_TYPES


def test_cached_children_are_the_metrics_own_and_a_label_set_has_no_series_until_used():
    m = Metrics()
    consumed = Children(m.frames_consumed)
    assert "tenant=" not in generate_latest(m.registry).decode()
    consumed.labels("frames.bulk", "a").inc(2)
    m.frames_consumed.labels("frames.bulk", "a").inc()
    assert consumed.labels("frames.bulk", "a") is m.frames_consumed.labels("frames.bulk", "a")
    assert m.registry.get_sample_value("streamfer_frames_consumed_total", {"topic": "frames.bulk", "tenant": "a"}) == 3
