"""The host's share of each frame (issue 47): what caps one worker process, by thread role.

A backlog of 224x224 JPEG frames (the jpeg224 workload: the kit's synthetic frames, standard priority) through the
worker's real loop (`worker.loop.pipeline.build_pipeline`: FrameSource, MicroBatcher, InferenceExecutor, delivery,
ResultSink, OffsetTracker), on the real broker with librdkafka's clients (`--kafka broker`, the default when
KAFKA_BOOTSTRAP_SERVERS is set) or over the kit's in-memory fakes (`--kafka fakes`: no broker, no librdkafka
threads). Variants, each round a fresh process per tree and variant, interleaved:

- `device`: the device data path (runtime.decode = device) with the device's work stood in: the real
  `DevicePreprocessor` does every host step (the CPU path's checks and JPEG structure walk, the staging copy, the
  batch's bookkeeping) on the `meta` device, where a tensor has a shape and no memory; its decode and resize are
  stood in (`DeviceSteps` of its own: one shared tensor of the frame's shape, whole regions) and the runner
  returns zero scores (`StandInRunner`). Pixels are never decoded or read. Left out: the CUDA calls' own host cost
  (kernel launches, nvJPEG's host-side work, the scores' copy back), which the GPU check's e2e_device section
  measures where a GPU is lent. (torch ops on `meta` tensors run Python reference code, far costlier than a CUDA
  launch: that is why the decode and resize are stood in rather than run on `meta`.)
- `cpu`: the CPU data path as the worker starts it (`start_runtime`), the near-zero model (`--cpu-model null`, a
  slice of its input) or the builtin CNN (`toy`).

Per variant: CPU-ms per frame by thread role (worker.threadnames names them: loop, preprocess, decode, infer;
librdkafka's rdk:*; other), the lock-holding share (every thread but librdkafka's, which run no Python) and the
ceiling it implies for one process, 1000 / lock-holding CPU-ms per frame (frames/s); frames/s achieved. With
`--base TREE` (a checkout holding worker/ and schemas/, e.g. `git archive main worker schemas | tar -x -C /tmp/b`)
every variant runs on both trees in the same rounds, and per-round ratios this/base are printed.

    python bench/host_cost.py                          # broker when KAFKA_BOOTSTRAP_SERVERS is set, else fakes
    python bench/host_cost.py --kafka fakes --rounds 5 --frames 8000
    python bench/host_cost.py --base /tmp/base --variants device
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("device", "cpu")
SHAPE = (224, 224, 3)
PARTITIONS = 3  # per input topic, as the kit's topics
# Thread roles, in table order: the worker's threads (worker.threadnames), librdkafka's, the rest.
ROLES = ("loop", "preprocess", "decode", "inference", "librdkafka", "other")
NO_LOCK_ROLES = ("librdkafka",)  # threads that run no Python: they never hold the interpreter lock


def ceiling_fps(lock_cpu_ms_per_frame: float) -> float:
    """Frames/s one process cannot exceed when its threads hold the interpreter lock this long per frame; infinite
    when /proc's clock ticks (10 ms) saw none, as on a short run."""
    return 1000.0 / lock_cpu_ms_per_frame if lock_cpu_ms_per_frame else float("inf")


def role_of(thread_role: str) -> str:
    """bench/common.thread_role's name -> this benchmark's role."""
    if thread_role.startswith("rdk:"):
        return "librdkafka"
    if thread_role.startswith("infer"):
        return "inference"
    return thread_role if thread_role in ("loop", "preprocess", "decode") else "other"


