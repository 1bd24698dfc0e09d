"""The per-tenant verdict policy (worker/policy/verdicts.py) against a plain reference, and the [policy] checks."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.config import ConfigError, PolicySettings, load_settings, policy_problems
from worker.frames import ModelVerdict, Verdict
from worker.policy.verdicts import ALLOW, FLAG, REVIEW, Decision, Policy

LABELS = ("nudity", "violence", "weapons", "drugs")
MODEL_THRESHOLD = 0.5


def reference(settings: PolicySettings, tenant: str, verdict: Verdict) -> Decision:
    """The rule as the issue states it, with no tables: each label's thresholds looked up afresh every time."""
    own = settings.tenants.get(tenant, {})
    judged = [o.verdict for o in verdict.models if o.verdict is not None] if verdict.models else [verdict]
    flags: list[str] = []
    reviews: list[str] = []
    for v in judged:
        for label, score in v.scores.items():
            flag_at = own.get("flag", {}).get(label, settings.flag.get(label))
            review_at = own.get("review", {}).get(label, settings.review.get(label))
            flagged = label in v.flagged_labels if flag_at is None else score >= flag_at
            if flagged:
                if label not in flags:
                    flags.append(label)
            elif review_at is not None and score >= review_at and label not in reviews:
                reviews.append(label)
    if flags:
        return Decision(FLAG, tuple(flags))
    return Decision(REVIEW, tuple(reviews)) if reviews else Decision(ALLOW)


def random_policy(rng: random.Random, tenants: int) -> PolicySettings:
    def thresholds() -> tuple[dict[str, float], dict[str, float]]:
        flag, review = {}, {}
        for label in LABELS:
            if rng.random() < 0.6:
                flag[label] = round(rng.uniform(0.2, 1.0), 3)
            if rng.random() < 0.6:
                limit = flag.get(label, MODEL_THRESHOLD)
                review[label] = round(rng.uniform(0.0, limit), 3)
        return flag, review

    flag, review = thresholds()
    overrides: dict[str, dict[str, dict[str, float]]] = {}
    for t in range(1, tenants + 1):
        if rng.random() < 0.3:
            f, r = thresholds()
            # A tenant's review lies below its own flag threshold, else the policy's, else the model's.
            r = {k: min(v, f.get(k, flag.get(k, MODEL_THRESHOLD))) for k, v in r.items()}
            overrides[f"t{t}"] = {"flag": f, "review": r}
    review = {k: min(v, flag.get(k, MODEL_THRESHOLD)) for k, v in review.items()}
    return PolicySettings(flag=flag, review=review, tenants=overrides)


def edge_scores(policy: PolicySettings) -> list[float]:
    """Every threshold of the policy and the floats just around it, the band edges, and the ends of [0, 1]."""
    edges = {0.0, 1.0, MODEL_THRESHOLD}
    tables: list[dict[str, Any]] = [{"flag": policy.flag, "review": policy.review}, *policy.tenants.values()]
    for table in tables:
        for kind in ("flag", "review"):
            edges.update(table.get(kind, {}).values())
    out = []
    for e in edges:
        out += [e, math.nextafter(e, 0.0), math.nextafter(e, 1.0), max(0.0, e - 1e-6), min(1.0, e + 1e-6)]
    return out


def random_verdict(rng: random.Random, edges: list[float], model_set: bool) -> Verdict:
    def one() -> Verdict:
        labels = rng.sample(LABELS, rng.randint(1, len(LABELS)))
        scores = {label: rng.choice(edges) if rng.random() < 0.8 else rng.random() for label in labels}
        flagged = tuple(label for label, s in scores.items() if s >= MODEL_THRESHOLD)
        return Verdict(scores=scores, flagged_labels=flagged)

    if not model_set:
        return one()
    models = tuple(ModelVerdict(f"m{i}", "1", None if i and rng.random() < 0.3 else one()) for i in range(3))
    first = models[0].verdict
    assert first is not None
    return Verdict(scores=first.scores, flagged_labels=first.flagged_labels, models=models, decided_by="m0")


def test_policy_matches_the_reference_on_100k_scores_at_the_edges():
    rng = random.Random(66)
    differences, compared, seen = 0, 0, set()
    for _round in range(20):
        policy_settings = random_policy(rng, tenants=200)
        policy = Policy(policy_settings)
        edges = edge_scores(policy_settings)
        for _ in range(5_000):
            tenant = f"t{rng.randint(1, 250)}"  # some with overrides, some without, some never named
            verdict = random_verdict(rng, edges, model_set=rng.random() < 0.25)
            got, want = policy.decide(tenant, verdict), reference(policy_settings, tenant, verdict)
            differences += got != want
            compared += 1
            seen.add(got.verdict)
    assert compared >= 100_000
    assert differences == 0
    assert seen == {ALLOW, REVIEW, FLAG}


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tenant=st.integers(1, 10_000))
def test_policy_matches_the_reference_for_any_tenant(seed, tenant):
    rng = random.Random(seed)
    policy_settings = random_policy(rng, tenants=20)
    verdict = random_verdict(rng, edge_scores(policy_settings), model_set=rng.random() < 0.5)
    name = f"t{tenant % 25}"
    assert Policy(policy_settings).decide(name, verdict) == reference(policy_settings, name, verdict)


