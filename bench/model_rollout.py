"""A model rollout's cost to the frames being served (issue 69), on the real broker with a real `worker run`:
realtime frames at 20/s over 30 streams and standard frames at 10/s flow the whole time, while the group goes
through `worker rollout start --shadow 0.1` (the candidate loaded and warmed beside the serving model, then 10% of
the streams scored again) and `worker rollout promote`. The candidate is the builtin CNN's architecture with other
weights, as a TorchScript file (a second real model of the same cost).

Per window, from the results (realtime class): end-to-end p50/p99 and frames/s answered:
- steady: before the rollout;
- loading: from `rollout start` to the worker reporting `shadow` (the candidate loads and warms on the same cores);
- shadow: 10% shadow scoring, until the promote;
- swap: the 5 s after `promote`;
- after: the rest.
Also the time from the promote record's `written_at` to the first result of the new version (its capture time plus
its end-to-end time), and from the start record's to the worker's `shadow` report being seen.

    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:46695 python bench/model_rollout.py [--phase-s 20] [--rounds 1]

Prints a table and writes bench/results/model_rollout.json and .md. The figures are only as quiet as the machine.
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

MODEL = "streamfer-moderation-cnn"
RESULTS = Path(__file__).resolve().parent / "results"


def candidate_file(directory: Path) -> Path:
    import torch

    from worker.runtime.models import build_builtin_model

    path = directory / "cnn-v2.pt"
    torch.jit.script(build_builtin_model(5, 3, seed=4242).eval()).save(str(path))
    return path


def flow(bootstrap: str, topics: TestTopics, stop: threading.Event, sent: list[int]) -> list[threading.Thread]:
    def run(priority: Priority, rate: float, streams: int) -> None:
        producer = FrameProducer(bootstrap, topics)._client()
        frames = synthetic_frames(10**6, [(64, 48)], Encoding.JPEG, priority, f"b{uuid.uuid4().hex[:6]}",
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


def one_round(bootstrap: str, phase_s: float, work: Path) -> dict[str, Any]:
    unique = uuid.uuid4().hex[:8]
    topics = make_topics(bootstrap, f"mr{unique}")
    control, shadow = f"t{unique}.control", f"t{unique}.shadow"
    ensure_topics(bootstrap, [control], partitions=1, configs={control: CONTROL_TOPIC_CONFIG})
    ensure_topics(bootstrap, [shadow], partitions=3)
    models = work / unique
    models.mkdir(parents=True)
    v2 = candidate_file(models)
    env = {"WORKER_TOPICS_CONTROL": control, "WORKER_MODEL_ALLOWED_SOURCES": f"{models}/"}
    worker = run_worker(bootstrap, topics, work, worker_id=f"w{unique}", settings={
        "topics": {"control": control, "shadow_results": shadow}, "model": {"allowed_sources": [f"{models}/"]},
        "batching": {"realtime": {"max_age_ms": 2000}}})
    stop, sent = threading.Event(), [0]
    marks: dict[str, float] = {}

    def state() -> dict[str, Any]:
        return dict(cli(bootstrap, topics, env, "status", "--json")["workers"].get(f"w{unique}", {}))

    try:
        threads = flow(bootstrap, topics, stop, sent)
        marks["steady"] = time.time()
        time.sleep(phase_s)  # a window of the run itself: the frames flow at their rate meanwhile
        marks["loading"] = time.time()
        marks["start_written"] = cli(bootstrap, topics, env, "start", "--model", str(v2), "--version", "2",
                                     "--shadow", "0.1")["written_at_ms"] / 1000.0
        wait_for(lambda: state().get("state") == "shadow", 180, "the candidate in shadow", interval_s=0.5)
        marks["shadow"] = time.time()
        time.sleep(phase_s)
        marks["promote_sent"] = time.time()
        marks["promote_written"] = cli(bootstrap, topics, env, "promote")["written_at_ms"] / 1000.0
        marks["swap"] = time.time()
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
               "shadow": (marks["shadow"], marks["promote_sent"]), "swap": (marks["promote_sent"], marks["swap"] + 5),
               "after": (marks["swap"] + 5, marks["end"])}
    out: dict[str, Any] = {"frames": len(got), "sent": sent[0], "answered_once": len(
        {(r["stream_id"], r["frame_index"]) for r in got}) == len(got) == sent[0],
        "expired": sum(r["status"] == "EXPIRED" for r in got),
        "start_to_shadow_reported_s": marks["shadow"] - marks["start_written"],
        "promote_to_first_new_result_ms": first_new - marks["promote_written"] * 1000.0, "windows": {}}
    for name, (a, b) in windows.items():
        inside = [r for r in realtime if a * 1000 <= produced_at_ms(r) < b * 1000]
        out["windows"][name] = {**latency_summary(inside), "frames_per_s": len(inside) / max(b - a, 1e-9),
                                "span_s": b - a}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [one_round(bootstrap, args.phase_s, Path(tmp)) for _ in range(args.rounds)]
    rows = []
    for i, r in enumerate(rounds):
        steady = r["windows"]["steady"]["p99_ms"]
        for name, w in r["windows"].items():
            rows.append([i, name, round(w["span_s"], 1), w["n"], round(w["frames_per_s"], 1), round(w["p50_ms"], 1),
                         round(w["p99_ms"], 1), round(w["p99_ms"] / steady, 2) if steady else float("nan")])
    text = table("realtime class through a rollout (20 fps realtime + 10 fps standard, builtin CNN, 1 worker)",
                 ["round", "window", "s", "n", "fps", "p50 ms", "p99 ms", "p99 / steady"], rows,
                 note="\n".join(f"round {i}: start written to `shadow` reported (seen by a status poll every "
                                f"~1.5 s) {r['start_to_shadow_reported_s']:.1f} s, promote written to first new "
                                f"result {r['promote_to_first_new_result_ms']:.0f} ms, answered once "
                                f"{r['answered_once']}, expired {r['expired']}" for i, r in enumerate(rounds)))
    write_json("model_rollout", {"phase_s": args.phase_s, "rounds": rounds})
    (RESULTS / "model_rollout.md").write_text(
        "# A model rollout's cost (issue 69)\n\n`KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:46695 python bench/model_rollout.py"
        f" --phase-s {args.phase_s:g} --rounds {args.rounds}` on {os.cpu_count()} cores: the figures are only as quiet "
        "as the machine.\n\n```" + text + "\n```\n")


if __name__ == "__main__":
    main()
