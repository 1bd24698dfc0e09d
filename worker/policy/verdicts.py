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
    """One tenant's thresholds: flag and review per label named (a label not in `flag` flags as the model says)."""

    flag: Mapping[str, float]
    review: Mapping[str, float]


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
        self.expired = EXPIRED_TO_REVIEW if settings.expired == REVIEW else NOT_JUDGED

    def table(self, tenant: str) -> Table:
        return self._tables.get(tenant, self.default)

    def decide(self, tenant: str, verdict: Verdict) -> Decision:
        """The frame's verdict under its tenant's table (module docstring)."""
        table = self._tables.get(tenant, self.default)
        flag_at, review_at = table.flag, table.review
        flags: list[str] = []
        reviews: list[str] = []
        for own in _judged(verdict):
            model_flags = own.flagged_labels
            for label, score in own.scores.items():
                at = flag_at.get(label)
                if (label in model_flags) if at is None else score >= at:
                    if label not in flags:
                        flags.append(label)
                    continue
                at = review_at.get(label)
                if at is not None and score >= at and label not in reviews:
                    reviews.append(label)
        if flags:
            return Decision(FLAG, tuple(flags))
        if reviews:
            return Decision(REVIEW, tuple(reviews))
        return ALLOWED


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