# -- the child: one round of one variant on one tree ---------------------------------------------------------------
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process against the round's tree (common.run_child puts it on sys.path): imports its
    `worker` before bench/common would put this repository's first."""
    import worker  # noqa: F401 (the round's tree, whatever is inserted later)

    # isort: split
    import common
    import gpu_e2e
    from workloads import WORKLOADS, model_settings

    from worker.app import freeze_startup_heap
    from worker.config import load_settings

    frames = spec["frames"]
    env = {**common.NO_EXPIRY, "WORKER_RUNTIME_TORCH_THREADS": "1"}
    if spec["kafka"] == "broker":
        env.update(spec["topics_env"])
        env["WORKER_KAFKA_BOOTSTRAP_SERVERS"] = spec["bootstrap"]
    model = "null" if spec["variant"] == "device" else spec["cpu_model"]
    settings = load_settings(env=env, overrides={
        "model": {**model_settings(model, WORKLOADS["jpeg224"]),
                  **({"source": "nullmodel:null_model"} if model == "null" else {})},
        "runtime": {"device": "cpu", "warmup_shapes": ["224x224"], "decode": "cpu"},
        "observability": {"worker_id": f"host-cost-{spec['variant']}"}})
    if spec["variant"] == "device":
        executor, costs = stand_in_executor(settings)
        freeze_startup_heap()  # as the worker does after its start (gpu_e2e.start_executor does it for the CPU path)
    else:
        executor, costs = gpu_e2e.start_executor(settings, freeze_heap=True)
    try:
        if spec["kafka"] == "fakes":
            records = common.workload_records(frames, common.new_id("hc"), WORKLOADS["jpeg224"])
            messages = fake_backlog(settings, records, gpu_e2e)
            run = gpu_e2e.run_loop(settings, executor, messages, costs, deadline_s=600.0)
            answered, wall, cpu = len(run.results), run.wall_s, run.thread_cpu_s
            faults = gpu_e2e.ledger_faults(gpu_e2e.ledger(run, settings))
            mean_batch = run.summary.mean_batch_size
        else:
            answered, wall, cpu, mean_batch = broker_run(settings, executor, costs, frames, common)
            faults = [] if answered == frames else [f"{answered} of {frames} answered"]
    finally:
        executor.close()
    by_role: dict[str, float] = dict.fromkeys(ROLES, 0.0)
    for thread_role, seconds in cpu.items():
        by_role[role_of(thread_role)] += seconds
    per_frame = {role: 1000.0 * s / max(1, answered) for role, s in by_role.items()}
    lock = sum(v for k, v in per_frame.items() if k not in NO_LOCK_ROLES)
    return {"answered": answered, "wall_s": wall, "frames_per_s": answered / wall if wall else 0.0,
            "mean_batch": mean_batch, "cpu_ms_per_frame": per_frame, "total_cpu_ms_per_frame": sum(per_frame.values()),
            "lock_cpu_ms_per_frame": lock, "ceiling_fps": ceiling_fps(lock),
            "threads_cpu_s": cpu, "faults": faults}


