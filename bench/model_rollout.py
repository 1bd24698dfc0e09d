"""A model rollout's cost to the frames being served (issue 69), on the real broker with a real `worker run`:
realtime frames at 20/s over 30 streams and standard frames at 10/s flow the whole time, while the group goes
through `worker rollout start --shadow 0.1` (the candidate loaded and warmed beside the serving model, then 10% of
the streams scored again) and `worker rollout promote`. With `--model builtin` (64x48 JPEG frames, the tests' worker
settings) the candidate is the builtin CNN's architecture with other weights, as a TorchScript file (a second real
model of the same cost); with `--model opennsfw` (224x224 JPEG photos, the worker's own defaults) it is the open_nsfw
preset again as version 2 (a second session of the same ResNet-50: the swap's worst case for memory and CPU).
`--backlog N` also publishes N bulk frames before the worker starts, so it is saturated throughout: the frames/s
answered per window is then the throughput, and its dip through the swap shows.

Per window, from the results (realtime class): end-to-end p50/p99 and frames/s answered:
- steady: before the rollout;
- loading: from `rollout start` to the worker reporting `shadow` (the candidate loads and warms on the same cores);
- shadow: 10% shadow scoring, until the promote;
- swap: the 5 s after the promote record was written (the CLI's own start-up before it, on the worker's cores
  here, is left out; each window's three slowest realtime frames are in the JSON);
- after: the rest.
Also the time from the promote record's `written_at` to the first result of the new version (its capture time plus
its end-to-end time), and from the start record's to the worker's `shadow` report being seen.

    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:46695 python bench/model_rollout.py [--phase-s 20] [--rounds 1]
        [--model builtin|opennsfw] [--backlog N]

Prints a table and writes bench/results/model_rollout_MODEL[_backlog].json and .md (untracked: the curated page of
every run is model_rollout.md). The figures are only as quiet as the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from common import latency_summary, produced_at_ms, table, write_json

from worker.codec.schemas import decode_result
from worker.frames import Encoding, Priority
from worker.kafka.topics import CONTROL_TOPIC_CONFIG, ensure_topics
from worker.testing import FrameProducer, TestTopics, make_topics, run_worker, wait_for
from worker.tools.publish_frames import send_frames, synthetic_frames
from worker.tools.read_results import iter_messages

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"builtin": (64, 48), "opennsfw": (224, 224)}  # the frames' width x height, per model


def candidate(model: str, directory: Path) -> str:
    """The candidate's model source: a second real model of the serving one's cost."""
    if model == "opennsfw":
        return "opennsfw"
    import torch

    from worker.runtime.models import build_builtin_model

    path = directory / "cnn-v2.pt"
    torch.jit.script(build_builtin_model(5, 3, seed=4242).eval()).save(str(path))
    return str(path)


def publish_backlog(bootstrap: str, topics: TestTopics, shape: tuple[int, int], count: int) -> None:
    """`count` bulk frames, published and acknowledged before the worker starts."""
    producer = FrameProducer(bootstrap, topics)._client()
    frames = synthetic_frames(count, [shape], Encoding.JPEG, Priority.BULK, f"k{uuid.uuid4().hex[:6]}",
                              streams_per_shape=20)
    send_frames(producer, frames, lambda _r: topics.for_priority(Priority.BULK))
    if producer.flush(120):
        raise RuntimeError("the bulk backlog was not acknowledged within 120 s")


def flow(bootstrap: str, topics: TestTopics, shape: tuple[int, int], stop: threading.Event,
         sent: list[int]) -> list[threading.Thread]:
    def run(priority: Priority, rate: float, streams: int) -> None:
        producer = FrameProducer(bootstrap, topics)._client()
        frames = synthetic_frames(10**6, [shape], Encoding.JPEG, priority, f"b{uuid.uuid4().hex[:6]}",
                                  streams_per_shape=streams)

        def counted() -> Any:
            for f in itertools.takewhile(lambda _f: not stop.is_set(), frames):
                sent[0] += 1
                yield f

        send_frames(producer, counted(), lambda _r: topics.for_priority(priority), rate_fps=rate)
        producer.flush(30)

    threads = [threading.Thread(target=run, args=a, daemon=True)
               for a in ((Priority.REALTIME, 20.0, 30), (Priority.STANDARD, 10.0, 20))]
    for t in threads:
        t.start()
    return threads


def cli(bootstrap: str, topics: TestTopics, env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "worker", "rollout", *args, "-b", bootstrap, "--group-id",
                           topics.group], env={**os.environ, **topics.env(), **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    return dict(json.loads(done.stdout))


def one_round(bootstrap: str, phase_s: float, work: Path, model: str, backlog: int) -> dict[str, Any]:
    unique = uuid.uuid4().hex[:8]
    topics = make_topics(bootstrap, f"mr{unique}")
    control, shadow = f"t{unique}.control", f"t{unique}.shadow"
    ensure_topics(bootstrap, [control], partitions=1, configs={control: CONTROL_TOPIC_CONFIG})
    ensure_topics(bootstrap, [shadow], partitions=3)
    models = work / unique
    models.mkdir(parents=True)
    v2 = candidate(model, models)
    if backlog:
        publish_backlog(bootstrap, topics, SHAPES[model], backlog)
    env = {"WORKER_TOPICS_CONTROL": control, "WORKER_MODEL_ALLOWED_SOURCES": f"{models}/"}
    worker = run_worker(bootstrap, topics, work, worker_id=f"w{unique}", settings={
        "topics": {"control": control, "shadow_results": shadow},
        "model": {"source": model, "allowed_sources": [f"{models}/"]},
        "batching": {"realtime": {"max_age_ms": 2000}}}, test_env=model == "builtin")
    stop, sent = threading.Event(), [backlog]
    marks: dict[str, float] = {}

    def state() -> dict[str, Any]:
        return dict(cli(bootstrap, topics, env, "status", "--json")["workers"].get(f"w{unique}", {}))

    try:
        threads = flow(bootstrap, topics, SHAPES[model], stop, sent)
        marks["steady"] = time.time()
        time.sleep(phase_s)  # a window of the run itself: the frames flow at their rate meanwhile
        marks["loading"] = time.time()
        marks["start_written"] = cli(bootstrap, topics, env, "start", "--model", v2, "--version", "2",
                                     "--shadow", "0.1")["written_at_ms"] / 1000.0
        wait_for(lambda: state().get("state") == "shadow", 180, "the candidate in shadow", interval_s=0.5)
        marks["shadow"] = time.time()
        time.sleep(phase_s)
        marks["promote_sent"] = time.time()
        marks["promote_written"] = cli(bootstrap, topics, env, "promote")["written_at_ms"] / 1000.0
        time.sleep(phase_s)
        marks["end"] = time.time()
        stop.set()
        for t in threads:
            t.join(60)
        got = [decode_result(m.value()) for m in iter_messages(bootstrap, topics.results, sent[0], follow=True,
                                                                timeout_s=180)]
    finally:
        stop.set()
        worker.stop()
    realtime = [r for r in got if r["source_topic"] == topics.realtime]
    first_new = min((produced_at_ms(r) for r in got if r["model_version"] == "2"), default=float("nan"))
    windows = {"steady": (marks["steady"] + 3, marks["loading"]), "loading": (marks["loading"], marks["shadow"]),
               "shadow": (marks["shadow"], marks["promote_sent"]),
               # From the promote record's writing: the CLI process before it (~0.5 CPU-s of start-up on the same two
               # cores as the worker, here) is the operator's command, not the swap.
               "swap": (marks["promote_written"], marks["promote_written"] + 5),
               "after": (marks["promote_written"] + 5, marks["end"])}
    out: dict[str, Any] = {"frames": len(got), "sent": sent[0], "answered_once": len(
        {(r["stream_id"], r["frame_index"]) for r in got}) == len(got) == sent[0],
        "expired": sum(r["status"] == "EXPIRED" for r in got),
        "start_to_shadow_reported_s": marks["shadow"] - marks["start_written"],
        "promote_to_first_new_result_ms": first_new - marks["promote_written"] * 1000.0, "windows": {},
        "backlog": backlog, "backlog_left_at_end": backlog > 0 and any(
            r["source_topic"] == topics.for_priority(Priority.BULK) and produced_at_ms(r) >= marks["end"] * 1000
            for r in got)}
    for name, (a, b) in windows.items():
        inside = [r for r in realtime if a * 1000 <= produced_at_ms(r) < b * 1000]
        answered = sum(a * 1000 <= produced_at_ms(r) < b * 1000 for r in got)
        slowest = sorted(inside, key=lambda r: -r["end_to_end_ms"])[:3]
        out["windows"][name] = {**latency_summary(inside), "frames_per_s": len(inside) / max(b - a, 1e-9),
                                "all_frames_per_s": answered / max(b - a, 1e-9), "span_s": b - a,
                                "slowest": [{k: r[k] for k in ("end_to_end_ms", "queued_ms", "inference_ms",
                                                               "batch_size", "model_version")} | {
                                    "after_promote_ms": produced_at_ms(r) - marks["promote_written"] * 1000.0}
                                    for r in slowest]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", choices=list(SHAPES), default="builtin", help="the serving model and candidate")
    parser.add_argument("--backlog", type=int, default=0, help="bulk frames published first: a saturated worker")
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [one_round(bootstrap, args.phase_s, Path(tmp), args.model, args.backlog) for _ in range(args.rounds)]
    rows = []
    for i, r in enumerate(rounds):
        steady = r["windows"]["steady"]
        for name, w in r["windows"].items():
            rows.append([i, name, round(w["span_s"], 1), w["n"], round(w["frames_per_s"], 1), round(w["p50_ms"], 1),
                         round(w["p99_ms"], 1), round(w["p99_ms"] / steady["p99_ms"], 2),
                         round(w["all_frames_per_s"], 1), round(w["all_frames_per_s"] / steady["all_frames_per_s"], 2)])
    load = f"20 fps realtime + 10 fps standard{f' + a {args.backlog}-frame bulk backlog' if args.backlog else ''}"
    text = table(f"realtime class through a rollout ({load}, {args.model}, 1 worker)",
                 ["round", "window", "s", "n", "fps", "p50 ms", "p99 ms", "p99 / steady", "all fps",
                  "all fps / steady"], rows,
                 note="\n".join(f"round {i}: start written to `shadow` reported (seen by a status poll every "
                                f"~1.5 s) {r['start_to_shadow_reported_s']:.1f} s, promote written to first new "
                                f"result {r['promote_to_first_new_result_ms']:.0f} ms, answered once "
                                f"{r['answered_once']}, expired {r['expired']}"
                                + (f", backlog left at the end {r['backlog_left_at_end']}" if args.backlog else "")
                                for i, r in enumerate(rounds)))
    # model_rollout.md itself is the curated page of every run (bench/results/README.md).
    name = f"model_rollout_{args.model}" + ("_backlog" if args.backlog else "")
    write_json(name, {"phase_s": args.phase_s, "model": args.model, "backlog": args.backlog, "rounds": rounds})
    (RESULTS / f"{name}.md").write_text(
        f"# A model rollout's cost (issue 69): {args.model}\n\n`KAFKA_BOOTSTRAP_SERVERS=<broker> python "
        f"bench/model_rollout.py --phase-s {args.phase_s:g} --rounds {args.rounds} --model {args.model}"
        f"{f' --backlog {args.backlog}' if args.backlog else ''}` on {os.cpu_count()} cores: the figures are only "
        "as quiet as the machine.\n\n```" + text + "\n```\n")


if __name__ == "__main__":
    main()
