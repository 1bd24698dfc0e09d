"""A frame's verdict under the policy: `allow`, `review` or `flag`, with the labels that decided it (issue 66).

Pure: the loop decides each result's verdict with `Policy.decide` from the model's verdict (every label's score,
and the labels the model itself flags at its own thresholds). Per label, per tenant:
- flag: the tenant's `flag` threshold, else the policy's, else the model's own decision (as `flagged` always was);
- review: the tenant's `review` threshold, else the policy's, else never.
A label flags at or above its flag threshold; a label not flagged goes to review at or above its review threshold.
Flag wins over review: a frame with any flag label is `flag` (its labels the flag labels), else `review` with any
review label, else `allow`. In a model set each model's own scores are judged (a detector's: its best box's per
label) and the labels of all of them joined, in the set's order.

Tables are built once per policy: a tenant without overrides shares the policy's; a decision is a dict look-up
and one pass over the frame's labels (bench/policy_cost.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from worker.config import PolicySettings
from worker.frames import Verdict

ALLOW, REVIEW, FLAG = "allow", "review", "flag"
VERDICTS = (ALLOW, REVIEW, FLAG)
# The verdict of a result the policy did not judge (an EXPIRED frame with `policy.expired = "none"`).
UNJUDGED = ""


@dataclass(frozen=True)
class Decision:
    """A frame's verdict and the labels that decided it (flag labels for `flag`, review labels for `review`)."""

    verdict: str
    labels: tuple[str, ...] = ()


ALLOWED = Decision(ALLOW)
NOT_JUDGED = Decision(UNJUDGED)
EXPIRED_TO_REVIEW = Decision(REVIEW)


@dataclass(frozen=True)
class Table:
    """One tenant's thresholds: flag and review per label named (a label not in `flag` flags as the model says).
    `rules`: both at once, label -> (flag threshold or None, review threshold or None), for one look-up a label."""

    flag: Mapping[str, float]
    review: Mapping[str, float]

    @property
    def rules(self) -> dict[str, tuple[float | None, float | None]]:
        return {label: (self.flag.get(label), self.review.get(label)) for label in {*self.flag, *self.review}}


class Policy:
    """A compiled policy: a table per tenant with overrides, the policy's own for every other tenant."""

    def __init__(self, settings: PolicySettings, version: str = "") -> None:
        self.settings = settings
        self.version = version or settings_version(settings)
        self.default = Table(dict(settings.flag), dict(settings.review))
        self._tables: dict[str, Table] = {
            tenant: Table({**settings.flag, **overrides.get("flag", {})},
                          {**settings.review, **overrides.get("review", {})})
            for tenant, overrides in settings.tenants.items()}
        self._default_rules = self.default.rules
        self._rules = {tenant: table.rules for tenant, table in self._tables.items()}
        self.expired = EXPIRED_TO_REVIEW if settings.expired == REVIEW else NOT_JUDGED
        # Decisions are values: one object per (verdict, labels) met, so the loop's writer caches their bytes.
        self._decisions: dict[tuple[str, tuple[str, ...]], Decision] = {}

    def table(self, tenant: str) -> Table:
        return self._tables.get(tenant, self.default)

    def decide(self, tenant: str, verdict: Verdict) -> Decision:
        """The frame's verdict under its tenant's table (module docstring)."""
        rules = self._rules.get(tenant, self._default_rules)
        if verdict.models:
            return self._decide_set(rules, verdict)
        flags: list[str] = []
        reviews: list[str] = []
        model_flags = verdict.flagged_labels
        for label, score in verdict.scores.items():
            rule = rules.get(label)
            if rule is None:
                if label in model_flags:
                    flags.append(label)
                continue
            flag_at, review_at = rule
            if (label in model_flags) if flag_at is None else score >= flag_at:
                flags.append(label)
            elif review_at is not None and score >= review_at:
                reviews.append(label)
        return self._decision(flags, reviews)

    def _decide_set(self, rules: dict[str, tuple[float | None, float | None]], verdict: Verdict) -> Decision:
        """A model set: each model's own scores judged, the labels joined in the set's order."""
        flags: list[str] = []
        reviews: list[str] = []
        for own in _judged(verdict):
            model_flags = own.flagged_labels
            for label, score in own.scores.items():
                flag_at, review_at = rules.get(label, _UNNAMED)
                if (label in model_flags) if flag_at is None else score >= flag_at:
                    if label not in flags:
                        flags.append(label)
                elif review_at is not None and score >= review_at and label not in reviews:
                    reviews.append(label)
        return self._decision(flags, reviews)

    def _decision(self, flags: list[str], reviews: list[str]) -> Decision:
        if not flags and not reviews:
            return ALLOWED
        key = (FLAG, tuple(flags)) if flags else (REVIEW, tuple(reviews))
        decision = self._decisions.get(key)
        if decision is None:
            if len(self._decisions) >= _MAX_DECISIONS:
                self._decisions.clear()
            decision = self._decisions[key] = Decision(*key)
        return decision


_UNNAMED: tuple[float | None, float | None] = (None, None)
_MAX_DECISIONS = 4096


def _judged(verdict: Verdict) -> tuple[Verdict, ...]:
    """The verdicts the policy judges: every model's own that ran, in a set; the verdict itself for one model."""
    if not verdict.models:
        return (verdict,)
    return tuple(o.verdict for o in verdict.models if o.verdict is not None)


def settings_version(settings: PolicySettings) -> str:
    """A policy's version when it comes from the settings file: `file-` and 12 hex digits of its content, so
    workers with the same file name the same version."""
    text = json.dumps({"flag": settings.flag, "review": settings.review, "tenants": settings.tenants,
                       "expired": settings.expired}, sort_keys=True)
    return "file-" + hashlib.sha256(text.encode()).hexdigest()[:12]
