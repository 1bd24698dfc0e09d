"""Fairness across the partitions of a class under overload (issue 51, item 2): the worker loop as it runs
(`build_pipeline`: FrameSource, flow control, the batcher, delivery) over the test kit's in-memory Kafka, with a
simulated runtime and a fake clock, so one source tree is compared with another on the same load.

The load: open-loop, 6 partitions per class (frames.realtime/standard/bulk), 20% / 40% / 40% of the frames,
Poisson arrivals (seeded per round), capture time = send time, at `--load` times what the simulated runtime
serves at batches of 32 (one runner, a batch of n frames takes BATCH_FIXED_S + n * FRAME_S; realtime's small
batches take more of it, so at 0.45 realtime and standard are served and bulk is overloaded). The kit's consumer
serves the partitions it has fetched in a fixed order (lowest partition first), as librdkafka's fetch queue may:
the worst case for a loop that does not keep its partitions fair itself.

Per partition: the longest gap between answers (results produced) while it has input (its first frame sent to the
end of the run, the tail after its last answer included), and per class the max over its partitions, their
median, and max / median (done when, issue 51: at most 2 for every class). Each round runs each tree in a fresh
process; rounds interleave the trees; figures are median (min-max) over rounds.

    python bench/partition_fairness.py --base /tmp/base --rounds 3      # this tree against another
    python bench/partition_fairness.py --seconds 10 --rounds 1           # this tree only, shorter

`--base` is a checkout of the other version (`git archive main worker schemas | tar -x -C /tmp/base`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PARTITIONS = 6
CLASS_SHARES = {"realtime": 0.2, "standard": 0.4, "bulk": 0.4}
BATCH_FIXED_S = 0.001
FRAME_S = 0.0005
TICK_S = 0.002


def one_round(seconds: float, load: float, seed: int) -> dict[str, Any]:
    """One run of the loop over the kit; per class and partition its longest answer gap (s) and its answers."""
    from worker.codec.schemas import FrameRecord, encode_frame
    from worker.config import ObservabilitySettings, Settings
    from worker.frames import BatchOutcome, Encoding, Priority
    from worker.loop.pipeline import build_pipeline
    from worker.metrics import Health, Metrics
    from worker.testing import FakeClock, InMemoryKafka
    from worker.testing.fakes import outcome

    class SimulatedRuntime:
        """One runner: batches run one after another, each BATCH_FIXED_S + FRAME_S per frame of simulated time."""

        preferred_batch_sizes: tuple[int, ...] = ()
        model_input_hw = None
        memory_policy = None
        model_name = "sim"
        model_version = "1"
        runner_count = 1

        def __init__(self, clock: FakeClock) -> None:
            self._clock = clock
            self._busy_until = 0.0
            self.ended = False  # past the run's end: the loop's drain waits for every batch, so finish at once
            self.running: list[tuple[float, list[Any], Future[BatchOutcome]]] = []

        def submit(self, frames: Any, shape: tuple[int, int, int], priority: Priority = Priority.BULK) -> Any:
            frames = list(frames)
            start = max(self._clock(), self._busy_until)
            self._busy_until = start + BATCH_FIXED_S + FRAME_S * len(frames)
            future: Future[BatchOutcome] = Future()
            self.running.append((self._busy_until, frames, future))
            if self.ended:
                self.finish_due()
            return future

        def finish_due(self) -> None:
            now = self._clock()
            while self.running and (self.ended or self.running[0][0] <= now):
                _, frames, future = self.running.pop(0)
                future.set_result(outcome(frames))

    settings = Settings(observability=ObservabilitySettings(worker_id="fair-0"))
    topics = {"realtime": settings.topics.realtime, "standard": settings.topics.standard, "bulk": settings.topics.bulk}
    clock, kafka, rng = FakeClock(), InMemoryKafka(), random.Random(seed)
    runtime = SimulatedRuntime(clock)
    capacity = 32 / (BATCH_FIXED_S + 32 * FRAME_S)  # frames/s at batches of 32
    rate = load * capacity  # frames/s over all partitions
    partitions = [(cls, p) for cls in CLASS_SHARES for p in range(PARTITIONS)]
    for cls, p in partitions:  # every partition exists (and is assigned) from the start
        kafka.send((topics[cls], p))
    next_at = {(cls, p): clock() + rng.expovariate(rate * CLASS_SHARES[cls] / PARTITIONS) for cls, p in partitions}
    sent = dict.fromkeys(partitions, 0)
    first_sent: dict[tuple[str, int], float] = {}
    answers: dict[tuple[str, int], list[float]] = {tp: [] for tp in partitions}
    stream_of = {f"{cls}-{p}".encode(): (cls, p) for cls, p in partitions}
    pipeline = build_pipeline(settings, runtime, Metrics(), Health(), clock, clients=kafka.clients)  # type: ignore[arg-type]
    start, seen = clock(), 0
    end = start + seconds

    def turn() -> bool:
        nonlocal seen
        producer = kafka.producers[0] if kafka.producers else None
        if producer is not None:
            for produced in producer.visible[seen:]:
                tp = stream_of.get(produced.key or b"")
                if tp is not None:
                    answers[tp].append(clock())
            seen = len(producer.visible)
        clock.advance(TICK_S)
        now = clock()
        for (cls, p), at in next_at.items():
            batch = []
            while at <= now:
                batch.append(encode_frame(FrameRecord(
                    stream_id=f"{cls}-{p}", frame_index=sent[(cls, p)], capture_ts_ms=int(at * 1000), tenant="t",
                    priority=Priority[cls.upper()], width=16, height=16, channels=3, encoding=Encoding.RAW_RGB8,
                    data=bytes(16 * 16 * 3))))
                sent[(cls, p)] += 1
                first_sent.setdefault((cls, p), at)
                at += rng.expovariate(rate * CLASS_SHARES[cls] / PARTITIONS)
            if batch:
                kafka.send((topics[cls], p), *batch)
            next_at[(cls, p)] = at
        runtime.ended = now >= end
        runtime.finish_due()
        return runtime.ended

    pipeline.run(should_stop=turn)
    gaps: dict[str, dict[str, float]] = {cls: {} for cls in CLASS_SHARES}
    for (cls, p), times in answers.items():
        marks = [first_sent.get((cls, p), end)] + [t for t in times if t <= end] + [end]
        gaps[cls][str(p)] = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    return {"gaps_s": gaps, "answered": {f"{cls}-{p}": len(t) for (cls, p), t in answers.items()},
            "sent": {f"{cls}-{p}": n for (cls, p), n in sent.items()}, "capacity_fps": capacity,
            "offered_fps": rate}


def class_figures(gaps: dict[str, float]) -> dict[str, float]:
    """Longest gap of any partition, the median partition's, their ratio, and the longest over the shortest (which
    shows starvation where half the partitions starve, and the median is one of them)."""
    values = list(gaps.values())
    worst, median, best = max(values), statistics.median(values), min(values)
    return {"max_gap_s": worst, "median_gap_s": median, "ratio": worst / median if median > 0 else float("inf"),
            "max_over_min": worst / best if best > 0 else float("inf")}


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=40.0, help="simulated seconds per run")
    parser.add_argument("--load", type=float, default=0.45, help=(
        "offered frames/s over the nominal capacity (batches of 32); realtime's small batches take more of it, so bulk "
        "is overloaded at 0.45"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "partition_fairness.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one round, in the round's tree (common.run_child)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_round(**json.loads(args.child))))
        return 0
    sys.path.insert(0, str(HERE))
    import common  # the parent only: it puts this repository's worker first on sys.path

    trees = {"this": HERE.parent, **({"base": args.base.resolve()} if args.base else {})}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            row = common.run_child(__file__, {"seconds": args.seconds, "load": args.load, "seed": r}, tree,
                                   timeout_s=1800)
            row["figures"] = {cls: class_figures(g) for cls, g in row["gaps_s"].items()}
            runs[name].append(row)
            print(f"round {r} {name}: " + "; ".join(
                f"{cls} max {f['max_gap_s']:.2f}s median {f['median_gap_s']:.2f}s ratio {f['ratio']:.2f}"
                for cls, f in row["figures"].items()), flush=True)
    lines = [f"Longest answer gap per partition, 6 partitions per class, load {args.load}x capacity, "
             f"{args.seconds:.0f} s simulated, {args.rounds} interleaved rounds: median (min-max)", "",
             "| tree | class | longest gap, any partition (s) | median partition's (s) | max / median | max / min | "
             "partitions' longest gaps, round 0 (s) |", "|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        for cls in CLASS_SHARES:
            f = [row["figures"][cls] for row in rows]
            per_partition = ", ".join(f"{p}: {g:.1f}" for p, g in rows[0]["gaps_s"][cls].items())
            lines.append(f"| {name} | {cls} | {spread([x['max_gap_s'] for x in f])} | "
                         f"{spread([x['median_gap_s'] for x in f])} | {spread([x['ratio'] for x in f])} | "
                         f"{spread([x['max_over_min'] for x in f])} | {per_partition} |")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "partition_fairness", "seconds": args.seconds, "load": args.load,
                                    "rounds": args.rounds, "trees": {k: str(v) for k, v in trees.items()},
                                    "runs": runs, "table": text}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
