"""How much other work on the same cores slows the runtime, and how much of that is the GIL.

The executor alone (`InferenceExecutor.submit`: decode, preprocessing and the model, 2 batches in flight as in the
worker, no Kafka) runs with no other work, then beside a busy loop that runs pure Python for a share of the time
(`--duties`), either as a thread of the same process (it shares the GIL and the cores, as the worker's loop does) or
as a separate process (it shares only the cores). Variants run in interleaved rounds; every figure is the median
(min-max) of rounds, every ratio the median of per-round ratios to the round without busy work. The thread's loss
minus the process's loss at one duty is what the GIL costs; the process's loss is what the cores cost.

    python bench/contention.py [--model null] [--workload jpeg224] [--rounds 3] [--seconds 3] [--batch 16]
                               [--duties 0.25,0.4] [--period-ms 4]

No broker is needed. Prints a table and writes bench/results/contention.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from executor_load import executor_round, frame_cycle
from workloads import MODELS, WORKLOADS, model_settings

from worker.config import load_settings
from worker.runtime import InferenceExecutor

NONE = "none"
# One busy stretch plus one pause (`--period-ms`): 4 ms is about one turn of the worker's loop on a backlog (1.1 ms of
# CPU a turn, a turn every 4.2 ms, by bench/model_limit.py's stage timers with the near-zero model), so 25% is about
# the loop there. On the 2-core VM 1 ms stretches cost the runtime about as much through the GIL.
BUSY_PERIOD_S = 0.004


def busy(stop: Any, duty: float, started: Any = None, period_s: float = BUSY_PERIOD_S) -> None:
    """Run pure Python (holding the GIL in a thread) for `duty` of every `period_s`, sleep the rest, until `stop` (a
    threading or multiprocessing Event) is set; sets `started` first."""
    work_s, pause_s = duty * period_s, (1.0 - duty) * period_s
    if started is not None:
        started.set()
    while not stop.is_set():
        until = time.perf_counter() + work_s
        while time.perf_counter() < until:
            sum(range(50))
        time.sleep(pause_s)


@dataclass(frozen=True)
class Variant:
    """What runs beside the executor: nothing, or busy Python for `duty` of the time as a thread or a process."""

    kind: str  # "none", "thread" or "process"
    duty: float = 0.0

    @property
    def name(self) -> str:  # exact ("12.5%"), so two duties never share a name
        return NONE if self.kind == NONE else f"{self.kind} {self.duty * 100:g}%"

    def start(self, period_s: float) -> tuple[Any, Any]:
        """The busy work started (its stop event and thread or process), or (None, None) for none."""
        if self.kind == NONE:
            return None, None
        # spawn, not fork: this process has the executor's threads running
        make = threading if self.kind == "thread" else multiprocessing.get_context("spawn")
        stop, started = make.Event(), make.Event()
        runner = (threading.Thread if self.kind == "thread" else make.Process)(
            target=busy, args=(stop, self.duty, started, period_s), name="busy", daemon=True)
        runner.start()
        if not started.wait(60):
            raise RuntimeError(f"the busy {self.kind} did not start within 60 s")
        return stop, runner


def variants(duties: Sequence[float]) -> list[Variant]:
    return [Variant(NONE)] + [Variant(kind, duty) for duty in duties for kind in ("thread", "process")]


def summarise(fps: Mapping[str, Mapping[int, float]], duties: Sequence[float]) -> dict[str, Any]:
    """Per variant (by name): frames/s and the ratio to the no-busy-work run of each round; per duty: what the GIL
    costs (the process's ratio minus the thread's, per round) and what the cores cost (1 minus the process's ratio),
    over the rounds all three ran in."""
    none = fps[NONE]
    out: dict[str, Any] = {"variants": {name: {"frames_per_s": stats.Spread.of(list(by_round.values())),
                                               "of_none": stats.ratio_spread(by_round, none)}
                                        for name, by_round in fps.items()}, "duties": {}}
    for duty in duties:
        thread, process = fps[Variant("thread", duty).name], fps[Variant("process", duty).name]
        rounds = set(thread) & set(process) & set(none)
        thread_kept = stats.round_ratios({r: thread[r] for r in rounds}, none)
        process_kept = stats.round_ratios({r: process[r] for r in rounds}, none)
        out["duties"][f"{duty * 100:g}%"] = {
            "gil_loss": stats.Spread.of([p - t for p, t in zip(process_kept, thread_kept, strict=True)]),
            "cores_loss": stats.Spread.of([1.0 - p for p in process_kept])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="null")
    p.add_argument("--workload", choices=list(WORKLOADS), default="jpeg224")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per variant and round")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--duties", default="0.25,0.4", help="shares of the time the busy loop runs")
    p.add_argument("--period-ms", type=float, default=BUSY_PERIOD_S * 1000.0,
                   help="one busy stretch plus its pause (default: about a loop turn on a backlog)")
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args(argv)
    duties = [float(d) for d in args.duties.split(",")]
    if not all(0.0 < d < 1.0 for d in duties) or args.period_ms <= 0:
        p.error("--duties: each share between 0 and 1 (exclusive); --period-ms: > 0")
    workload, by_name = WORKLOADS[args.workload], {v.name: v for v in variants(duties)}
    settings = load_settings(env={}, overrides={"model": model_settings(args.model, workload),
                                                "runtime": {"torch_threads": args.torch_threads}})
    cycle = frame_cycle(workload)
    with InferenceExecutor.from_settings(settings.model, settings.runtime) as executor:
        executor.warm_up()

        def measure(name: str) -> dict[str, Any]:
            stop, runner = by_name[name].start(args.period_ms / 1000.0)
            try:
                measured = executor_round(executor, cycle, args.batch, args.seconds)
            finally:
                if stop is not None:
                    stop.set()
                    runner.join()
            print(f"[contention] {name}: {measured['frames_per_s']:.0f} frames/s, "
                  f"{measured['cpu_ms_per_frame']:.3f} CPU-ms/frame (this process)", flush=True)
            return measured

        runs = stats.run_rounds(stats.interleaved(list(by_name), args.rounds), measure)
    result = summarise({name: stats.figure(by_round, "frames_per_s") for name, by_round in runs.items()}, duties)
    text = [common.table(
        f"the executor ({args.model} model, {args.workload}, batch {args.batch}) beside busy Python, {args.rounds} "
        f"interleaved rounds, busy stretches within {args.period_ms:g} ms",
        ["busy work", "frames/s", "CPU-ms/frame (executor's process)", "of none (per round)"],
        [[name, v["frames_per_s"].text(), stats.spread(runs[name], "cpu_ms_per_frame").text(3), v["of_none"].text(2)]
         for name, v in result["variants"].items()],
        note="thread: shares the GIL and the cores; process: shares only the cores. CPU-ms/frame of the thread rows "
             "includes the busy thread's own CPU."),
        common.table("where the loss comes from (per round, share of the no-busy-work throughput)",
                     ["busy share", "the cores (process's loss)", "the GIL (thread's loss minus process's)"],
                     [[duty, d["cores_loss"].text(2), d["gil_loss"].text(2)]
                      for duty, d in result["duties"].items()])]
    common.write_json("contention", {
        "benchmark": "contention", "model": args.model, "workload": args.workload, "batch": args.batch,
        "rounds": args.rounds, "seconds": args.seconds, "duties": duties, "period_ms": args.period_ms, "runs": runs,
        "summary": result, "tables": text})
    return 0


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: what share of the runtime's throughput busy Python costs, by cause."""
    sp, rounds = stats.Spread.from_dict, stats.rounds(result["rounds"])
    rows = [(f"runtime beside busy Python as a {name} (share of its frames/s alone)", sp(v["of_none"]).text(2), rounds)
            for name, v in result["summary"]["variants"].items() if name != NONE]
    for i, (duty, d) in enumerate(result["summary"]["duties"].items()):
        bold = "**" if i == 0 else ""  # the first duty is the headline
        rows.append((f"busy {duty}: lost to the GIL / to the cores",
                     f"{bold}{sp(d['gil_loss']).text(2)}{bold} / {bold}{sp(d['cores_loss']).text(2)}{bold}", rounds))
    return rows


if __name__ == "__main__":
    sys.exit(main())
