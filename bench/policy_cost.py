"""The per-tenant verdict policy's cost (issue 66, worker/policy/verdicts.py): goal under 5 us per frame, tenants
1..10,000.

1. decide: `Policy.decide` alone per frame, a policy with overrides for 3,000 of 10,000 tenants (each naming 1-5
   labels), frames of random tenants 1..10,000 with the builtin model's 5 labels; a single model, and a set of 3.
2. in the loop: `Answers.of_batch` (worker/loop/answers.py: the results of a batch of 32, encoded, counted) with the
   policy (its verdict decided, written into the result, routes chosen, streamfer_verdicts_total counted) against
   without it (judge None: the model's flags alone, as before issue 66), interleaved rounds in one process; the
   difference per frame is the policy's cost in the loop. The two run in turns of 10 batches over the same
   batches (which goes first alternates), so a shared machine's other work falls on both alike.

    python bench/policy_cost.py [--rounds 7] [--frames 64000]

Prints a table and writes bench/results/policy_cost.json and policy_cost.md. No broker, no model: pure CPU on this host.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, table, write_json
from stats import Spread

from worker.batching.batch import Batch
from worker.codec.schemas import ResultContext
from worker.config import PolicySettings, Settings, TopicSettings
from worker.frames import BatchOutcome, Encoding, Frame, ModelVerdict, Priority, SourceRef, Verdict
from worker.loop.answers import Answers, judge_of
from worker.metrics import Metrics
from worker.policy.verdicts import Policy

LABELS = Settings().model.labels
TENANTS = 10_000
OVERRIDDEN = 3_000
BATCH = 32
GOAL_US = 5.0


def policy_settings(rng: random.Random) -> PolicySettings:
    def table_of(n: int) -> tuple[dict[str, float], dict[str, float]]:
        labels = rng.sample(LABELS, n)
        flag = {label: round(rng.uniform(0.5, 1.0), 3) for label in labels}
        review = {label: round(rng.uniform(0.1, flag[label]), 3) for label in labels}
        return flag, review

    flag, review = table_of(len(LABELS))
    tenants = {}
    for t in rng.sample(range(1, TENANTS + 1), OVERRIDDEN):
        f, r = table_of(rng.randint(1, len(LABELS)))
        tenants[f"tenant-{t}"] = {"flag": f, "review": {k: min(v, f.get(k, flag[k])) for k, v in r.items()}}
    return PolicySettings(flag=flag, review=review, tenants=tenants)


def verdict(rng: random.Random, models: int) -> Verdict:
    def one() -> Verdict:
        scores = {label: rng.random() for label in LABELS}
        return Verdict(scores, tuple(label for label, s in scores.items() if s >= 0.5))

    if models == 1:
        return one()
    outs = tuple(ModelVerdict(f"m{i}", "1", one()) for i in range(models))
    first = outs[0].verdict
    assert first is not None
    return Verdict(first.scores, first.flagged_labels, models=outs, decided_by="m0")


def frame(rng: random.Random, i: int) -> Frame:
    return Frame(stream_id=f"cam-{i % 64}", frame_index=i, tenant=f"tenant-{rng.randint(1, TENANTS)}",
                 priority=Priority.STANDARD, capture_ts_ms=1_700_000_000_000, width=224, height=224, channels=3,
                 encoding=Encoding.JPEG, data=b"", source=SourceRef("frames.standard", i % 6, i))


def decide_us(policy: Policy, work: list[tuple[str, Verdict]], repeats: int = 3) -> float:
    decide = policy.decide
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for tenant, v in work:
            decide(tenant, v)
        best = min(best, time.perf_counter() - t0)
    return best / len(work) * 1e6


def paired_loop_us(without: Answers, with_policy: Answers, batches: list[tuple[Batch, BatchOutcome]],
                   chunk: int = 10) -> tuple[float, float]:
    """Both variants over the same batches, alternating every `chunk` batches (which goes first alternates too), so
    the machine's other work falls on both alike; us per frame of each."""
    frames = sum(b.size for b, _ in batches)
    spent = {id(without): 0.0, id(with_policy): 0.0}
    for n, k in enumerate(range(0, len(batches), chunk)):
        part = batches[k:k + chunk]
        for answers in ((without, with_policy) if n % 2 == 0 else (with_policy, without)):
            t0 = time.perf_counter()
            for batch, outcome in part:
                answers.of_batch(batch, outcome, 1_700_000_001.0)
            spent[id(answers)] += time.perf_counter() - t0
    return spent[id(without)] / frames * 1e6, spent[id(with_policy)] / frames * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--frames", type=int, default=32_000)
    args = ap.parse_args(argv)
    rng = random.Random(66)
    ps = policy_settings(rng)
    policy = Policy(ps)
    work = {models: [(f"tenant-{rng.randint(1, TENANTS)}", verdict(rng, models)) for _ in range(args.frames)]
            for models in (1, 3)}
    frames = [frame(rng, i) for i in range(args.frames)]
    batches = []
    for k in range(0, len(frames), BATCH):
        chunk = frames[k:k + BATCH]
        batch = Batch(tuple(chunk), (224, 224, 3), Priority.STANDARD, "main", 0.0, 1_700_000_000.5, "full")
        outcome = BatchOutcome([(f, verdict(rng, 1)) for f in chunk], [], len(chunk), 1.0, 2.0, 1_700_000_000.6,
                               len(chunk), False)
        batches.append((batch, outcome))
    settings = Settings(policy=ps, topics=TopicSettings(review="moderation.review", flagged="moderation.flagged"))
    context = ResultContext("builtin", "1", "w0")
    runs: dict[str, list[float]] = {name: [] for name in ["without policy", "with policy", "decide, 1 model",
                                                          "decide, set of 3"]}
    for _round in range(args.rounds):
        without, with_policy = Answers(Metrics(), context), Answers(Metrics(), context, judge=judge_of(settings))
        paired_loop_us(without, with_policy, batches[:40])  # warm: label children, string caches
        a, b = paired_loop_us(without, with_policy, batches)
        runs["without policy"].append(a)
        runs["with policy"].append(b)
        runs["decide, 1 model"].append(decide_us(policy, work[1]))
        runs["decide, set of 3"].append(decide_us(policy, work[3]))
    deltas = [b - a for a, b in zip(runs["without policy"], runs["with policy"], strict=True)]
    spreads = {name: Spread.of(values) for name, values in runs.items()}
    delta = Spread.of(deltas)
    rows = [[name, s.text(2, " us")] for name, s in spreads.items()]
    rows.append(["policy's cost in the loop (with - without)", delta.text(2, " us")])
    text = table(f"policy cost per frame, tenants 1..{TENANTS:,} ({OVERRIDDEN:,} with overrides), "
                 f"{args.frames:,} frames x {args.rounds} rounds, in turns (median, min-max)",
                 ["what", "us per frame"], rows,
                 note=f"goal: the policy's cost in the loop under {GOAL_US} us per frame: "
                      f"{'met' if delta.median < GOAL_US else 'NOT met'}. A shared 2-core machine: noisy.")
    (RESULTS_DIR / "policy_cost.md").write_text(
        f"# Policy cost per frame (bench/policy_cost.py)\n\n```\n{text.strip()}\n```\n")
    write_json("policy_cost", {"args": vars(args), "tenants": TENANTS, "overridden_tenants": OVERRIDDEN,
                               "batch": BATCH, "goal_us": GOAL_US, "table": text,
                               "us_per_frame": {name: s.as_dict() for name, s in spreads.items()},
                               "policy_in_loop_us": delta.as_dict(),
                               "rounds": {name: [round(v, 3) for v in values] for name, values in runs.items()},
                               "median_decide_us": statistics.median(runs["decide, 1 model"])})
    return {"policy_in_loop_us": delta.median}


if __name__ == "__main__":
    main()
