"""The [policy] section: the verdict a frame gets from its scores, per tenant (issue 66), and its checks.

`policy_problems` is pure and shared: settings loading (worker/config/validate.py), `worker policy set` (a file
checked before it is written to the control topic) and a worker applying a policy from the control topic (which
refuses one naming a label its model lacks) all check a policy with it. Compiled for the loop in
worker/policy/verdicts.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from worker.config.fields import setting
from worker.config.model import ModelSettings

# What an EXPIRED result (no scores: the model never ran) is routed as.
ExpiredRoute = Literal["none", "review"]
TENANT_KEYS = ("flag", "review")


@dataclass(frozen=True)
class PolicySettings:
    flag: dict[str, float] = setting(default_factory=dict, range="each in [0, 1], for labels of the model(s)", doc=(
        "label = score: a frame is flagged (verdict `flag`) when that label scores at or above it; labels not named "
        "flag as the model's own `thresholds` / `default_threshold` / `never_flag` decide (as `flagged` always was). "
        "E.g. `flag = { nudity = 0.8 }`"))
    review: dict[str, float] = setting(default_factory=dict,
                                       range="each in [0, 1], at most the label's flag threshold", doc=(
        "label = score: a frame not flagged is sent for review (verdict `review`) when that label scores at or above "
        "it; labels not named are never sent for review. Flag wins over review"))
    tenants: dict[str, dict[str, dict[str, float]]] = setting(
        default_factory=dict, range="`[policy.tenants.<tenant>]` tables of `flag` and `review`", doc=(
            "a tenant's overrides, label by label: `[policy.tenants.kids]` with `flag = { nudity = 0.3 }` and "
            "`review = { nudity = 0.1 }`; a label the tenant does not name keeps the policy's (or the model's) "
            "threshold"))
    expired: ExpiredRoute = setting("none", doc=(
        "what an EXPIRED result (the frame passed its deadline, no scores) is routed as: `none` (verdict empty, "
        "no copy) or `review` (verdict `review`, a copy on `topics.review`: people look at what the model could "
        "not)"))


def policy_problems(policy: PolicySettings, model_thresholds: Mapping[str, Sequence[float]] | None = None,
                    where: str = "policy") -> list[str]:
    """Every problem of `policy`, each naming the setting (`policy.tenants.kids.review.nudity: ...`).

    `model_thresholds`: each label the model (set) scores, with the thresholds its models flag it at (empty for a
    label no model flags); None skips the checks that need the model (a file checked before any model is known)."""
    p: list[str] = []
    tables: list[tuple[str, str | None, Mapping[str, float], Mapping[str, float]]] = [
        (where, None, policy.flag, policy.review)]
    for tenant, table in sorted(policy.tenants.items()):
        at = f"{where}.tenants.{tenant}"
        if not tenant.strip():
            p.append(f"{where}.tenants: a tenant's name must not be empty")
        if not isinstance(table, Mapping):
            p.append(f"{at}: must be a table of `flag` and `review`")
            continue
        unknown = sorted(set(table) - set(TENANT_KEYS))
        if unknown:
            p.append(f"{at}.{unknown[0]}: unknown setting (known: flag, review)")
        tables.append((at, tenant, table.get("flag", {}), table.get("review", {})))
    for at, _tenant, flag, review in tables:
        for kind, thresholds in (("flag", flag), ("review", review)):
            for label, value in thresholds.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                    p.append(f"{at}.{kind}.{label}: must be in [0, 1], got {value!r}")
                elif model_thresholds is not None and label not in model_thresholds:
                    p.append(f"{at}.{kind}.{label}: the model has no label {label!r} "
                             f"(labels: {', '.join(model_thresholds)})")
    if p:
        return p
    for at, owner, _flag, review in tables:
        for label, value in review.items():
            limit = _flag_threshold(policy, where, owner, label, model_thresholds)
            if limit is not None and value > limit[0]:
                p.append(f"{at}.review.{label}: {value:g} is above its flag threshold {limit[0]:g} ({limit[1]}): "
                         "the review band must lie below the flag threshold")
    return p


def _flag_threshold(policy: PolicySettings, where: str, tenant: str | None, label: str,
                    model_thresholds: Mapping[str, Sequence[float]] | None) -> tuple[float, str] | None:
    """The flag threshold a review threshold of `label` (the tenant's, or the policy's) lies below, and where it
    is set; None when nothing flags the label (a model that never flags it, unknown without the model)."""
    own = policy.tenants.get(tenant, {}).get("flag", {}) if tenant is not None else {}
    if label in own:
        return float(own[label]), f"{where}.tenants.{tenant}.flag.{label}"
    if label in policy.flag:
        return float(policy.flag[label]), f"{where}.flag.{label}"
    if model_thresholds and model_thresholds.get(label):
        return min(model_thresholds[label]), "the model's threshold"
    return None


def model_label_thresholds(models: Sequence[ModelSettings]) -> dict[str, list[float]]:
    """Each label the models score, with the thresholds they flag it at (none where `never_flag` lists it)."""
    out: dict[str, list[float]] = {}
    for m in models:
        for label in m.labels:
            flags = out.setdefault(label, [])
            if label not in m.never_flag:
                flags.append(float(m.thresholds.get(label, m.default_threshold)))
    return out
