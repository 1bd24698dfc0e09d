"""Mean batch size of the worker on mixed 720p and 1080p JPEG for a model with a fixed input size: this tree
(frames grouped by the model's input) against another (`--base`, e.g. main, which grouped them by frame size),
in rounds alternating which goes first. A real worker process per round on a real broker, fed by `--cameras`
cameras (half 720p, half 1080p) each sending a frame every 1/`--fps` s at the same instants (a frame grabber
sampling them in step): below capacity, where a batch leaves when the runtime idles or the class's wait is up,
so what one batch can hold is what grouping decides (on a backlog every group fills anyway).

    git archive main worker schemas | tar -x -C /tmp/main-tree
    python bench/mixed_sizes.py --base /tmp/main-tree [--rounds 3] [--cameras 8] [--fps 5] [--seconds 20]
        [--model builtin|opennsfw] [--set WORKER_<SECTION>_<FIELD>=VALUE ...]

The broker is KAFKA_BOOTSTRAP_SERVERS, else a local one started for the run. Per round and tree: the worker's own
summary at exit (results, batches), hence the mean batch size; a table of median (min-max) and the per-round
ratios this / base; JSON into bench/results/mixed_sizes.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats

from worker.frames import Encoding, Priority
from worker.testing import wait_for
from worker.tools.publish_frames import synthetic_frames

SHAPES = [(1280, 720), (1920, 1080)]
MODELS = {"builtin": {"WORKER_MODEL_SOURCE": "builtin", "WORKER_MODEL_INPUT_SIZE": "224,224"},
          "opennsfw": {"WORKER_MODEL_SOURCE": "opennsfw"}}


def one_run(bootstrap: str, tree: Path, model: str, cameras: int, fps: float, seconds: float, log_dir: Path,
            tag: str, settings: dict[str, str]) -> dict[str, Any]:
    """A worker of `tree` (the worker's defaults but the model and `settings`) on fresh topics, fed once it is
    ready; its summary at exit."""
    topics = common.make_topics(bootstrap, tag)
    worker_id = common.new_id(tag)
    env = common.worker_env(bootstrap, topics, 1, worker_id, extra={**MODELS[model], **settings,
                                                                    "PYTHONPATH": str(tree)})
    log_path = log_dir / f"{worker_id}.log"
    with open(log_path, "wb") as log:
        # cwd = the tree: `python -m worker` imports the package of its working directory first.
        proc = subprocess.Popen([sys.executable, "-m", "worker", "run", "--exit-when-idle", "3"], cwd=tree, env=env,
                                stdout=subprocess.PIPE, stderr=log)
        try:
            wait_for(lambda: "warmed up" in log_path.read_text(errors="replace") or proc.poll() is not None, 600,
                     f"worker {worker_id} ready")
            bursts = max(1, int(fps * seconds))
            # One stream per camera (streams_per_shape cameras of each size), frames cycling over the sizes.
            records = list(synthetic_frames(cameras * bursts, SHAPES, Encoding.JPEG, Priority.STANDARD, tag,
                                            streams_per_shape=cameras // len(SHAPES)))
            t0 = time.monotonic()
            sent = 0
            for i in range(bursts):
                # A load generator's schedule: burst i is due at t0 + i / fps.
                time.sleep(max(0.0, t0 + i / fps - time.monotonic()))
                sent += common.publish_load(bootstrap, topics, records[i * cameras:(i + 1) * cameras]).sent
            out, _ = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"worker exited {proc.returncode}: {log_path.read_text(errors='replace')[-3000:]}")
    summary = json.loads(out.decode().strip().splitlines()[-1])
    summary["mean_batch_size"] = (summary["results"] + summary["dead_lettered"]) / max(1, summary["batches"])
    summary["sent"] = sent
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the other tree (worker/ and schemas/), e.g. main's")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cameras", type=int, default=8, help="cameras, half 720p and half 1080p")
    p.add_argument("--fps", type=float, default=5.0, help="frames per second per camera, all in step")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--model", choices=sorted(MODELS), default="builtin")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a worker setting for both trees (WORKER_<SECTION>_<FIELD>=VALUE)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    trees = {"this": common.REPO, "base": args.base.resolve()}
    runs: dict[str, dict[int, dict[str, Any]]] = {v: {} for v in trees}
    log_dir = Path(tempfile.mkdtemp(prefix="streamfer-mixed-sizes-"))
    print(f"[mixed_sizes] worker logs in {log_dir}", flush=True)
    t0 = time.monotonic()
    with common.Broker() as broker:
        for r, v in stats.rotating(list(trees), args.rounds):
            run = one_run(broker.bootstrap, trees[v], args.model, args.cameras, args.fps, args.seconds, log_dir,
                          f"mix{v}", settings)
            runs[v][r] = run
            print(f"[mixed_sizes] round {r} {v}: {run['results']} results in {run['batches']} batches, mean batch "
                  f"{run['mean_batch_size']:.2f}", flush=True)
    mean = {v: {r: run["mean_batch_size"] for r, run in runs[v].items()} for v in trees}
    batches = {v: {r: float(run["batches"]) for r, run in runs[v].items()} for v in trees}
    rows = [[v, str(trees[v]), stats.Spread.of(list(mean[v].values())).text(2),
             stats.Spread.of(list(batches[v].values())).text(0)] for v in trees]
    ratio = stats.ratio_spread(mean["this"], mean["base"])
    rows.append(["this/base", "per-round ratios", ratio.text(2), stats.ratio_spread(batches["this"],
                                                                                     batches["base"]).text(2)])
    common.table(f"mean batch size, {args.model} (fixed input), {args.cameras} cameras (720p + 1080p JPEG) at "
                 f"{args.fps:g} frames/s each for {args.seconds:.0f}s{', ' if settings else ''}"
                 f"{' '.join(args.set)}: median (min-max) of {args.rounds} rounds",
                 ["tree", "path", "mean batch size", "batches"], rows)
    result = {"benchmark": "mixed_sizes", "machine": common.machine(), "model": args.model, "cameras": args.cameras,
              "fps_per_camera": args.fps, "settings": settings,
              "seconds": args.seconds, "rounds": args.rounds, "shapes": SHAPES, "trees": {k: str(t) for k, t in
                                                                                          trees.items()},
              "runs": {v: {str(r): run for r, run in runs[v].items()} for v in trees},
              "mean_batch_size": {v: stats.Spread.of(list(mean[v].values())).as_dict() for v in trees},
              "this_over_base": ratio.as_dict(), "elapsed_s": round(time.monotonic() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_sizes.json").write_text(json.dumps(result, indent=2))
    print(f"[mixed_sizes] wrote {args.out / 'mixed_sizes.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