def test_the_issue_example_gives_kids_stricter_verdicts():
    policy = Policy(PolicySettings(flag={"nudity": 0.8}, review={"nudity": 0.5},
                                   tenants={"kids": {"flag": {"nudity": 0.3}, "review": {"nudity": 0.1}}}))
    frame = Verdict(scores={"nudity": 0.4, "violence": 0.1}, flagged_labels=())
    assert policy.decide("kids", frame) == Decision(FLAG, ("nudity",))
    assert policy.decide("dating", frame) == Decision(ALLOW)
    assert policy.decide("dating", Verdict({"nudity": 0.5}, ())) == Decision(REVIEW, ("nudity",))
    assert policy.decide("kids", Verdict({"nudity": 0.1}, ())) == Decision(REVIEW, ("nudity",))
    assert policy.decide("dating", Verdict({"nudity": 0.8}, ())) == Decision(FLAG, ("nudity",))


def test_unnamed_labels_flag_as_the_model_does():
    policy = Policy(PolicySettings(flag={"nudity": 0.9}))
    flagged_by_model = Verdict({"nudity": 0.6, "violence": 0.7}, flagged_labels=("nudity", "violence"))
    assert policy.decide("any", flagged_by_model) == Decision(FLAG, ("violence",))
    assert Policy(PolicySettings()).decide("any", flagged_by_model) == Decision(FLAG, ("nudity", "violence"))


def test_flag_wins_over_review():
    policy = Policy(PolicySettings(flag={"nudity": 0.8}, review={"violence": 0.2}))
    assert policy.decide("t", Verdict({"nudity": 0.9, "violence": 0.5}, ())) == Decision(FLAG, ("nudity",))


def test_the_version_names_the_content():
    a = Policy(PolicySettings(flag={"nudity": 0.8}))
    assert a.version == Policy(PolicySettings(flag={"nudity": 0.8})).version
    assert a.version != Policy(PolicySettings(flag={"nudity": 0.7})).version
    assert a.version.startswith("file-")
    assert Policy(PolicySettings(), version="r3").version == "r3"


def write(tmp_path, text: str):
    path = tmp_path / "w.toml"
    path.write_text(text)
    return path


def test_the_issue_example_loads(tmp_path):
    s = load_settings(write(tmp_path, '[policy]\nflag = { nudity = 0.8 }\nreview = { nudity = 0.5 }\n'
                                      '[policy.tenants.kids]\nflag = { nudity = 0.3 }\nreview = { nudity = 0.1 }\n'),
                      env={})
    assert s.policy.tenants["kids"]["review"] == {"nudity": 0.1}


@pytest.mark.parametrize(("text", "named"), [
    ('[policy]\nflag = { nudity = 1.5 }\n', "policy.flag.nudity: must be in [0, 1]"),
    ('[policy]\nreview = { nudity = -0.1 }\n', "policy.review.nudity: must be in [0, 1]"),
    ('[policy]\nflag = { colour = 0.5 }\n', "policy.flag.colour: the model has no label 'colour'"),
    ('[policy]\nflags = { nudity = 0.5 }\n', "policy.flags: unknown setting"),
    ('[policy.tenants.kids]\nflg = { nudity = 0.5 }\n', "policy.tenants.kids.flg: unknown setting"),
    ('[policy]\nflag = { nudity = 0.6 }\nreview = { nudity = 0.7 }\n',
     "policy.review.nudity: 0.7 is above its flag threshold 0.6 (policy.flag.nudity)"),
    ('[policy]\nflag = { nudity = 0.6 }\n[policy.tenants.kids]\nreview = { nudity = 0.65 }\n',
     "policy.tenants.kids.review.nudity: 0.65 is above its flag threshold 0.6 (policy.flag.nudity)"),
    ('[policy]\nreview = { violence = 0.7 }\n',
     "policy.review.violence: 0.7 is above its flag threshold 0.5 (the model's threshold)"),
])
def test_a_bad_policy_is_refused_naming_the_setting(tmp_path, text, named):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text), env={})
    assert named in str(err.value)


def test_without_the_model_only_the_policy_itself_is_checked():
    policy = PolicySettings(flag={"colour": 0.5}, review={"colour": 0.4})
    assert policy_problems(policy) == []
    assert policy_problems(policy, {"nudity": [0.5]})[0].startswith("policy.flag.colour: the model has no label")
