"""The micro-batcher's own cost per frame, and its batches against a naive first-come batcher, in one run.

A mixed workload (8 common shapes plus a trickle of odd ones, 3 classes, skewed tenants) arrives on a fake clock;
every tick the caller adds that tick's frames, takes expired ones and drains the due batches. Only the batcher calls
are timed. The naive batcher fills batches in arrival order, pads each to its largest frame, and releases at
max_batch_size or when its oldest frame has waited its class's max_wait_ms.

    python bench/batcher.py --frames 100000 --rate 5000 [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats

from worker.batching import Batch, MicroBatcher
from worker.config import BatchingSettings
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.testing import FakeClock

# (height, width, channels): share of frames. Some are a few rows/columns apart, as encoders crop.
SHAPES = {
    (720, 1280, 3): 0.28, (704, 1280, 3): 0.08, (720, 1264, 3): 0.05, (480, 640, 3): 0.20,
    (464, 640, 3): 0.05, (360, 640, 3): 0.15, (1080, 1920, 3): 0.10, (480, 640, 1): 0.09,
}
CLASSES = {Priority.REALTIME: 0.2, Priority.STANDARD: 0.3, Priority.BULK: 0.5}
ODD_SHAPE_SHARE = 0.002
START = 1_700_000_000.0  # fake clock start, epoch seconds
DRAIN_TICKS = 200  # > the longest default max_wait_ms (bulk, 100 ms) in 1 ms ticks
BUCKETS = (1, 2, 4, 8, 16, 32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=100_000)
    p.add_argument("--rate", type=float, default=5_000.0, help="arrivals per second of fake time")
    p.add_argument("--tenants", type=int, default=20)
    p.add_argument("--tick-ms", type=float, default=1.0, help="how often the caller polls the batcher")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds per batcher (median (min-max))")
    args = p.parse_args(argv)
    # Pending caps out of the way: this measures batching policy, not backpressure.
    settings = dataclasses.replace(BatchingSettings(), max_pending_frames=10**7, max_pending_bytes=1 << 50)
    arrivals = workload(args.frames, args.rate, args.tenants, args.tick_ms / 1000.0, args.seed)
    gc.collect()
    gc.freeze()  # the workload is the bench's data, not batcher state: keep the GC from rescanning it
    makers = {"streamfer": lambda clock: MicroBatcher(settings, clock, BUCKETS),
              "naive": lambda clock: NaiveBatcher(settings, clock)}
    tallies = {name: Tally(settings) for name in makers}
    # Rounds alternate the batchers; the batches are the same every round (same workload), the timings vary.
    runs = stats.run_rounds(stats.interleaved(list(makers), args.repeat),
                            lambda name: one_pass(makers[name], arrivals, args.tick_ms / 1000.0, tallies[name]))
    rows = {name: tallies[name].summary(runs[name]) for name in makers}
    o, n = rows["streamfer"], rows["naive"]
    text = common.table(
        f"{args.frames} frames, {len(SHAPES)} shapes (+{ODD_SHAPE_SHARE:.1%} odd), 3 classes, {args.tenants} tenants, "
        f"{args.rate:g}/s on a fake clock, {args.tick_ms:g} ms ticks; us/frame: median (min-max) of {args.repeat} "
        "rounds", ["batcher", "us/frame", "add", "pop", "batches", "mean size", "waste", "mixed C", "> bytes",
                   *(f"{p.label[:4]} p99 ms" for p in Priority)],
        [[name, *(r[k].text() for k in ("us_per_frame", "add_us_per_frame", "pop_us_per_frame")), r["batches"],
          f"{r['mean_batch_size']:.2f}", f"{r['padding_waste']:.4f}", r["mixed_channel_batches"],
          r["batches_over_max_batch_bytes"], *(r["wait_ms"][p.label]["p99"] for p in Priority)]
         for name, r in rows.items()])
    common.write_json("batcher", {
        "benchmark": "batcher", "frames": args.frames, "rate_per_s": args.rate, "tenants": args.tenants,
        "tick_ms": args.tick_ms, "seed": args.seed, "rounds": args.repeat, "odd_shape_share": ODD_SHAPE_SHARE,
        "shapes": ["x".join(map(str, s)) for s in SHAPES],
        "settings": {"max_batch_size": settings.max_batch_size, "padding_waste_max": settings.padding_waste_max,
                     "max_batch_bytes": settings.max_batch_bytes, "buckets": list(BUCKETS)},
        "rows": rows, "tables": [text],
        "ratios": {"cost_vs_naive": stats.ratio_spread(stats.figure(runs["streamfer"], "us_per_frame"),
                                                       stats.figure(runs["naive"], "us_per_frame")),
                   "waste_vs_naive": o["padding_waste"] / n["padding_waste"] if n["padding_waste"] else None,
                   "batch_size_vs_naive": o["mean_batch_size"] / n["mean_batch_size"]}})
    return 0


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: the batcher's cost and batches against the naive one."""
    o, n, sp = result["rows"]["streamfer"], result["rows"]["naive"], stats.Spread.from_dict
    return [("micro-batcher cost, this one / naive (us per frame)",
             f"{sp(o['us_per_frame']).text()} / {sp(n['us_per_frame']).text()}", stats.rounds(result["rounds"])),
            ("padding waste, mean batch size: this one / naive",
             f"{o['padding_waste']:.3f} / {n['padding_waste']:.3f}, {o['mean_batch_size']:.1f} / "
             f"{n['mean_batch_size']:.1f}", "deterministic")]