def stand_in_executor(settings: Any) -> tuple[Any, list[Any]]:
    """An InferenceExecutor on the device data path whose device is stood in (module docstring), warmed up and
    calibrated as `start_runtime` does."""
    import numpy as np
    import torch

    from worker.config import preprocess_thread_count, warmup_frame_shapes
    from worker.runtime.devicepath import DeviceSteps
    from worker.runtime.executor import InferenceExecutor
    from worker.runtime.models import load_model
    from worker.runtime.runners import RunResult

    contract = load_model(settings.model, "cpu").contract
    meta = torch.device("meta")
    decoded = torch.empty((contract.channels, SHAPE[0], SHAPE[1]), dtype=torch.uint8, device=meta)

    def stand_in_decode(data: list[torch.Tensor], mode: Any, device: torch.device) -> list[torch.Tensor]:
        """No decode: each frame is one shared `meta` tensor of its shape (the real preprocessor checks, stages and
        cuts the JPEGs' views as on a GPU)."""
        return [decoded] * len(data)

    def stand_in_fit(images: torch.Tensor, contract: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """No resize: the frames are the model input's size, so every row's region is whole."""
        if tuple(images.shape[2:]) != contract.input_size:
            raise ValueError("the stand-in fits only frames of the model input's size")
        return images, (0, 0)

    class StandInRunner:
        """A runner's interface (EagerRunner's) with the model stood in: zero scores, the input never read."""

        uses_graphs = False
        capture_count = 0
        graph_evictions = 0
        copy_stream = None

        def __init__(self) -> None:
            self.device = meta
            self.contract = contract

        def warm_up(self, shape: Any, batches: int, batch_size: int) -> None:
            pass

        def run(self, pixels: torch.Tensor, ready: Any = None, regions: Any = None) -> Any:
            n = int(pixels.shape[0])
            return RunResult(np.zeros((n, len(contract.labels)), dtype=np.float32), n, False)

    executor = InferenceExecutor([StandInRunner()], contract, preprocess_thread_count(settings.runtime),  # type: ignore[list-item]
                                 settings.runtime.warmup_batches, decode_on_device=True,
                                 device_steps=DeviceSteps(decode=stand_in_decode, fit=stand_in_fit),
                                 device_description="stand-in device (meta)")
    shapes = warmup_frame_shapes(settings)
    executor.warm_up(shapes)
    return executor, executor.calibrate(shapes, settings.batching.largest_batch_size)


def fake_backlog(settings: Any, records: Sequence[Any], gpu_e2e: Any) -> list[Any]:
    """The records as a backlog on the fakes: all readable at once, each stream on one partition of its topic."""
    from worker.codec.schemas import encode_frame

    streams = sorted({r.stream_id for r in records})
    now = time.time()
    return [gpu_e2e.Message(now, (gpu_e2e.topic_of(settings, r.priority), streams.index(r.stream_id) % PARTITIONS),
                            encode_frame(r), r.priority) for r in records]


def broker_run(settings: Any, executor: Any, costs: list[Any], total: int,
               common: Any) -> tuple[int, float, dict[str, float], float]:
    """The worker's loop with librdkafka's clients on the published backlog (a fresh group) until every frame is
    answered; its thread CPU over that time (group join included, the final drain and close not), by role."""
    from worker.loop.pipeline import build_pipeline
    from worker.metrics import Health, Metrics

    pipeline = build_pipeline(settings, executor, Metrics(settings=settings), Health())
    pipeline.seed_costs(costs)

    def answered() -> int:
        return pipeline.delivery.results + pipeline.delivery.dead_lettered

    run = common.run_pipeline_thread(pipeline, lambda: answered() >= total)
    return answered(), run.wall_s, run.thread_cpu_s, run.summary.mean_batch_size


# -- the parent: rounds, table, JSON -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--kafka", choices=("broker", "fakes"),
                        default="broker" if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") else "fakes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="device,cpu")
    parser.add_argument("--cpu-model", choices=("null", "toy"), default="null")
    parser.add_argument("--frames", type=int, default=6000, help="the backlog, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", type=Path, help="another source tree (holding worker/ and schemas/), run as 'base'")
    parser.add_argument("--out", default="host_cost", help="the JSON's name under bench/results/")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child)), default=str))
        return {}

    sys.path.insert(0, str(HERE))
    import common
    import stats

    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    trees = {"this": str(common.REPO), **({"base": str(args.base.resolve())} if args.base else {})}
    keys = [f"{tree}/{v}" for v in variants for tree in trees]
    base_spec: dict[str, Any] = {"kafka": args.kafka, "frames": args.frames, "cpu_model": args.cpu_model}
    published: dict[str, Any] = {}
    bootstrap = ""
    if args.kafka == "broker":
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
        if not bootstrap:
            parser.error("--kafka broker needs KAFKA_BOOTSTRAP_SERVERS (or use --kafka fakes)")
        from workloads import WORKLOADS

        inputs = common.topics(bootstrap, "hc")
        t = time.monotonic()
        published = common.publish(common.FrameProducer(bootstrap, inputs),
                                   common.workload_records(args.frames, common.new_id("hc"), WORKLOADS["jpeg224"]))
        print(f"[host_cost] published {args.frames} frames in {time.monotonic() - t:.1f}s", flush=True)
    runs: dict[str, dict[int, dict[str, Any]]] = {k: {} for k in keys}
    for rnd, key in stats.rotating(keys, args.rounds):
        tree, variant = key.split("/")
        spec = {**base_spec, "tree": trees[tree], "variant": variant}
        if args.kafka == "broker":
            spec.update(bootstrap=bootstrap, topics_env=common.topics(bootstrap, "hc", inputs_of=inputs).env())
        cpu0 = common.machine_cpu_seconds()
        try:
            result = common.run_child(__file__, spec, Path(spec["tree"]), timeout_s=900)
        except RuntimeError as exc:  # a failed round is reported with the others
            result = {"error": str(exc)[-1500:]}
        cpu1 = common.machine_cpu_seconds()
        result["machine_cpu_s"] = [b - a for a, b in zip(cpu0, cpu1)]
        runs[key][rnd] = result
        lock = result.get("lock_cpu_ms_per_frame", float("nan"))
        print(f"[host_cost] round {rnd} {key}: " + (result["error"] if "error" in result else
              f"{lock:.3f} lock-holding CPU-ms/frame, {result['total_cpu_ms_per_frame']:.3f} in all, "
              f"{result['frames_per_s']:.0f} frames/s, faults {result['faults'] or 'none'}"), flush=True)

    def spread(key: str, pick: Any) -> stats.Spread:
        return stats.Spread.of([pick(r) for r in runs[key].values() if "error" not in r])

    rows = []
    for key in keys:
        rows.append([key, spread(key, lambda r: r["lock_cpu_ms_per_frame"]).text(3),
                     spread(key, lambda r: r["ceiling_fps"]).text(0),
                     *(spread(key, lambda r, role=role: r["cpu_ms_per_frame"][role]).text(3) for role in ROLES),
                     spread(key, lambda r: r["total_cpu_ms_per_frame"]).text(3),
                     spread(key, lambda r: r["frames_per_s"]).text(0), spread(key, lambda r: r["mean_batch"]).text(1)])
    kafka_label = "librdkafka on " + bootstrap if args.kafka == "broker" else "the kit's in-memory fakes"
    common.table(
        f"Host CPU per frame, 224x224 JPEG backlog of {args.frames}, Kafka: {kafka_label} "
        f"(median (min-max) over {args.rounds} interleaved rounds)",
        ["tree/variant", "lock CPU-ms/frame", "ceiling frames/s", *(f"{r} ms" for r in ROLES), "all ms",
         "frames/s", "mean batch"], rows,
        note="lock = every thread but librdkafka's (they run no Python): an upper bound where C code lets the lock go "
             "(the CPU path's decode and torch kernels); ceiling = 1000 / lock (one process). "
             f"device = the device data path, device stood in; cpu = the CPU data path, model {args.cpu_model}.")
    ratios = {}
    if args.base:
        for v in variants:
            this = {r: x["lock_cpu_ms_per_frame"] for r, x in runs[f"this/{v}"].items() if "error" not in x}
            base = {r: x["lock_cpu_ms_per_frame"] for r, x in runs[f"base/{v}"].items() if "error" not in x}
            ratios[v] = stats.ratio_spread(this, base)
        common.table("Lock-holding CPU-ms per frame, this tree / base (per-round ratios)", ["variant", "this/base"],
                     [[v, s.text(3)] for v, s in ratios.items()])
    failed = [f"round {r} {k}: {x['error'] or x['faults']}" for k, by in runs.items() for r, x in by.items()
              if "error" in x or x.get("faults")]
    for line in failed:
        print(stats.failure_line(line))
    data = {"context": common.machine(), "kafka": args.kafka, "bootstrap": bootstrap, "frames": args.frames,
            "rounds": args.rounds, "cpu_model": args.cpu_model, "trees": trees, "published": published,
            "runs": runs, "ratios_this_over_base": {v: s.as_dict() for v, s in ratios.items()}, "failed": failed}
    path = common.write_json(args.out, data)
    print(f"[host_cost] wrote {path}")
    return data


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: this tree's lock-holding CPU-ms per frame and its ceiling, per variant."""
    import stats

    rows = []
    for key, runs in result["runs"].items():
        tree, variant = key.split("/")
        if tree != "this":
            continue
        ok = {r: x for r, x in runs.items() if "error" not in x}
        lock, ceiling = (stats.spread(ok, k) for k in ("lock_cpu_ms_per_frame", "ceiling_fps"))
        what = "device path, device stood in" if variant == "device" else f"CPU path, model {result['cpu_model']}"
        rows.append((f"host CPU-ms/frame (lock-holding), 224x224 JPEG backlog, {what}, Kafka {result['kafka']}",
                     f"**{lock.text(3)}** (ceiling {ceiling.text(0)} frames/s per process)",
                     stats.rounds(result["rounds"])))
    return rows


if __name__ == "__main__":
    main()
