"""Issue 51's rolling restart, measured: three workers on their defaults (builtin model, exactly-once), three
6-partition input topics, 16x16 raw frames, an open-loop load (20% realtime, 40% standard, 40% bulk; capture time =
intended send time); after `--before` s each worker in turn gets SIGTERM, exits, and a replacement starts under the
same worker id ("same") or a new one ("new", as a Kubernetes Deployment's pod), the next only once the group is
balanced again; the load goes on `--after` s more, then stops and every frame is awaited. A no-restart run (the
same load, `--calm` s, nobody stopped) is the control.

    KAFKA_BOOTSTRAP_SERVERS=host:port python tests/reliability/rollout.py [--runs 3] [--id-modes same,new]
        [--rate FPS] [--quick] [--out bench/results/rollout.json]

The rate: `--rate`, or half the group's backlog capacity, measured first (three workers drain a backlog of
`--capacity-frames` frames, expiry off, all answers counted; the steady rate between the 10th and 90th percentile
answers). Per run: lost / duplicated (the suite's audit of source coordinates, read_committed), realtime frames
answered EXPIRED (`batching.realtime.max_age_ms`, 2 s), realtime p50/p99 (append time of the answer minus capture
time) of the frames sent before (less the load's first 5 s, which meet cold workers) / during / after the rollout,
each partition's longest time with no owner (from the workers' logs: a revoke or loss that left it to nobody, to its
next assignment), each partition's longest time without an answer while it had input (per class, the max; for the
no-restart run also the median partition's), a replacement's start -> first assignment, and the transaction aborts
after each rebalance callback per process.
Figures: median (min-max) over the runs. Writes bench/results/rollout.json and rollout.md; exits 1 when a run lost or
duplicated a frame.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages (tests, worker) by name
sys.path.append(str(ROOT / "bench"))  # the benchmarks' JSON and table helpers; appended: never shadows a module

import common  # noqa: E402
from common import markdown_table  # noqa: E402
from stats import Spread  # noqa: E402

from tests.reliability import rolloutfigures as fig  # noqa: E402
from tests.reliability.harness import FrameFactory, Lab, Outgoing, Run, answer_times  # noqa: E402
from worker.frames import Priority, SourceRef  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "rollout.json"
WORKERS = ("w0", "w1", "w2")
PARTITIONS = 6  # per input topic
# One in five frames realtime, two standard, two bulk.
CLASS_CYCLE = (Priority.REALTIME, Priority.STANDARD, Priority.STANDARD, Priority.BULK, Priority.BULK)
SHAPE = (16, 16)
# --id-modes -> the harness's worker-id policy of a replacement (harness.WORKER_IDS). "surge": a new id, and the
# replacement starts before its predecessor stops, once the replacement holds partitions (a Deployment's maxSurge 1,
# maxUnavailable 0, as deploy/k8s/deployment.yaml sets); not part of issue 51's scenario, so not run by default.
ID_MODES = {"same": "fixed", "new": "fresh", "surge": "fresh"}
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
# The "before" window leaves out the load's first seconds: the workers meet the load cold (their batch cost model
# learns its rate), which is no part of a rollout's cost.
SETTLE_S = 5.0
# The timeline in the JSON: realtime p99 and expired frames per bucket of send time.
TIMELINE_BUCKET_S = 2.0
# Goals of issue 51 (done when).
P99_GROWTH_MAX = 2.0
UNOWNED_MAX_S = 1.5
ANSWER_GAP_MAX_S = 5.0
CALM_GAP_RATIO_MAX = 2.0


@dataclass(frozen=True)
class Scenario:
    before_s: float = 20.0
    after_s: float = 15.0
    calm_s: float = 40.0
    capacity_frames: int = 10000


QUICK = Scenario(before_s=10.0, after_s=8.0, calm_s=15.0, capacity_frames=2000)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sc = QUICK if args.quick else Scenario()
    sc = Scenario(args.before or sc.before_s, args.after or sc.after_s, args.calm or sc.calm_s,
                  args.capacity_frames or sc.capacity_frames)
    workdir = Path(tempfile.mkdtemp(prefix="streamfer-rollout-"))
    lab = _lab(workdir)
    report: dict[str, Any] = {"benchmark": "rollout", "args": vars(args), "scenario": sc.__dict__,
                              "workdir": str(workdir), "command": " ".join(["python", "tests/reliability/rollout.py",
                                                                            *(argv or sys.argv[1:])])}
    try:
        if args.rate:
            report["rate"] = {"fps": args.rate, "from": "--rate"}
        else:
            cap = measure_capacity(lab, sc.capacity_frames)
            report["capacity"] = cap
            report["rate"] = {"fps": round(cap["fps"] / 2, 1), "from": "half the measured backlog capacity"}
        rate = report["rate"]["fps"]
        _log(f"load: {rate} frames/s ({report['rate']['from']})")
        report["runs"] = {}
        for i in range(args.runs):
            for mode in args.id_modes:
                report["runs"].setdefault(mode, []).append(_guard(lambda m=mode: one_run(lab, m, rate, sc), mode, i))
            if not args.no_control:
                report["runs"].setdefault("no restart", []).append(
                    _guard(lambda: one_run(lab, None, rate, sc), "no restart", i))
    finally:
        lab.close()
    report["summary"] = summarize(report["runs"])
    text = render(report)
    print(text)
    out = Path(args.out)
    common.write_json(out.stem, {**report, "table": text}, out.parent)
    out.with_suffix(".md").write_text(text + "\n")
    _log(f"worker logs under {workdir}; wrote {out.with_suffix('.md')}")
    broken = [r for runs in report["runs"].values() for r in runs if r.get("error") or r["lost"] or r["duplicated"]]
    return 1 if broken else 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per id mode and of the control (default %(default)s)")
    p.add_argument("--id-modes", type=lambda s: [m for m in s.split(",") if m], default=["same", "new"],
                   help="same (a replacement keeps the worker id), new (a new id per replacement), surge (a new id, "
                        "started before its predecessor stops), comma-separated (default same,new)")
    p.add_argument("--rate", type=float, default=0.0, metavar="FPS",
                   help="offered load; default: half the group's backlog capacity, measured first")
    p.add_argument("--quick", action="store_true", help="shorter phases and a smaller capacity backlog")
    p.add_argument("--before", type=float, default=0.0, metavar="S", help="load before the rollout (default 20)")
    p.add_argument("--after", type=float, default=0.0, metavar="S", help="load after the rollout (default 15)")
    p.add_argument("--calm", type=float, default=0.0, metavar="S", help="the no-restart run's load (default 40)")
    p.add_argument("--capacity-frames", type=int, default=0, metavar="N", help="backlog to measure capacity with")
    p.add_argument("--no-control", action="store_true", help="skip the no-restart runs")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON report path (the table goes next to it, .md)")
    args = p.parse_args(argv)
    unknown = set(args.id_modes) - set(ID_MODES)
    if unknown:
        p.error(f"unknown id modes {sorted(unknown)}; known: {', '.join(ID_MODES)}")
    return args


def _lab(workdir: Path) -> Lab:
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        return Lab(workdir, fixed_bootstrap=given)
    _log("starting a local Kafka broker")
    return Lab.with_own_broker(workdir)


def _guard(body: Any, mode: str, index: int) -> dict[str, Any]:
    """A harness failure is a run with an error, not the end of the benchmark."""
    _log(f"{mode} run {index + 1}")
    try:
        row = body()
    except Exception as exc:  # noqa: BLE001
        _log(f"{mode} run {index + 1}: harness error {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "lost": 0, "duplicated": 0}
    _log(f"{mode} run {index + 1}: lost {row['lost']}, duplicated {row['duplicated']}, realtime expired "
         f"{row['realtime_expired']}, p99 ms {row['realtime_p99_ms']}, unowned {row['unowned_max_s']:.2f} s, "
         f"gaps {row['answer_gap_max_s']}")
    return row


# -- the load -------------------------------------------------------------------------------------------------
def load(factory: FrameFactory, count: int) -> list[Outgoing]:
    """`count` 16x16 raw frames, classes in CLASS_CYCLE's shares, each class's frames round-robin over its
    partitions (so every partition has input at the same rate)."""
    out: list[Outgoing] = []
    per_class = dict.fromkeys(Priority, 0)
    for i in range(count):
        prio = CLASS_CYCLE[i % len(CLASS_CYCLE)]
        out += factory.frames(1, jpeg_every=0, shape=SHAPE, priority=prio, partition=per_class[prio] % PARTITIONS)
        per_class[prio] += 1
    return out


# -- the group --------------------------------------------------------------------------------------------------
def balanced(run: Run, roles: Sequence[str] = WORKERS) -> bool:
    """Every worker holds its share (within one) and every partition has an owner (by the workers' assignment log
    lines)."""
    held = [run.fleet.partitions(w) for w in roles]
    total = PARTITIONS * len(run.topics.inputs)
    share = total // len(roles)
    return all(share <= len(h) <= share + (total % len(roles) > 0) for h in held) and len(set().union(*held)) == total


class Processes:
    """Each worker process's stretch of its role's log (a role's log holds its successive processes)."""

    def __init__(self, run: Run):
        self.run = run
        self.starts: list[tuple[str, str, int, float]] = []  # (process, role, log offset, time.time() at start)

    def start(self, role: str) -> None:
        path = self.run.fleet.log_path(role)
        offset = path.stat().st_size if path.exists() else 0
        self.starts.append((f"{role}#{sum(1 for s in self.starts if s[1] == role) + 1}", role, offset, time.time()))
        self.run.fleet.start(role)

    def events(self) -> list[fig.LogEvent]:
        out: list[fig.LogEvent] = []
        for process, role, offset, _t in self.starts:
            later = [o for _p, r, o, _t2 in self.starts if r == role and o > offset]
            with open(self.run.fleet.log_path(role), "rb") as fh:
                fh.seek(offset)
                text = fh.read((min(later) - offset) if later else -1).decode(errors="replace")
            out += fig.parse_log(text, process)
        return out


def start_group(run: Run, procs: Processes) -> None:
    for w in WORKERS:
        procs.start(w)
    if not run.wait(lambda: balanced(run), READY_TIMEOUT_S, interval_s=0.2):
        raise TimeoutError(f"the group did not balance within {READY_TIMEOUT_S:.0f} s: "
                           f"{ {w: len(run.fleet.partitions(w)) for w in WORKERS} }")


def measure_capacity(lab: Lab, frames: int) -> dict[str, Any]:
    """The group's backlog capacity: three workers (defaults, expiry off so every frame runs) drain `frames`
    published at once; frames/s between the 10th and 90th percentile answer."""
    _log(f"capacity: three workers drain a backlog of {frames} frames")
    run = Run(lab, "rollout capacity", "exactly_once", partitions=PARTITIONS, worker_defaults=True,
              env={"WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"})
    procs = Processes(run)
    try:
        start_group(run, procs)
        run.feed(load(run.factory, frames), wait=True)
        outcome = run.finish()
    except BaseException:
        run.abandon()
        raise
    times = sorted(r["_produced_at"] for r in run.results)
    lo, hi = times[len(times) // 10], times[len(times) * 9 // 10]
    fps = (len(times) * 0.8) / (hi - lo) if hi > lo else float("nan")
    _log(f"capacity: {fps:.0f} frames/s (lost {outcome.audit.lost}, duplicated {outcome.audit.duplicated})")
    return {"frames": frames, "fps": round(fps, 1), "lost": outcome.audit.lost,
            "duplicated": outcome.audit.duplicated, "logs": str(run.dir)}


# -- one run ----------------------------------------------------------------------------------------------------
def one_run(lab: Lab, id_mode: str | None, rate: float, sc: Scenario) -> dict[str, Any]:
    """A rolling restart (`id_mode` same or new) or, with None, the no-restart control; its figures."""
    restarting = id_mode is not None
    name = f"rollout ({id_mode} ids)" if restarting else "rollout control (no restart)"
    run = Run(lab.with_worker_ids(ID_MODES[id_mode] if id_mode else "fixed"), name, "exactly_once",
              partitions=PARTITIONS, worker_defaults=True)
    procs = Processes(run)
    marks: dict[str, float] = {}
    stops: list[dict[str, Any]] = []
    try:
        start_group(run, procs)
        # Enough items for the longest rollout the timeouts allow; the feed is ended when the scenario is over.
        longest_s = (sc.before_s + len(WORKERS) * (STOP_TIMEOUT_S + READY_TIMEOUT_S) + sc.after_s if restarting
                     else sc.calm_s)
        run.feed(load(run.factory, int(rate * longest_s)), rate_fps=rate)
        marks["feed_start"] = time.time()
        if restarting:
            run.wait(lambda: False, sc.before_s)
            marks["rollout_start"] = time.time()
            roles = list(WORKERS)
            for w in WORKERS:
                stops.append(surge(run, procs, w, roles) if id_mode == "surge" else replace(run, procs, w))
            marks["rollout_end"] = time.time()
            run.wait(lambda: False, sc.after_s)
        else:
            run.wait(lambda: False, sc.calm_s)
        marks["feed_end"] = time.time()
        run.end_feeds()
        outcome = run.finish()
    except BaseException:
        run.abandon()
        raise
    intended = run.intended
    marks["feed_start"] = min(intended.values(), default=marks["feed_start"])
    return figures(run, outcome.audit.lost, outcome.audit.duplicated, intended, procs, marks, stops,
                   problems=outcome.problems())


def replace(run: Run, procs: Processes, role: str) -> dict[str, Any]:
    """SIGTERM the role's process, wait for its exit, start its replacement, wait until the group is balanced."""
    t0 = time.time()
    rc = run.fleet.terminate(role, STOP_TIMEOUT_S)
    exited = time.time()
    procs.start(role)
    ok = run.wait(lambda: balanced(run), READY_TIMEOUT_S, interval_s=0.05)
    return {"role": role, "process": procs.starts[-1][0], "exit_code": rc, "stop_s": round(exited - t0, 2),
            "started_at": exited, "balanced_s": round(time.time() - exited, 2) if ok else None}


def surge(run: Run, procs: Processes, role: str, roles: list[str]) -> dict[str, Any]:
    """Start the role's replacement (a new role), wait until it holds partitions and every partition has an owner,
    then SIGTERM the old process, wait for its exit and for the group to balance; `roles` is updated."""
    new = f"{role}s"
    started = time.time()
    procs.start(new)
    run.wait(lambda: bool(run.fleet.partitions(new)) and balanced(run, [*roles, new]), READY_TIMEOUT_S,
             interval_s=0.05)
    t0 = time.time()
    rc = run.fleet.terminate(role, STOP_TIMEOUT_S)
    exited = time.time()
    roles[roles.index(role)] = new
    ok = run.wait(lambda: balanced(run, roles), READY_TIMEOUT_S, interval_s=0.05)
    return {"role": new, "process": procs.starts[-1][0], "exit_code": rc, "stop_s": round(exited - t0, 2),
            "started_at": started, "balanced_s": round(time.time() - started, 2) if ok else None}


def figures(run: Run, lost: int, duplicated: int, intended: dict[SourceRef, float], procs: Processes,
            marks: dict[str, float], stops: list[dict[str, Any]], problems: list[str]) -> dict[str, Any]:
    classes = {run.topics.realtime: "realtime", run.topics.standard: "standard", run.topics.bulk: "bulk"}
    answered = answer_times(run.results, [])
    first = {ref: min(ts) for ref, ts in answered.items()}
    status = {SourceRef(r["source_topic"], r["source_partition"], r["source_offset"]): r["status"]
              for r in run.results}
    last_answer = max(first.values(), default=marks["feed_end"])
    realtime = [(intended[ref], first[ref] - intended[ref]) for ref in intended
                if ref.topic == run.topics.realtime and ref in first]
    if "rollout_start" in marks:
        windows = [fig.Window("before", marks["feed_start"] + SETTLE_S, marks["rollout_start"]),
                   fig.Window("during", marks["rollout_start"], marks["rollout_end"]),
                   fig.Window("after", marks["rollout_end"], marks["feed_end"] + 1.0)]
    else:
        windows = [fig.Window("all", marks["feed_start"] + SETTLE_S, marks["feed_end"] + 1.0)]
    latency = fig.window_latencies(realtime, windows)
    expired_refs = {ref for ref, s in status.items() if s == "EXPIRED" and ref.topic == run.topics.realtime}
    for w in windows:
        latency[w.name]["expired"] = sum(1 for ref in expired_refs if w.start <= intended[ref] < w.end)
    buckets = [fig.Window(f"{t:.0f}", marks["feed_start"] + t, marks["feed_start"] + t + TIMELINE_BUCKET_S)
               for t in range(0, int(marks["feed_end"] - marks["feed_start"]) + 1, int(TIMELINE_BUCKET_S))]
    timeline = fig.window_latencies(realtime, buckets, qs=(0.99,))
    for w in buckets:
        timeline[w.name]["expired"] = sum(1 for ref in expired_refs if w.start <= intended[ref] < w.end)
    per_partition: dict[tuple[str, int], list[tuple[float, float | None]]] = {}
    for ref, sent in intended.items():
        per_partition.setdefault(ref.topic_partition, []).append((sent, first.get(ref)))
    gaps: dict[str, dict[str, float]] = {c: {} for c in classes.values()}
    for (topic, partition), frames in per_partition.items():
        gaps[classes[topic]][str(partition)] = round(fig.longest_answer_gap(frames, last_answer), 3)
    events = procs.events()
    # Ownership while the load ran and was answered; the final stop of every worker comes after the last answer.
    unowned = fig.unowned_spans(events, marks["feed_start"], last_answer)
    for stop in stops:
        assigned = fig.first_assignment(events, stop["process"])
        stop["start_to_ready_s"] = None if assigned is None else round(assigned - stop["started_at"], 2)
    expired = {c: sum(1 for ref, s in status.items() if s == "EXPIRED" and classes[ref.topic] == c)
               for c in classes.values()}
    return {
        "lost": lost, "duplicated": duplicated, "problems": problems, "frames": len(intended),
        # How far the feeder fell behind its schedule (its lag counts in the latencies: capture = intended time).
        "feeder_max_lag_s": round(max((f.max_send_lag_s for f in run.feeders), default=0.0), 3),
        "seconds_of_load": round(marks["feed_end"] - marks["feed_start"], 1),
        "rollout_s": round(marks["rollout_end"] - marks["rollout_start"], 1) if "rollout_start" in marks else None,
        "expired": expired, "realtime_expired": expired["realtime"], "realtime_latency": latency,
        "realtime_p99_ms": {w: round(v["p99_ms"]) for w, v in latency.items() if v["frames"]},
        "realtime_timeline": {"bucket_s": TIMELINE_BUCKET_S, "from_feed_start": timeline,
                              **{k: round(v - marks["feed_start"], 1) for k, v in marks.items()}},
        "unowned_max_s": max(unowned.values(), default=0.0),
        "unowned_s": {f"{t.rsplit('.', 1)[-1]}-{p}": round(s, 3) for (t, p), s in sorted(unowned.items())},
        "answer_gap_s": gaps, "answer_gap_max_s": {c: max(g.values(), default=0.0) for c, g in gaps.items()},
        "answer_gap_figures": {c: fig.gap_figures(g) for c, g in gaps.items()},
        "stops": stops, "aborts": fig.aborts_per_rebalance(events).as_dict(),
        "aborts_per_process": {p: fig.aborts_per_rebalance([e for e in events if e.process == p]).as_dict()
                               for p, *_ in procs.starts},
        "logs": str(run.dir),
    }


# -- the summary ------------------------------------------------------------------------------------------------
def _values(runs: list[dict[str, Any]], pick: Any) -> list[float]:
    out = []
    for r in runs:
        if r.get("error"):
            continue
        try:
            v = pick(r)
        except (KeyError, TypeError, ValueError):
            continue
        if v is not None:
            out.append(float(v))
    return out


def _ready(r: dict[str, Any]) -> float:
    return max(s["start_to_ready_s"] for s in r["stops"])


METRICS: list[tuple[str, str, Any, float | None, int]] = [
    # (metric, goal, value of a run, the most it may be (None: no goal), digits)
    ("lost", "0", lambda r: r["lost"], 0, 0),
    ("duplicated", "0", lambda r: r["duplicated"], 0, 0),
    ("realtime expired (max_age 2 s)", "0", lambda r: r["realtime_expired"], 0, 0),
    ("realtime expired, sent during the rollout", "", lambda r: r["realtime_latency"]["during"]["expired"], None, 0),
    ("realtime p50 ms before", "", lambda r: r["realtime_latency"]["before"]["p50_ms"], None, 0),
    ("realtime p50 ms during", "", lambda r: r["realtime_latency"]["during"]["p50_ms"], None, 0),
    ("realtime p50 ms after", "", lambda r: r["realtime_latency"]["after"]["p50_ms"], None, 0),
    ("realtime p99 ms before", "", lambda r: r["realtime_latency"]["before"]["p99_ms"], None, 0),
    ("realtime p99 ms during", "", lambda r: r["realtime_latency"]["during"]["p99_ms"], None, 0),
    ("realtime p99 ms after", "", lambda r: r["realtime_latency"]["after"]["p99_ms"], None, 0),
    ("realtime p99 during / before", f"<= {P99_GROWTH_MAX:g}",
     lambda r: r["realtime_latency"]["during"]["p99_ms"] / r["realtime_latency"]["before"]["p99_ms"],
     P99_GROWTH_MAX, 2),
    ("longest unowned partition s", f"<= {UNOWNED_MAX_S:g}", lambda r: r["unowned_max_s"], UNOWNED_MAX_S, 2),
    ("longest answer gap s, realtime", f"<= {ANSWER_GAP_MAX_S:g}", lambda r: r["answer_gap_max_s"]["realtime"],
     ANSWER_GAP_MAX_S, 2),
    ("longest answer gap s, standard", f"<= {ANSWER_GAP_MAX_S:g}", lambda r: r["answer_gap_max_s"]["standard"],
     ANSWER_GAP_MAX_S, 2),
    ("longest answer gap s, bulk", f"<= {ANSWER_GAP_MAX_S:g}", lambda r: r["answer_gap_max_s"]["bulk"],
     ANSWER_GAP_MAX_S, 2),
    ("replacement start -> ready s (slowest)", "", _ready, None, 2),
    ("rollout s (first SIGTERM -> balanced after the last)", "", lambda r: r["rollout_s"], None, 1),
    ("transaction aborts, all workers", "", lambda r: r["aborts"]["total"], None, 0),
    ("aborts after one rebalance, most of any worker", "<= 1", lambda r: r["aborts"]["most_per_rebalance"], 1, 0),
    ("rebalances with a second abort", "0", lambda r: r["aborts"]["repeated"], 0, 0),
    ("aborts that rewound", "", lambda r: r["aborts"]["rewinds"], None, 0),
]
CONTROL_METRICS: list[tuple[str, str, Any, float | None, int]] = [
    ("lost", "0", lambda r: r["lost"], 0, 0),
    ("duplicated", "0", lambda r: r["duplicated"], 0, 0),
    ("realtime expired", "0", lambda r: r["realtime_expired"], 0, 0),
    ("realtime p50 ms", "", lambda r: r["realtime_latency"]["all"]["p50_ms"], None, 0),
    ("realtime p99 ms", "", lambda r: r["realtime_latency"]["all"]["p99_ms"], None, 0),
    *[(f"{c}: longest answer gap / median partition's", f"<= {CALM_GAP_RATIO_MAX:g}",
       (lambda r, c=c: r["answer_gap_figures"][c]["ratio"]), CALM_GAP_RATIO_MAX, 2)
      for c in ("realtime", "standard", "bulk")],
    *[(f"{c}: longest answer gap s", "",
       (lambda r, c=c: r["answer_gap_figures"][c]["max_s"]), None, 2) for c in ("realtime", "standard", "bulk")],
    *[(f"{c}: median partition's longest gap s", "",
       (lambda r, c=c: r["answer_gap_figures"][c]["median_s"]), None, 2) for c in ("realtime", "standard", "bulk")],
    ("transaction aborts, all workers", "", lambda r: r["aborts"]["total"], None, 0),
]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per metric and id mode: median (min-max) over the runs, and whether the median meets the goal."""
    out: dict[str, Any] = {}
    for mode, mine in runs.items():
        metrics = CONTROL_METRICS if mode == "no restart" else METRICS
        out[mode] = {}
        for name, goal, pick, most, _digits in metrics:
            s = Spread.of(_values(mine, pick))
            out[mode][name] = {"goal": goal, **s.as_dict(),
                               "met": None if most is None or s.n == 0 else s.median <= most,
                               "all_runs_met": None if most is None or s.n == 0 else s.high <= most}
    return out


def render(report: dict[str, Any]) -> str:
    runs, summary = report["runs"], report["summary"]
    rate = report["rate"]
    cap = report.get("capacity")
    head = ["# Rolling restart (issue 51): three workers, exactly-once, worker defaults, 6 partitions per class",
            "",
            f"Command: `KAFKA_BOOTSTRAP_SERVERS=... {report['command']}`",
            "",
            f"Load: {rate['fps']:g} frames/s open loop ({rate['from']}"
            + (f": {cap['fps']:g} frames/s draining {cap['frames']} frames" if cap else "")
            + f"), 20/40/40% realtime/standard/bulk, 16x16 raw, builtin model. Phases: "
            f"{report['scenario']['before_s']:g} s before, the rollout, {report['scenario']['after_s']:g} s after; "
            f"no-restart control {report['scenario']['calm_s']:g} s. Figures: median (min-max) over "
            + ", ".join(f"{len(v)} {k} run(s)" for k, v in runs.items()) + "; met: by the median (all: every run).",
            ""]
    modes = [m for m in ID_MODES if m in runs]

    def cell(mode: str, name: str, digits: int) -> str:
        d = summary[mode][name]
        return Spread.from_dict(d).text(digits)

    def verdict(mode_list: list[str], name: str) -> str:
        got = [summary[m][name] for m in mode_list]
        if all(g["met"] is None for g in got):
            return ""
        parts = []
        for m, g in zip(mode_list, got, strict=True):
            word = "yes" if g["met"] else "NO"
            if g["met"] and not g["all_runs_met"]:
                word += " (not all runs)"
            parts.append(f"{m}: {word}" if len(mode_list) > 1 else word)
        return ", ".join(parts)

    lines = list(head)
    if modes:
        rows = [[name, goal, *[cell(m, name, digits) for m in modes], verdict(modes, name)]
                for name, goal, _pick, _most, digits in METRICS]
        lines += ["## The rolling restart", "",
                  *markdown_table(["metric", "goal", *[f"{m} ids" for m in modes], "met?"], rows), ""]
    if "no restart" in runs:
        rows = [[name, goal, cell("no restart", name, digits), verdict(["no restart"], name)]
                for name, goal, _pick, _most, digits in CONTROL_METRICS]
        lines += ["## No restart (control)", "", *markdown_table(["metric", "goal", "no restart", "met?"], rows), ""]
    errors = [f"- {m} run {i + 1}: {r['error']}" for m, rs in runs.items() for i, r in enumerate(rs) if r.get("error")]
    problems = [f"- {m} run {i + 1}: {p[:300]}" for m, rs in runs.items() for i, r in enumerate(rs)
                for p in r.get("problems", [])]
    if errors or problems:
        lines += ["## Problems", "", *errors, *problems, ""]
    return "\n".join(lines)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
