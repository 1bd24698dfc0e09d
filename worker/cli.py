"""`worker` command line: thin wrappers over the modules; each subcommand documents its flags."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from worker.config import Settings, load_settings
from worker.errors import EXIT_INTERNAL_ERROR, EXIT_OPERATOR_ERROR, OperatorError, StartError
from worker.frames import DEAD_LETTER_ERROR_TYPES, Priority

log = logging.getLogger("worker")


def _settings(args: argparse.Namespace, **extra: dict[str, Any]) -> Settings:
    overrides: dict[str, dict[str, Any]] = {"kafka": {"bootstrap_servers": getattr(args, "bootstrap_servers", None),
                                                      "group_id": getattr(args, "group_id", None)}}
    for section, values in extra.items():
        overrides.setdefault(section, {}).update(values)
    return load_settings(getattr(args, "config", None), overrides=overrides)


# -- run ---------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    # A supervisor's SIGTERM can come while the settings load and the worker's modules import (seconds on a busy
    # host): noted here, and the StopFlag below takes it over (start, drain, exit 0), never the default death.
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    settings = _settings(args, observability={"metrics_port": args.metrics_port})
    from worker.app import StopFlag, run_worker, setup_logging
    from worker.identity import worker_identity

    if args.processes > 1:
        setup_logging(settings)
        if early:  # stopped before any child started
            log.info("signal %d during start-up: exiting before starting the processes", early[0])
            return 0
        return _run_processes(args, settings)
    # The worker id first (its slot is held until the process exits): every log line names it.
    with worker_identity(settings) as settings:
        setup_logging(settings)
        # Before the slow imports and warm-up: a SIGTERM during start-up then means "start, drain, exit 0".
        stop = StopFlag().install()
        if early:
            log.info("signal %d during start-up: draining then exiting", early[0])
            stop.set()
        summary = run_worker(settings, exit_when_idle_s=args.exit_when_idle, stop=stop)
    print(json.dumps({"consumed": summary.consumed, "results": summary.results, "expired": summary.expired,
                      "dead_lettered": summary.dead_lettered, "batches": summary.batches,
                      "commits": summary.commits}), flush=True)
    return 0


def _run_processes(args: argparse.Namespace, settings: Settings) -> int:
    """N consumer processes of one group on this host; each gets its own worker id (child i: slot i of the default
    id, or `<worker_id>-p<i>`) and metrics port."""
    from worker.identity import child_identities

    children = []
    base_port = settings.observability.metrics_port
    for i, identity in enumerate(child_identities(settings, args.processes)):
        argv = [sys.executable, "-m", "worker", "run", "--processes", "1"]
        if args.config:
            argv += ["--config", args.config]
        if args.bootstrap_servers:
            argv += ["--bootstrap-servers", args.bootstrap_servers]
        if args.group_id:
            argv += ["--group-id", args.group_id]
        if args.exit_when_idle is not None:
            argv += ["--exit-when-idle", str(args.exit_when_idle)]
        argv += ["--metrics-port", str(base_port + i if base_port else 0)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("WORKER_OBSERVABILITY_WORKER_ID", "WORKER_OBSERVABILITY_WORKER_SLOT")}
        env.update(identity)
        children.append(subprocess.Popen(argv, env=env))

    def forward(signum: int, _frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, key=abs)


# -- produce -----------------------------------------------------------------------------------------------
def cmd_produce(args: argparse.Namespace) -> int:
    from worker.tools.produce import produce

    return produce(args, _settings(args))


# -- results -----------------------------------------------------------------------------------------------
def cmd_results(args: argparse.Namespace) -> int:
    from worker.codec.schemas import decode_result
    from worker.tools.read_results import iter_messages, result_filter

    settings = _settings(args)
    keep = result_filter(verdicts=args.verdict, tenants=args.tenant)
    shown = 0
    for msg in iter_messages(settings.kafka, args.topic, None if keep else args.count, args.idle_timeout,
                             follow=args.follow):
        result = decode_result(msg.value())
        if keep and not keep(result):
            continue
        print(json.dumps(result), flush=True)
        shown += 1
        if args.count is not None and shown >= args.count:
            break
    return 0


# -- policy ------------------------------------------------------------------------------------------------
def cmd_policy_set(args: argparse.Namespace) -> int:
    from worker.tools.policy import set_policy

    print(json.dumps(set_policy(_settings(args), args.file)), flush=True)
    return 0


def cmd_policy_show(args: argparse.Namespace) -> int:
    from worker.tools.policy import format_show, show_policy

    shown = show_policy(_settings(args))
    print(json.dumps(shown) if args.json else format_show(shown), flush=True)
    return 0


# -- rollout (issue 69) ------------------------------------------------------------------------------------
def cmd_rollout(args: argparse.Namespace) -> int:
    from worker.tools import rollout

    settings = _settings(args)
    if args.rollout_command == "start":
        print(json.dumps(rollout.start(settings, args.model, args.name or "", args.version or "", args.shadow,
                                       args.canary, args.config)), flush=True)
    elif args.rollout_command == "promote":
        print(json.dumps(rollout.promote(settings)), flush=True)
    elif args.rollout_command == "abort":
        print(json.dumps(rollout.abort(settings)), flush=True)
    else:
        shown = rollout.status(settings)
        print(json.dumps(shown) if args.json else rollout.format_status(shown), flush=True)
    return 0


# -- topics / broker / demo --------------------------------------------------------------------------------
def cmd_topics(args: argparse.Namespace) -> int:
    from worker.kafka.access import probe_reachable
    from worker.kafka.topics import (
        ensure_control_topic,
        ensure_topics,
        frame_topic_configs,
        frame_topics,
        raise_message_limits,
        worker_topics,
    )

    settings = _settings(args)
    probe_reachable(settings)
    created = ensure_topics(settings.kafka, worker_topics(settings.topics), args.partitions,
                            configs=frame_topic_configs(settings.topics, args.max_frame_bytes),
                            replication=args.replication_factor)
    created += ensure_control_topic(settings.kafka, settings.topics, replication=args.replication_factor)
    if settings.topics.worker_status:  # issue 69: the workers' reports apart from the control topic
        from worker.kafka.rollout import status_settings

        created += ensure_control_topic(settings.kafka, status_settings(settings).topics,
                                        replication=args.replication_factor)
    # Topics made before (by an older version, or by hand) may still refuse large frames.
    raised = raise_message_limits(settings.kafka, [t for t in frame_topics(settings.topics) if t not in created],
                                  args.max_frame_bytes)
    print(json.dumps({"created": created, "max_message_bytes_raised": raised,
                      "max_frame_bytes": args.max_frame_bytes}))
    return 0


def _default_max_frame_bytes() -> int:
    from worker.kafka.topics import DEFAULT_MAX_FRAME_BYTES

    return DEFAULT_MAX_FRAME_BYTES


def cmd_broker(args: argparse.Namespace) -> int:
    from worker.tools.local_broker import LocalKafka

    kwargs = {"security": args.security, "nodes": args.nodes}
    broker = LocalKafka(args.dir, **kwargs) if args.dir else LocalKafka(**kwargs)
    if args.action == "start":
        st = broker.start()
        print(st.bootstrap_servers)
        if broker.security != "plaintext":
            # Settings for the worker (passwords by file): eval-able lines on stderr, the address on stdout.
            for key, value in broker.worker_env().items():
                print(f"export {key}={value}", file=sys.stderr)
    elif args.action == "stop":
        print("stopped" if broker.stop() else "not running")
    elif args.action == "destroy":
        broker.destroy()
        print("destroyed")
    else:
        running = broker.running()
        print(running.bootstrap_servers if running else "not running")
        return 0 if running else 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from worker.tools.demo import run_demo

    return run_demo(frames_per_topic=args.frames, keep_broker=args.keep_broker, model=args.model)


# -- dlq / lag ---------------------------------------------------------------------------------------------
def cmd_dlq_show(args: argparse.Namespace) -> int:
    from worker.tools.dlq.show import render_summary, show

    summary = show(_settings(args), _dlq_selection(args), newest=args.newest, window_ms=args.window)
    print(json.dumps(summary.to_json(args.top, args.payload)) if args.json
          else render_summary(summary, args.top, args.payload))
    return 0


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    from worker.tools.dlq.replay import EXIT_REPLAY_FAILED, ReplayItem, replay

    def progress(item: ReplayItem) -> None:
        print(item.render(), flush=True)

    report = replay(_settings(args), _dlq_selection(args), target_topic=args.topic, dry_run=args.dry_run,
                    limit=args.limit, on_item=None if args.json or args.quiet else progress)
    print(json.dumps(report.to_json(with_items=not args.quiet)) if args.json else report.render_totals())
    return EXIT_REPLAY_FAILED if report.count("failed") else 0


def _dlq_selection(args: argparse.Namespace) -> Any:
    from worker.tools.dlq import Selection

    def chosen(values: list[str] | None) -> frozenset[str] | None:
        return frozenset(values) if values else None

    return Selection(error_types=chosen(args.error_type), since_ms=args.since, until_ms=args.until,
                     streams=chosen(args.stream), tenants=chosen(args.tenant), source_topics=chosen(args.source_topic))


def cmd_lag(args: argparse.Namespace) -> int:
    from worker.tools.lag import EXIT_ABOVE_THRESHOLD, read_lag

    settings = _settings(args)
    report = read_lag(settings, args.group or [settings.kafka.group_id], set(args.priority_class or []) or None,
                      read_age=not args.no_age, age_timeout_s=args.age_timeout)
    print(json.dumps(report.to_json()) if args.json else report.render())
    exceeded = report.exceeded(args.fail_above, args.fail_above_age)
    for reason in exceeded:
        print(f"above threshold: {reason}", file=sys.stderr)
    return EXIT_ABOVE_THRESHOLD if exceeded else 0


# -- check-model -------------------------------------------------------------------------------------------
def cmd_check_model(args: argparse.Namespace) -> int:
    from worker.tools.check_model import check_model, load_images

    # The worker's own log lines only when asked: the report says what they would (the host-sync warning too).
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:  # and the traceback of an unexpected error (exit 70), which is logged at DEBUG
        logging.getLogger("worker").setLevel(logging.DEBUG)
    images, images_from = load_images(args.images)
    report = check_model(args.config, args.model, images, images_from, require_graphs=args.require_graphs,
                         max_batch=args.max_batch)
    print(json.dumps(report.to_json()) if args.json else report.render(), flush=True)
    return report.exit_code


def _count_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0, 1, 2, ...)")
    return value


def _time_arg(text: str) -> int:
    """--since / --until: a duration ago (2h) or an ISO 8601 time, as epoch milliseconds."""
    from worker.tools.dlq import parse_time_ms

    try:
        return parse_time_ms(text, int(time.time() * 1000))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_arg(text: str) -> int:
    from worker.tools.dlq import parse_duration_ms

    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap-servers", "-b", help="Kafka bootstrap servers (default: kafka.bootstrap_servers)")
    p.add_argument("--config", "-c", help="TOML settings file: topics, [kafka] security, [dlq]")


def _add_dlq_parsers(sub: Any) -> None:
    dlq = sub.add_parser("dlq", help="inspect the dead-letter topic and replay its frames (docs/operations.md)",
                         description="Dead letters: `show` counts and lists them, `replay` publishes their frames "
                         "again once the cause is fixed.")
    dsub = dlq.add_subparsers(dest="dlq_command", required=True)

    def filters(p: argparse.ArgumentParser) -> None:
        _connection(p)
        f = p.add_argument_group("selection (repeat a flag for several values)")
        f.add_argument("--error-type", action="append", metavar="TYPE",
                       help=", ".join(sorted(DEAD_LETTER_ERROR_TYPES)))
        f.add_argument("--since", type=_time_arg, metavar="WHEN", help="dead-lettered at or after: 2h (ago) or "
                       "2026-12-04T10:00:00Z")
        f.add_argument("--until", type=_time_arg, metavar="WHEN", help="dead-lettered before")
        f.add_argument("--stream", action="append", metavar="ID", help="stream id")
        f.add_argument("--tenant", action="append")
        f.add_argument("--source-topic", action="append", metavar="TOPIC", help="input topic it was read from")
        p.add_argument("--json", action="store_true", help="one JSON object instead of text")

    show = dsub.add_parser("show", help="counts by error type, source topic, stream, tenant and time window, "
                           "then the newest dead letters with their reasons",
                           description="Count the selected dead letters by error type, source topic, stream, "
                           "tenant, time window and replay count, then list the newest with their reason headers "
                           "(never their frame bytes, unless --payload).")
    filters(show)
    show.add_argument("--newest", type=int, default=10, metavar="N", help="list the newest N (default 10)")
    show.add_argument("--top", type=int, default=10, metavar="N", help="streams, tenants, windows shown (10)")
    show.add_argument("--window", type=_duration_arg, default=3_600_000, metavar="DURATION",
                      help="time window of the counts (default 1h)")
    show.add_argument("--payload", action="store_true", help="also print each listed dead letter's bytes (base64)")
    show.set_defaults(func=cmd_dlq_show)

    rep = dsub.add_parser("replay", help="publish the selected dead letters' frames again",
                          description="Publish the frames of the selected dead letters again, to their source topic "
                          "(or --topic), with their key and headers plus a replay marker; each is recorded in "
                          "<dead-letter topic>.replayed in the same transaction and never replayed twice. Not "
                          "replayed: DuplicateFrame (unless --error-type names it), frames replayed "
                          "dlq.max_replays times, reference-only frames no longer in their input topic.")
    filters(rep)
    rep.add_argument("--topic", "-t", help="publish to this topic instead of each frame's source topic")
    rep.add_argument("--dry-run", "-n", action="store_true", help="print what would be sent; send nothing")
    rep.add_argument("--limit", type=int, metavar="N", help="replay at most N frames")
    rep.add_argument("--quiet", "-q", action="store_true", help="totals only, no line per dead letter")
    rep.set_defaults(func=cmd_dlq_replay)


def _add_lag_parser(sub: Any) -> None:
    lag = sub.add_parser("lag", help="per group, topic and partition: committed and end offsets, lag, owner, "
                         "the oldest pending frame's age; totals per priority class",
                         description="Consumer lag from the broker alone (no worker needs to run). Exit code 3 "
                         "when a --fail-above threshold is crossed, 2 on an operator error.")
    _connection(lag)
    lag.add_argument("--group", action="append", metavar="GROUP", help="consumer group (repeatable; default: "
                     "kafka.group_id)")
    lag.add_argument("--class", dest="priority_class", action="append",
                     choices=[p.label for p in Priority] + ["other"], help="only these priority classes (repeatable)")
    lag.add_argument("--fail-above", type=int, metavar="N", help="exit 3 when the total lag shown is above N")
    lag.add_argument("--fail-above-age", type=float, metavar="SECONDS",
                     help="exit 3 when the oldest pending frame shown is older than this")
    lag.add_argument("--no-age", action="store_true", help="do not read the frame at each committed offset")
    lag.add_argument("--age-timeout", type=float, default=5.0, metavar="SECONDS",
                     help="how long reading those frames may take (default 5)")
    lag.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    lag.set_defaults(func=cmd_lag)


def _add_check_model_parser(sub: Any) -> None:
    check = sub.add_parser("check-model", help="load a model as `worker run` would: its contract, host syncs, "
                           "scores on sample photos, a batch timed per bucket; exit 2 if it would not start",
                           description="Start the runtime as `worker run` does (same settings, same code: load, "
                           "contract, host-sync check, warm-up and, on a GPU, the CUDA-graph captures; no Kafka), "
                           "then score images sent as JPEG frames and time a batch per runtime.graph_batch_sizes "
                           "bucket; with a model set, every model. Exit 0: the worker would start and every image has "
                           "scores; 1: an image got no score; 2: the worker would not start (the reason is printed); "
                           "70: an unexpected error (one line naming it; --verbose for the traceback).")
    check.add_argument("--config", "-c", help="TOML settings file, as for `worker run` (WORKER_* variables apply too)")
    check.add_argument("--model", "-m", metavar="SOURCE", help="model.source: builtin, opennsfw, nudenet, a .onnx, "
                       ".pt or .pt2 file, or package.module:function (default: the settings')")
    check.add_argument("--images", metavar="DIR", help="score the images in DIR instead of the scikit-image photos")
    check.add_argument("--require-graphs", action="store_true", help="host syncs in forward exit 2 on any machine, "
                       "as on a GPU with runtime.cuda_graphs = true (default: a warning where graphs are not used)")
    check.add_argument("--max-batch", type=_count_arg, metavar="N", help="time batch sizes up to N (default: every "
                       "bucket on a GPU, up to 8 on a CPU; 0: no timing)")
    check.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    check.add_argument("--verbose", "-v", action="store_true", help="the worker's log lines on stderr (and the "
                       "traceback of an unexpected error)")
    check.set_defaults(func=cmd_check_model)


# -- parser ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worker", description="streamfer: Kafka streaming inference worker "
                                     "for video moderation. Settings come from --config (TOML) and "
                                     "WORKER_<SECTION>_<FIELD> environment variables; flags win.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, bootstrap_required: bool = False) -> None:
        p.add_argument("--bootstrap-servers", "-b", required=bootstrap_required,
                       help="Kafka bootstrap servers, host:port[,host:port] (default: kafka.bootstrap_servers)")
        p.add_argument("--config", "-c", help="TOML settings file (see docs/configuration.md)")
        p.add_argument("--group-id", help="consumer group (default: kafka.group_id)")

    run = sub.add_parser("run", help="run the worker: consume frames, batch, infer, produce results")
    common(run)
    run.add_argument("--exit-when-idle", type=float, metavar="SECONDS",
                     help="exit after this long with no input and nothing in flight, counted from the "
                     "first partition assignment, once the committed offsets reach the end of every "
                     "partition assigned here (batch jobs, tests)")
    run.add_argument("--processes", type=int, default=1, help="consumer processes of the group on this host")
    run.add_argument("--metrics-port", type=int, help="port for /metrics, /healthz, /readyz (0: any free port)")
    run.set_defaults(func=cmd_run)

    prod = sub.add_parser("produce", help="publish frames: synthetic, from an image folder, or from videos")
    common(prod)
    prod.add_argument("--topic", "-t", help="input topic (default: topics.realtime for a video, topics.bulk with "
                      "--backfill, else topics.standard)")
    prod.add_argument("--count", "-n", type=int, help="frames to send (default 100 synthetic; all images; for a "
                      "video, the most per stream, default all; a live camera stops after that many)")
    prod.add_argument("--shape", default="64x64", help="WIDTHxHEIGHT[,WIDTHxHEIGHT...] cycled (default 64x64)")
    prod.add_argument("--rate", type=float, help="frames per second, open loop (default: as fast as possible; "
                      "a video is paced by its own timestamps)")
    prod.add_argument("--encoding", choices=["raw", "jpeg"], default="jpeg",
                      help="pixel encoding (default jpeg: a raw 1280x720 frame is 2.76 MB, over Kafka's default "
                      "1 MB message limit)")
    prod.add_argument("--quality", type=int, default=85, help="JPEG quality 1..95 (default 85)")
    prod.add_argument("--tenants", default="tenant-a,tenant-b,tenant-c", help="comma-separated tenants, cycled")
    prod.add_argument("--from-folder", help="publish the images in this folder instead of synthetic frames")
    prod.add_argument("--from-video", nargs="+", action="extend", metavar="FILE_OR_URL",
                      help="publish videos (files, or any URL FFmpeg opens), each as its own stream, all at once; "
                      "repeatable (needs PyAV: pip install 'streamfer[models]')")
    prod.add_argument("--fps", type=float, help="video: sample at most this many frames per second of video (live "
                      "cameras: per second of wall-clock time)")
    prod.add_argument("--resize", metavar="WxH", help="video: resize frames to WIDTHxHEIGHT")
    prod.add_argument("--backfill", action="store_true", help="video: send as fast as possible (not in real time), "
                      "to the bulk topic unless --topic says otherwise")
    live = prod.add_argument_group("live cameras (rtsp://, http(s)://, ... URLs given to --from-video, no --backfill)")
    live.add_argument("--read-timeout", type=float, default=5.0, metavar="SECONDS",
                      help="no frame for this long is a stall: the camera is reconnected (default 5)")
    live.add_argument("--open-timeout", type=float, default=10.0, metavar="SECONDS",
                      help="connecting to a camera may take this long (default 10)")
    live.add_argument("--backoff-max", type=float, default=30.0, metavar="SECONDS",
                      help="longest wait between reconnect attempts (from 0.5 s, doubling, jittered; default 30)")
    live.add_argument("--give-up-after", type=int, metavar="N",
                      help="give a camera up after N failed connections in a row (default: never)")
    live.add_argument("--max-queued-frames", type=int, default=4,
                      help="frames of one camera waiting to be sent; beyond, the oldest are dropped (default 4)")
    live.add_argument("--source-option", action="append", default=[], metavar="KEY=VALUE",
                      help="an FFmpeg option for opening the cameras, repeatable (defaults: rtsp_transport=tcp, "
                      "analyzeduration=500000)")
    live.add_argument("--metrics-port", type=int, help="serve per-camera Prometheus metrics on this port")
    live.add_argument("--summary-every", type=float, default=30.0, metavar="SECONDS",
                      help="log a per-camera summary this often (0: only at exit; default 30)")
    prod.add_argument("--traceparent", action="store_true", help="send each frame in a trace of its own: a W3C "
                      "`traceparent` header, from a `send <topic>` span exported to tracing.endpoint when it is set; "
                      "the worker continues the trace (docs/troubleshooting.md)")
    prod.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    prod.add_argument("--run-id", help="prefix of the stream ids (default: random)")
    prod.add_argument("--schema-registry", metavar="URL", help="write frames in the Confluent wire format, the "
                      "frame schema registered under <topic>-value at this Schema Registry (default: "
                      "schema_registry.url; neither: plain Avro bodies)")
    prod.set_defaults(func=cmd_produce)

    res = sub.add_parser("results", help="print moderation results as JSON lines")
    res.add_argument("--bootstrap-servers", "-b", help="Kafka bootstrap servers (default: kafka.bootstrap_servers)")
    res.add_argument("--config", "-c", help="TOML settings file (its [kafka] security settings are used)")
    res.add_argument("--topic", default="moderation.results")
    res.add_argument("--count", "-n", type=int, help="stop after this many results")
    res.add_argument("--idle-timeout", type=float, default=5.0, help="stop after this long at the end (seconds)")
    res.add_argument("--follow", "-f", action="store_true", help="keep waiting for new results")
    res.add_argument("--verdict", action="append", choices=["allow", "review", "flag"],
                     help="only results with this policy verdict (repeatable)")
    res.add_argument("--tenant", action="append", help="only this tenant's results (repeatable)")
    res.set_defaults(func=cmd_results)

    pol = sub.add_parser("policy", help="the group's verdict policy on the control topic (docs/operations.md)")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    pset = psub.add_parser("set", help="check a [policy] file and write it as the group's next revision: every "
                           "worker applies it from its next batch (exit 2 naming the setting and line)")
    common(pset)
    pset.add_argument("--file", "-f", required=True, help="TOML file with a [policy] section")
    pset.set_defaults(func=cmd_policy_set)
    pshow = psub.add_parser("show", help="the group's policy revision and the version each worker applies")
    common(pshow)
    pshow.add_argument("--json", action="store_true", help="one JSON object instead of text")
    pshow.set_defaults(func=cmd_policy_show)

    rol = sub.add_parser("rollout", help="roll out a model without a restart: shadow, canary, promote, abort "
                         "(docs/operations.md, Rolling out a model)")
    rsub = rol.add_subparsers(dest="rollout_command", required=True)
    rstart = rsub.add_parser("start", help="name a candidate model: every worker loads it beside the serving one")
    common(rstart)
    rstart.add_argument("--model", required=True, metavar="SOURCE", help="what model.source takes (a preset, a file, "
                        "a factory); a non-preset's contract from --config's [model] or [models.<name>] table")
    rstart.add_argument("--name", help="the candidate's model.name (default: its table's, or its preset's)")
    rstart.add_argument("--version", help="the candidate's model.version, as its results carry it")
    mode = rstart.add_mutually_exclusive_group(required=True)
    mode.add_argument("--shadow", type=float, metavar="RATIO", help="also score this share of streams with the "
                      "candidate, results to topics.shadow_results")
    mode.add_argument("--canary", type=float, metavar="RATIO", help="answer this share of streams with the candidate")
    rstart.set_defaults(func=cmd_rollout)
    for name, text in (("promote", "the candidate becomes the primary, from each worker's next batch"),
                       ("abort", "withdraw the candidate: the primary alone serves")):
        p = rsub.add_parser(name, help=text)
        common(p)
        p.set_defaults(func=cmd_rollout)
    rstatus = rsub.add_parser("status", help="the desired model set and each worker's revision and state")
    common(rstatus)
    rstatus.add_argument("--json", action="store_true", help="one JSON object instead of text")
    rstatus.set_defaults(func=cmd_rollout)

    top = sub.add_parser("topics", help="create the input, results and dead-letter topics, the review and flagged "
                         "routes when set and the control topic, if missing")
    common(top)
    top.add_argument("--partitions", type=int, default=3)
    top.add_argument("--replication-factor", type=int, default=1,
                     help="replicas of each topic (3 on a three-node cluster; min.insync.replicas is the broker's)")
    top.add_argument("--max-frame-bytes", type=int, default=_default_max_frame_bytes(),
                     help="largest frame (as a Kafka record) the input and dead-letter topics take: their "
                     "max.message.bytes, raised on existing topics below it (default %(default)s: any 1080p JPEG, "
                     "a raw 720p frame)")
    top.set_defaults(func=cmd_topics)

    brk = sub.add_parser("broker", help="the local Apache Kafka (KRaft, 1 or 3 nodes) from Maven jars, no Docker")
    brk.add_argument("action", choices=["start", "stop", "status", "destroy"])
    brk.add_argument("--dir", help="state directory (default .local-kafka in the project)")
    brk.add_argument("--security", choices=["plaintext", "sasl_plaintext", "sasl_ssl", "ssl"], default="plaintext",
                     help="the clients' listener: SCRAM users admin and streamfer (sasl_*), TLS with generated "
                     "certificates (*ssl), ACLs enforced unless plaintext (see docs/security.md)")
    brk.add_argument("--nodes", type=int, choices=[1, 3], default=1,
                     help="1 broker, or a KRaft quorum of 3 combined nodes (replication factor 3, min ISR 2)")
    brk.set_defaults(func=cmd_broker)

    demo = sub.add_parser("demo", help="all in one: local broker, sample frames, the worker, a summary")
    demo.add_argument("--frames", type=int, help="synthetic frames per priority topic (default 120 with the "
                      "builtin model, 30 with a real one)")
    demo.add_argument("--keep-broker", action="store_true", help="leave the local broker running afterwards")
    demo.add_argument("--model", choices=["auto", "opennsfw", "builtin"], default="auto",
                      help="auto (default): open_nsfw when the models extra is installed, else the builtin CNN")
    demo.set_defaults(func=cmd_demo)

    _add_dlq_parsers(sub)
    _add_lag_parser(sub)
    _add_check_model_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OperatorError as exc:
        # Nothing a restart fixes: one message naming what to change, and an exit code supervisors can tell.
        where = f" (change: {exc.setting})" if exc.setting and exc.setting not in str(exc) else ""
        print(f"error: {exc}{where}", file=sys.stderr)
        return EXIT_OPERATOR_ERROR
    except StartError as exc:
        # Not an operator's to fix, and not a crash-loop's either: one line, the traceback in the debug log.
        log.debug("start-up failed", exc_info=exc)
        print(f"error: {exc} (exit {EXIT_INTERNAL_ERROR}; its traceback in the debug log: "
              "WORKER_OBSERVABILITY_LOG_LEVEL=DEBUG)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
