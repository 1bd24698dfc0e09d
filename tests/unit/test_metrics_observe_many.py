"""metrics.observe_many leaves a histogram as observe() one by one would (it relies on prometheus_client's
internals: this is where a release that changes them shows)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from worker.metrics import LATENCY_BUCKETS_S, PIXEL_BUCKETS, observe_many


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([LATENCY_BUCKETS_S, PIXEL_BUCKETS]),
       st.lists(st.lists(st.floats(-1e3, 1e8, allow_nan=False) | st.sampled_from([0.001, 0.0025, 4096.0]),
                         max_size=40), max_size=4))
def test_observe_many_exposes_what_observe_one_by_one_does(buckets, batches):
    one, many = CollectorRegistry(), CollectorRegistry()
    by_one = Histogram("h", "help", ["shape"], buckets=buckets, registry=one)
    by_many = Histogram("h", "help", ["shape"], buckets=buckets, registry=many)
    child_one, child_many = by_one.labels("224x224"), by_many.labels("224x224")
    for amounts in batches:
        for a in amounts:
            child_one.observe(a)
        observe_many(child_many, amounts)
    expected, got = _samples(one), _samples(many)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-6), key  # the sum is added in another order


def test_observe_many_refuses_a_labelled_histogram_without_its_labels_as_observe_does():
    h = Histogram("h", "help", ["shape"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="missing label values"):
        h.observe(1.0)
    with pytest.raises(ValueError, match="missing label values"):
        observe_many(h, [1.0])


def test_observe_many_sets_the_exemplars_observe_would_and_none_for_unsampled_frames(monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1_800_000_000.0)  # the exemplars' timestamps
    one, many = CollectorRegistry(), CollectorRegistry()
    by_one = Histogram("h", "help", buckets=LATENCY_BUCKETS_S, registry=one)
    by_many = Histogram("h", "help", buckets=LATENCY_BUCKETS_S, registry=many)
    amounts = [0.004, 0.3, 0.0045, 2.5]
    trace_ids = ["a" * 32, None, "b" * 32, None]
    for a, t in zip(amounts, trace_ids, strict=True):
        by_one.observe(a, {"trace_id": t} if t else None)
    observe_many(by_many, amounts, trace_ids)

    def exemplars(registry: CollectorRegistry) -> dict:
        return {s.labels["le"]: s.exemplar for m in registry.collect() for s in m.samples if s.name == "h_bucket"}

    assert exemplars(many) == exemplars(one)
    assert exemplars(many)["0.005"].labels == {"trace_id": "b" * 32}  # the bucket's latest traced frame
    assert exemplars(many)["0.5"] is None