class NaiveBatcher:
    """First come, first batched: one queue, batches padded to their largest frame (channels included)."""

    def __init__(self, settings: BatchingSettings, clock: FakeClock):
        self._s, self._clock, self._queue = settings, clock, deque()
        self._wait = {p: settings.for_class(p).max_wait_ms / 1000.0 for p in Priority}

    def add(self, frame: Frame) -> None:
        self._queue.append(frame)

    def pop_expired(self) -> list[Frame]:
        return []

    def pop_batch(self) -> Batch | None:
        q = self._queue
        head = q[0] if q else None
        if head is None or (len(q) < self._s.max_batch_size and head.received_at + self._wait[head.priority]
                            > self._clock.now):
            return None
        frames = tuple(q.popleft() for _ in range(min(len(q), self._s.max_batch_size)))
        shape = (max(f.height for f in frames), max(f.width for f in frames), max(f.channels for f in frames))
        padded = len(frames) * math.prod(shape)
        waste = (padded - sum(f.height * f.width * f.channels for f in frames)) / padded
        return Batch(frames, shape, head.priority, "naive", waste, self._clock.now, "naive")


def workload(count: int, rate: float, tenants: int, tick_s: float, seed: int) -> list[list[Frame]]:
    """Frames grouped by the tick they arrive in (Poisson arrivals), stamped with that tick's clock time."""
    rng = random.Random(seed)
    names = [f"tenant-{i:02d}" for i in range(tenants)]
    tenant_w = [1.0 / (i + 1) for i in range(tenants)]  # Zipf: the first tenant sends the most
    ticks: list[list[Frame]] = []
    t = 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        tick = int(t / tick_s)
        while len(ticks) <= tick:
            ticks.append([])
        if rng.random() < ODD_SHAPE_SHARE:
            shape = (rng.randrange(100, 1200), rng.randrange(100, 1900), 3)
        else:
            shape = rng.choices(list(SHAPES), list(SHAPES.values()))[0]
        prio = rng.choices(list(CLASSES), list(CLASSES.values()))[0]
        tenant, received = rng.choices(names, tenant_w)[0], START + tick * tick_s
        ticks[tick].append(Frame(
            stream_id=f"{tenant}/cam{i % 7}", frame_index=i, tenant=tenant, priority=prio,
            capture_ts_ms=int(received * 1000) - rng.randrange(0, 50), width=shape[1], height=shape[0],
            channels=shape[2], encoding=Encoding.RAW_RGB8, data=b"",
            source=SourceRef(f"frames.{prio.label}", i % 12, i), received_at=received))
    return ticks


