"""Helpers for integration tests: unique topics per test, worker processes, and the verifier's ledger.

They live in worker/testing.py (the test kit users get too); the names stay importable from here."""

from __future__ import annotations

from worker.testing import (
    TestTopics,
    committed_offsets,
    end_offsets,
    http_get,
    ledger,
    make_topics,
    start_worker,
    uncommitted,
    wait_for,
)

__all__ = ["TestTopics", "committed_offsets", "end_offsets", "http_get", "ledger", "make_topics", "start_worker",
           "uncommitted", "wait_for"]
