"""Scaling: saturated throughput of one consumer group with 1, 2 and 3 worker processes (one torch thread each), on
the same pre-published backlog (9 input partitions), in interleaved rounds.

The processes start on empty topics; once the group is stable with every process assigned (so each has loaded and
warmed its model), they are stopped (SIGSTOP), the backlog is published, and they are released together (SIGCONT):
a start-up barrier, so no process drains the backlog alone while the others import torch. Frames/s are counted
while every process was producing results (from the last process's first result to the first process's last).

    python bench/scaling.py [--quick]
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from common import Context

from worker.testing import FrameProducer, end_offsets, wait_committed

PROCESSES = (1, 2, 3)
EXPECTATION = ("{cores} cores shared by the broker and the workers (the bench process only waits): each worker needs "
               "about one core for inference plus its preprocessing and Kafka threads, so on this machine 2 processes "
               "can gain at most what the second core has left after the broker (well under 2x), and a 3rd process "
               "only adds contention (expect it flat or slower than 2).")


def wait_group_stable(bootstrap: str, group: str, members: int, timeout_s: float) -> bool:
    """True once the group is STABLE with `members` members, each holding partitions."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    admin, deadline = AdminClient({"bootstrap.servers": bootstrap}), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            desc = admin.describe_consumer_groups([group])[group].result(10)
            if (desc.state == ConsumerGroupState.STABLE and len(desc.members) == members
                    and all(m.assignment and m.assignment.topic_partitions for m in desc.members)):
                return True
        except Exception:  # noqa: BLE001 (group not there yet)
            pass
        time.sleep(0.3)
    return False


def scaling_run(ctx: Context, n: int, frames: int) -> dict[str, Any]:
    topics = common.topics(ctx.bootstrap, f"sc{n}")
    procs = [common.start_worker(ctx, topics, f"sc{n}p{i}", threads=1) for i in range(n)]

    def logs() -> str:
        return "\n".join(p.log()[-3000:] for p in procs)

    try:
        if not wait_group_stable(ctx.bootstrap, topics.group, n, 180):
            raise RuntimeError(f"{n} workers did not form a stable group\n{logs()}")
        for p in procs:
            p.process.send_signal(signal.SIGSTOP)
        try:
            load = common.publish(FrameProducer(ctx.bootstrap, topics), ctx.records(frames, common.new_id("sc")))
        finally:
            for p in procs:
                p.process.send_signal(signal.SIGCONT)
        watch = common.CpuWatch(ctx.broker, [p.process.pid for p in procs])
        done = wait_committed(ctx.bootstrap, topics.group, end_offsets(ctx.bootstrap, topics.inputs), 300,
                              alive=lambda: all(p.alive() for p in procs))
        cpu = watch.stop()
    finally:
        for p in procs:
            p.stop()
    if not done:
        raise RuntimeError(f"{n} workers did not finish the backlog\n{logs()}")
    results = common.ResultsReader(ctx.bootstrap, topics).read_all(idle_timeout_s=1.0)
    tp = common.all_active_throughput(results)
    print(f"[scaling] {n} process(es): {tp['frames_per_s']:.0f} frames/s over {tp['window_s']:.1f}s with all active; "
          f"background load {cpu['background_cores']:.2f} cores", flush=True)
    return {"processes": n, **tp, "results": len(results), "publish": load, "cores_used_by_workers": cpu["ours_cores"],
            "broker_cores": cpu["broker_cores"], "background_cores": cpu["background_cores"],
            "mean_batch": common.batch_sizes(results)["mean_frame_weighted"]}


def run(ctx: Context) -> dict[str, Any]:
    frames, rounds = 5000, ctx.round_count(2, 1)  # quick too: at 3000, 3 processes overlapped for 0.1 s
    print(f"\n[scaling] 1, 2, 3 processes on a backlog of {frames} frames each, {rounds} interleaved round(s)",
          flush=True)
    trials = stats.run_rounds(stats.interleaved([str(n) for n in PROCESSES], rounds),
                              lambda n: scaling_run(ctx, int(n), frames))
    fps = {n: stats.figure(trials[str(n)], "frames_per_s") for n in PROCESSES}
    spread = {n: stats.Spread.of(list(fps[n].values())) for n in PROCESSES}
    speedup = {n: stats.ratio_spread(fps[n], fps[PROCESSES[0]]) for n in PROCESSES}
    last = {n: trials[str(n)][max(trials[str(n)])] for n in PROCESSES}
    expectation = EXPECTATION.format(cores=os.cpu_count() or 1)
    text = common.table(
        "scaling: worker processes in one group, 1 torch thread each, saturated (frames/s while all were active; "
        f"median (min-max) of {rounds} interleaved round(s); per-process columns from the last round)",
        ["processes", "frames/s", "vs 1 (per-round ratios)", "rounds", "window s", "results per process",
         "mean batch", "worker cores", "broker cores", "bg cores"],
        [[n, spread[n].text(), speedup[n].text(2), " ".join(f"{v:.0f}" for v in fps[n].values()),
          r.get("window_s", "n/a"), " ".join(str(v) for v in r.get("per_worker_results", {}).values()),
          *(r.get(k, "n/a") for k in ("mean_batch", "cores_used_by_workers", "broker_cores", "background_cores"))]
         for n, r in last.items()],
        note=f"Expectation: {expectation}" + "".join(f"\nFAILED {f}" for f in stats.failures(trials)))
    result = {"benchmark": "scaling", "workload": ctx.workload.describe(), "model": ctx.model,
              "backlog_frames": frames, "rounds": rounds, "trials": trials, "expectation": expectation,
              "frames_per_s": {n: s.as_dict() for n, s in spread.items()},
              "speedup": {n: s.as_dict() for n, s in speedup.items()}, "tables": [text]}
    common.write_json("scaling", result)
    return result


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: (figure, median (min-max), rounds)."""
    sp = stats.Spread.from_dict
    cells = "; ".join(f"{n}: {sp(f).text(suffix=' frames/s')}, **{sp(result['speedup'][n]).text(2, 'x')}**"
                      for n, f in result["frames_per_s"].items() if str(n) != "1")
    return [("2, 3 worker processes (1 torch thread each): frames/s and x one process", cells,
             stats.rounds(result["rounds"]))]


if __name__ == "__main__":
    raise SystemExit(common.standalone(run, None, __doc__.splitlines()[0]))
