"""Start-up cost of the host-sync check (worker.runtime.hostsync.check_host_syncs), per model, in interleaved
rounds, each round a fresh process (the check runs once per start, so its first call is what counts).

For each model: the check as the worker runs it at start-up on this machine's CPU, beside loading the model
(`load_model`: reading it and the validation forward). For open_nsfw the check is the TorchScript graph scan only
(its graph calls no Python, so the forward is skipped on a CPU); the forward the check runs on a GPU, or for a
model not all in one graph, is timed too ("forward under the check's modes").

    python bench/hostsync_cost.py [--rounds 5]

Prints a table (median, min, max over rounds) and writes bench/results/hostsync_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("opennsfw", "builtin")


def one_round(source: str) -> dict[str, Any]:
    """Runs in the child process."""
    import warnings

    import torch

    from worker.config import load_settings
    from worker.runtime.hostsync import check_host_syncs, trace_forward
    from worker.runtime.models import load_model, validation_input

    warnings.simplefilter("ignore", FutureWarning)
    settings = load_settings(env={}, overrides={"model": {"source": source}})
    t0 = time.perf_counter()
    loaded = load_model(settings.model)
    t1 = time.perf_counter()
    findings = check_host_syncs(loaded, refuse=True)
    t2 = time.perf_counter()
    trace_forward(loaded.module, validation_input(loaded.contract, loaded.device))
    t3 = time.perf_counter()
    return {"load_model_s": t1 - t0, "check_s": t2 - t1, "forward_under_modes_s": t3 - t2,
            "findings": len(findings), "torch_threads": torch.get_num_threads(),
            "dynamo_imported": "torch._dynamo" in sys.modules}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one_round(args.child)))
        return 0
    sys.path.insert(0, str(HERE))
    from common import machine, table, write_json

    # One untimed start, so an ONNX conversion not yet cached is not counted as loading.
    subprocess.run([sys.executable, __file__, "--child", "opennsfw"], cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODELS}
    for r in range(args.rounds):
        for model in MODELS if r % 2 == 0 else MODELS[::-1]:
            out = subprocess.run([sys.executable, __file__, "--child", model], cwd=ROOT, check=True,
                                 capture_output=True, text=True, timeout=600)
            runs[model].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def summary(model: str, key: str) -> tuple[float, float, float]:
        values = [run[key] * 1000.0 for run in runs[model]]
        return statistics.median(values), min(values), max(values)

    rows = []
    for model in MODELS:
        row: list[Any] = [model]
        for key in ("check_s", "load_model_s", "forward_under_modes_s"):
            med, lo, hi = summary(model, key)
            row.append(f"{med:.0f} ({lo:.0f}-{hi:.0f})")
        row.append(runs[model][0]["findings"])
        rows.append(row)
    table(f"host-sync check at start-up, ms: median (min-max) of {args.rounds} rounds, fresh process each",
          ["model", "check", "load_model", "forward under the check's modes", "findings"], rows)
    write_json("hostsync_cost", {"machine": machine(), "rounds": args.rounds, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