class Tally:
    """Batch statistics, accumulated as batches come out (so the bench holds no batches for the GC to scan)."""

    def __init__(self, settings: BatchingSettings):
        self.settings = settings
        self.batches = self.frames = self.mixed_channels = self.over_bytes = self.padded_px = self.real_px = 0
        self.lanes: dict[str, int] = {}
        self.waits_ms: dict[Priority, list[float]] = {p: [] for p in Priority}

    def count(self, b: Batch) -> None:
        s = self.settings
        self.batches, self.frames = self.batches + 1, self.frames + b.size
        self.lanes[b.lane] = self.lanes.get(b.lane, 0) + 1
        self.padded_px += b.size * math.prod(b.shape)
        for f in b.frames:
            self.real_px += f.height * f.width * f.channels
            self.waits_ms[f.priority].append((b.released_at - f.received_at) * 1000.0)
        self.mixed_channels += len({f.channels for f in b.frames}) > 1
        self.over_bytes += b.size > 1 and b.size * math.prod(b.shape) * s.tensor_dtype_bytes > s.max_batch_bytes

    def summary(self, runs: dict[int, dict[str, float]]) -> dict[str, Any]:
        waits = {p: sorted(w) for p, w in self.waits_ms.items()}
        return {
            **{k: stats.spread(runs, k) for k in ("us_per_frame", "add_us_per_frame", "pop_us_per_frame")},
            "pop_calls": runs[1]["pop_calls"], "expired": runs[1]["expired"], "batches": self.batches,
            "mean_batch_size": self.frames / self.batches, "lanes": self.lanes,
            "padding_waste": (self.padded_px - self.real_px) / self.padded_px,
            "mixed_channel_batches": self.mixed_channels, "batches_over_max_batch_bytes": self.over_bytes,
            "wait_ms": {p.label: {"p50": stats.percentile(waits[p], 0.5), "p99": stats.percentile(waits[p], 0.99),
                                  "max": max(waits[p], default=0.0)} for p in Priority}}


def one_pass(make_batcher: Any, ticks: list[list[Frame]], tick_s: float, tally: Tally) -> dict[str, float]:
    """One pass of the workload through a batcher; the timings (the batches are tallied on the first pass)."""
    clock, first, perf = FakeClock(START), tally.batches == 0, time.perf_counter
    batcher = make_batcher(clock)
    add_s = pop_s = 0.0
    pops = expired = 0
    out: list[Batch] = []
    # Then idle ticks (no arrivals) until the longest class wait has passed, so every frame comes out.
    for i, arrivals in enumerate(ticks + [[] for _ in range(DRAIN_TICKS)]):
        clock.now = START + i * tick_s
        t0 = perf()
        for f in arrivals:
            batcher.add(f)
        t1 = perf()
        expired += len(batcher.pop_expired())
        while (b := batcher.pop_batch()) is not None:
            out.append(b)
        t2 = perf()
        add_s, pop_s, pops = add_s + t1 - t0, pop_s + t2 - t1, pops + len(out) + 1
        for b in out if first else ():
            tally.count(b)
        out.clear()
    frames = sum(len(t) for t in ticks)
    assert not first or tally.frames + expired == frames, "frames lost or duplicated"
    return {"us_per_frame": (add_s + pop_s) / frames * 1e6, "add_us_per_frame": add_s / frames * 1e6,
            "pop_us_per_frame": pop_s / frames * 1e6, "pop_calls": pops, "expired": expired}


if __name__ == "__main__":
    raise SystemExit(main())
