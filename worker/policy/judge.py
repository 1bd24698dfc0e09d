"""The policy the loop judges with, swapped between batches, and where each verdict is routed (issue 66). Pure.

A new policy (from the control topic, worker.kafka.control) is checked against the model's labels by `offer`:
one the worker cannot apply is refused with the reason and the last good one stays. An accepted one waits in
`_next` until the loop's next batch boundary (`policy()`, called once per batch of answers), so a batch is judged
under one version. `offer` may run on another thread (the control topic's follower): a lock guards the hand-over.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from worker.config import PolicySettings, TopicSettings, policy_problems
from worker.policy.verdicts import FLAG, REVIEW, Policy


@dataclass(frozen=True)
class Refusal:
    """A policy this worker refused, and why (readiness text, a metric and one log line say so)."""

    version: str
    reason: str


class Judge:
    """The current policy, the next one (applied from the next batch), the last refusal, and the routes."""

    def __init__(self, policy: Policy, model_thresholds: Mapping[str, Sequence[float]],
                 routes: Mapping[str, str] | None = None) -> None:
        self._current = policy
        self._next: Policy | None = None
        self._lock = threading.Lock()
        self._model_thresholds = model_thresholds
        self.refused: Refusal | None = None
        # Verdict -> the topics its results are copied to (an empty topic: that route is off).
        self._routes = {verdict: (topic,) for verdict, topic in (routes or {}).items() if topic}

    @classmethod
    def of_settings(cls, policy: PolicySettings, topics: TopicSettings,
                    model_thresholds: Mapping[str, Sequence[float]]) -> Judge:
        return cls(Policy(policy), model_thresholds, {REVIEW: topics.review, FLAG: topics.flagged})

    def offer(self, settings: PolicySettings, version: str) -> Refusal | None:
        """Apply `settings` from the next batch, or refuse it (None: accepted). A policy naming a label the model
        lacks, or a review band above a flag threshold of this model, is refused: the current one stays."""
        problems = policy_problems(settings, self._model_thresholds)
        if problems:
            self.refused = Refusal(version, "; ".join(problems))
            return self.refused
        with self._lock:
            self._next = Policy(settings, version)
        self.refused = None
        return None

    def policy(self) -> Policy:
        """The policy to judge the next batch with: the one offered last, once accepted."""
        if self._next is not None:  # read without the lock first: the usual case, nothing new, costs no lock
            with self._lock:
                if self._next is not None:
                    self._current, self._next = self._next, None
        return self._current

    @property
    def version(self) -> str:
        """The version applied to the last batch (or to be applied to the next, once offered)."""
        upcoming = self._next
        return (upcoming or self._current).version

    def routes(self, verdict: str) -> tuple[str, ...]:
        """The topics a result of this verdict is copied to, besides the results topic."""
        return self._routes.get(verdict, ())
