"""Eager vs CUDA-graph latency and throughput of the model runner, per batch size, in one run.

Times `runner.run(x)` on an input already on the device (model + activation + copy of the scores to the
host), so it measures what the graphs change: launch overhead. On a machine without CUDA only the eager
column is measured (and the output says so). Prints a table and writes JSON.

    python bench/gpu_runtime.py --shape 224x224 --iters 200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.config import ModelSettings
from worker.runtime.models import load_model
from worker.runtime.runners import CudaGraphRunner, EagerRunner

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_runtime.json"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    h, w = args.shape
    shape = (h, w, 3)  # the runner's input: uint8 NHWC pixels, normalised on the device
    settings = ModelSettings(source=args.model)
    loaded = load_model(settings, device)
    eager = EagerRunner(loaded.module, loaded.contract, device, args.precision)
    graphs = None
    if device.type == "cuda":
        graphs = CudaGraphRunner(loaded.module, loaded.contract, device, args.precision, buckets=args.batch_sizes,
                                 warmup_batches=args.warmup)
        t0 = time.perf_counter()
        graphs.warm_up(shape, args.warmup)
        capture_s = time.perf_counter() - t0
    else:
        capture_s = 0.0
        print(f"no CUDA device: measuring the eager column only, on {device}", flush=True)

    rows = []
    print(_header(graphs is not None), flush=True)
    for n in args.batch_sizes:
        x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(n)).to(device)
        row = {"batch_size": n, "eager": _measure(eager, x, args.warmup, args.iters)}
        if graphs is not None:
            row["graph"] = _measure(graphs, x, args.warmup, args.iters)
            row["graph_speedup"] = row["eager"]["median_ms"] / row["graph"]["median_ms"]
        rows.append(row)
        print(_format_row(row), flush=True)

    result = {
        "benchmark": "gpu_runtime",
        "device": _device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": f"{settings.source} ({loaded.kind})",
        "precision": args.precision,
        "shape_hw": [h, w],
        "iters": args.iters,
        "warmup_iters": args.warmup,
        "graphs_measured": graphs is not None,
        "graph_captures": graphs.capture_count if graphs is not None else 0,
        "graph_capture_s": capture_s,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


def _measure(runner: EagerRunner, x: torch.Tensor, warmup: int, iters: int) -> dict[str, float]:
    for _ in range(warmup):
        runner.run(x)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.run(x)  # returns after the scores reached the host, so the GPU work is included
        times.append((time.perf_counter() - t0) * 1000.0)
    times.sort()
    median = statistics.median(times)
    return {
        "median_ms": median,
        "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
        "frames_per_s": x.shape[0] / (median / 1000.0),
    }


def _header(with_graphs: bool) -> str:
    cols = f"{'batch':>5} | {'eager med ms':>12} {'p90 ms':>8} {'frames/s':>10}"
    if with_graphs:
        cols += f" | {'graph med ms':>12} {'p90 ms':>8} {'frames/s':>10} | {'speedup':>7}"
    return cols + "\n" + "-" * len(cols)


def _format_row(row: dict) -> str:
    e = row["eager"]
    line = f"{row['batch_size']:>5} | {e['median_ms']:>12.3f} {e['p90_ms']:>8.3f} {e['frames_per_s']:>10.0f}"
    if "graph" in row:
        g = row["graph"]
        line += (f" | {g['median_ms']:>12.3f} {g['p90_ms']:>8.3f} {g['frames_per_s']:>10.0f}"
                 f" | {row['graph_speedup']:>6.2f}x")
    return line


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=_hw, default=(224, 224), help="frame HxW, e.g. 224x224")
    p.add_argument("--iters", type=int, default=200, help="timed iterations per batch size and column")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations first (and warm-up before capture)")
    p.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")],
                   default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--torch-threads", type=int, default=0, help="CPU intra-op threads (0 = torch's default)")
    p.add_argument("--model", default="builtin", help="model.source: builtin, a model file or module:function")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def _hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW such as 224x224, got {text!r}") from None
    return h, w


if __name__ == "__main__":
    raise SystemExit(main())
