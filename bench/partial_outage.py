"""A partial Kafka outage on the in-memory kit (issue 67): what the worker holds, and which streams it still
answers, while a results partition acknowledges nothing for a long time.

The worker loop as it runs (`build_pipeline`: FrameSource, flow control, batcher, delivery, offsets) over the test
kit's Kafka with a fake clock and an instant runtime. Open loop: `--streams` streams (default 24) spread over 6
input partitions of the standard class at `--fps` frames/s in all (default 40), capture time = send time. For
`--outage` simulated seconds (default 600) the outputs of `--stalled` streams (default 9: those of two results
partitions of six) are produced and never acknowledged; then they are, and the run goes on 60 s. Each tree runs in
its own process; `--base` runs another tree (a checkout of main) the same way.

Every `--every` simulated seconds (default 60): frames not yet answered (the tracker's in flight), done offsets
held behind a commit point, offsets uncommitted, outputs awaiting an acknowledgement, the process's RSS and its
Python heap (tracemalloc), and the healthy streams' answers and p99 from capture since the last sample. At the end:
lost and duplicated frames.

    python bench/partial_outage.py --base /tmp/base67              # this tree and main, 10 minutes simulated
    python bench/partial_outage.py --outage 120 --fps 200            # this tree only, a shorter, faster run
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PARTITIONS = 6
TICK_S = 0.01
AFTER_S = 60.0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def one_round(streams: int, stalled: int, fps: float, outage: float, max_uncommitted: int,
              every: float) -> dict[str, Any]:
    from worker.codec.schemas import FrameRecord, decode_result, encode_frame
    from worker.config import DeliverySettings, ObservabilitySettings, Settings
    from worker.frames import Encoding, Priority
    from worker.loop.pipeline import build_pipeline
    from worker.metrics import Health, Metrics
    from worker.testing import FakeClock, FakeExecutor, InMemoryKafka

    tracemalloc.start()
    settings = Settings(delivery=DeliverySettings(max_uncommitted_frames=max_uncommitted),
                        observability=ObservabilitySettings(worker_id="outage-0", metrics_enabled=False))
    topic = settings.topics.standard
    clock, kafka = FakeClock(), InMemoryKafka()
    for p in range(PARTITIONS):
        kafka.send((topic, p))
    pipeline = build_pipeline(settings, FakeExecutor(), Metrics(), Health(), clock, clients=kafka.clients)
    stalled_keys = {f"cam-{i}".encode() for i in range(stalled)}
    down = {"yes": True}

    def hold_stalled(producer: Any) -> None:
        """The stalled streams' results partitions are down: their delivery reports wait (on either tree's kit)."""
        original = producer.poll

        def poll(timeout: float = 0.0) -> int:
            if not down["yes"]:
                return original(timeout)
            keep = [r for r in producer.pending_reports if r[1].key in stalled_keys]
            producer.pending_reports = [r for r in producer.pending_reports if r[1].key not in stalled_keys]
            served = original(timeout)
            producer.pending_reports = keep + producer.pending_reports
            return served

        producer.poll = poll

    start = clock()
    end_outage, end = start + outage, start + outage + AFTER_S
    sent = 0
    sent_at: dict[tuple[str, int], float] = {}
    seen = 0
    answered: Counter[tuple[str, int]] = Counter()
    minute: dict[str, Any] = {"healthy_answered": 0, "latency": []}
    samples: list[dict[str, Any]] = []
    next_sample = start + every
    tracker = pipeline.tracker

    def sample(now: float) -> None:
        delivery = pipeline.delivery
        samples.append({
            "t_s": round(now - start), "in_flight": tracker.in_flight(),
            "done_beyond": tracker.done_beyond() if hasattr(tracker, "done_beyond") else None,
            "uncommitted": tracker.uncommitted(),
            "awaiting_ack": len(getattr(delivery, "_awaiting_ack", {})),
            "paused_partitions": pipeline.source.paused_partitions,
            "rss_mib": round(rss_mib(), 1), "py_heap_mib": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
            "healthy_answered": minute["healthy_answered"],
            "healthy_p99_s": p99(minute["latency"])})
        minute["healthy_answered"], minute["latency"] = 0, []

    def turn() -> bool:
        nonlocal sent, seen, next_sample
        if kafka.producers and not hasattr(kafka.producers[0], "_held_by_bench"):
            kafka.producers[0]._held_by_bench = True  # type: ignore[attr-defined]
            hold_stalled(kafka.producers[0])
        now = clock()
        if kafka.producers:
            visible = kafka.producers[0].visible
            for produced in visible[seen:]:
                if produced.topic != settings.topics.results:
                    continue
                r = decode_result(produced.value)
                key = (r["stream_id"], r["frame_index"])
                answered[key] += 1
                if produced.key not in stalled_keys and answered[key] == 1:
                    minute["healthy_answered"] += 1
                    minute["latency"].append(now - sent_at[key])
            seen = len(visible)
        if now >= next_sample:
            sample(now)
            next_sample += every
        clock.advance(TICK_S)
        now = clock()
        if now >= end_outage:
            down["yes"] = False
        if now < end_outage:
            while sent < (now - start) * fps:
                stream = sent % streams
                index = sent // streams
                kafka.send((topic, stream % PARTITIONS), encode_frame(FrameRecord(
                    stream_id=f"cam-{stream}", frame_index=index, capture_ts_ms=int(now * 1000), tenant="t",
                    priority=Priority.STANDARD, width=8, height=8, channels=3, encoding=Encoding.RAW_RGB8,
                    data=bytes(8 * 8 * 3))))
                sent_at[(f"cam-{stream}", index)] = now
                sent += 1
        return now >= end

    pipeline.run(should_stop=turn)
    sample(clock())
    expected = set(sent_at)
    return {"samples": samples, "sent": sent, "lost": len(expected - set(answered)),
            "duplicated": sum(n - 1 for n in answered.values() if n > 1),
            "stalled_streams": stalled, "streams": streams}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--stalled", type=int, default=9)
    parser.add_argument("--fps", type=float, default=40.0)
    parser.add_argument("--outage", type=float, default=600.0, help="simulated seconds the results partition is away")
    parser.add_argument("--max-uncommitted", type=int, default=1500, help="delivery.max_uncommitted_frames")
    parser.add_argument("--every", type=float, default=60.0, help="simulated seconds between samples")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "partial_outage.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    spec = {"streams": args.streams, "stalled": args.stalled, "fps": args.fps, "outage": args.outage,
            "max_uncommitted": args.max_uncommitted, "every": args.every}
    if args.child:
        print(json.dumps(one_round(**json.loads(args.child))))
        return 0
    sys.path.insert(0, str(HERE))
    import common

    trees = {"this": HERE.parent, **({"base": args.base.resolve()} if args.base else {})}
    runs = {name: common.run_child(__file__, spec, tree, timeout_s=3600) for name, tree in trees.items()}
    headers = ["tree", "t (s)", "not answered", "done held", "uncommitted", "awaiting ack", "paused parts",
               "RSS MiB", "py heap MiB", "healthy answered", "healthy p99 (s)"]
    rows = [[name, s["t_s"], s["in_flight"], "-" if s["done_beyond"] is None else s["done_beyond"], s["uncommitted"],
             s["awaiting_ack"], s["paused_partitions"], s["rss_mib"], s["py_heap_mib"], s["healthy_answered"],
             "-" if s["healthy_p99_s"] is None else f"{s['healthy_p99_s']:.2f}"]
            for name, run in runs.items() for s in run["samples"]]
    note = "; ".join(f"{name}: {run['sent']} sent, lost {run['lost']}, duplicated {run['duplicated']}"
                     for name, run in runs.items())
    text = common.table(f"partial outage: {args.stalled} of {args.streams} streams' results unacknowledged for "
                        f"{args.outage:.0f} s simulated at {args.fps:g} frames/s, max_uncommitted_frames "
                        f"{args.max_uncommitted}, then {AFTER_S:.0f} s acknowledged", headers, rows, note=note)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "partial_outage", **spec, "trees": {k: str(v) for k, v in
                                    trees.items()}, "runs": runs, "table": text}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
