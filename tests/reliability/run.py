"""The reliability suite: inject each fault against a real Kafka broker and print what a read_committed
verifier saw, per fault and delivery mode.

    python tests/reliability/run.py [--quick] [--mode at_least_once|exactly_once|both] [--soak SECONDS]
                                   [--faults sigkill,churn,...] [--runs N] [--no-config]
                                   [--worker-ids fixed|default|fresh|all] [--cpu-load N]

Every input message is accounted for by its source coordinates: lost = produced but neither a result nor a
dead letter; duplicated = answered more than once (exactly-once must show 0; at-least-once stays within the
frames in flight at each fault); and no partition's committed offset may move backwards (read from
__consumer_offsets). Recovery: per fault and input partition it left waiting, seconds from the fault to the
partition's first answer after it (from the answers' append timestamps), median / max over a row's runs. The faults
that replace a worker process run with fixed worker ids, the worker's default ones (`<hostname>-<slot>`) and/or a
fresh id per process (a new transactional id each time), as --worker-ids says. The faults are in
tests/reliability/faults.py; the pytest tests there assert the same outcomes (this runner lives with them, as
bench/ imports nothing from tests/; `./dev bench` runs its smoke as a process). The broker: KAFKA_BOOTSTRAP_SERVERS
if set (the broker faults then need STREAMFER_TEST_BROKER_DIR naming a broker this suite may restart, else they
are skipped), otherwise a local Apache Kafka of its own, destroyed at the end. Writes
bench/results/reliability.json; exits 1 when a run broke its mode's promise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages (tests, worker) by name
sys.path.append(str(ROOT / "bench"))  # the benchmarks' JSON and table helpers; appended: never shadows a module

import common  # noqa: E402
from common import markdown_table  # noqa: E402

from tests.reliability import configcases, faults  # noqa: E402
from tests.reliability.harness import MODES, WORKER_IDS, Audit, Lab, RunOutcome, cpu_load  # noqa: E402
from tests.reliability.recovery import RecoverySummary  # noqa: E402
from worker.tools.local_broker import LocalKafka  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "reliability.json"
# Faults that stop the broker run last: with a broker that comes back elsewhere, the rest still runs.
BROKER_FAULTS = ("broker-restart", "broker-kill9", "output-down")
COLUMNS = ("fault", "mode", "runs", "produced", "results", "dead letters", "lost", "duplicated", "misrouted",
           "crashes", "recovery s (median / max)", "seconds", "verdict")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    modes = MODES if args.mode == "both" else (args.mode,)
    scale = faults.QUICK if args.quick else faults.FULL
    runs = args.runs or (1 if args.quick else 3)
    chosen = [f for f in faults.FAULTS if not args.faults or f in args.faults]
    chosen.sort(key=lambda f: f in BROKER_FAULTS)
    workdir = Path(tempfile.mkdtemp(prefix="streamfer-reliability-"))
    # The cluster faults run on a three-node cluster of their own; the rest on one broker.
    cluster_faults = [f for f in chosen if f in faults.CLUSTER_FAULTS]
    chosen = [f for f in chosen if f not in faults.CLUSTER_FAULTS] + cluster_faults
    lab = _lab(workdir) if len(cluster_faults) < len(chosen) or not args.no_config or args.soak else None
    cluster_lab = None
    report: dict[str, Any] = {"benchmark": "reliability", "machine": common.machine(), "args": vars(args),
                              "workdir": str(workdir), "rows": [], "config": None, "soak": []}
    try:
        with cpu_load(args.cpu_load):
            for fault in chosen:
                if fault in faults.CLUSTER_FAULTS and cluster_lab is None:
                    _log("starting a three-node Kafka cluster for the cluster faults")
                    cluster_lab = Lab.with_own_cluster(workdir)
                where = cluster_lab if fault in faults.CLUSTER_FAULTS else lab
                assert where is not None
                _faults(report, [fault], modes, where, scale, runs, args.worker_ids)
        if not args.no_config and lab is not None:
            report["config"] = _config(lab.bootstrap)
        for mode in modes if args.soak and lab is not None else ():
            _log(f"soak [{mode}] for {args.soak:.0f} s")
            report["soak"].append(_soak_row(faults.soak(lab, mode, args.soak, args.soak_rate)))
    finally:
        for each in (lab, cluster_lab):
            if each is not None:
                each.close()
    print(render(report))
    common.write_json(Path(args.out).stem, report, Path(args.out).parent)
    _log(f"worker logs under {workdir}")
    failed = any(r["verdict"].startswith("FAIL") for r in report["rows"] + report["soak"])
    failed |= bool(report["config"] and report["config"]["failures"])
    return 1 if failed else 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller runs, one of each (about 10 minutes)")
    p.add_argument("--mode", choices=[*MODES, "both"], default="both")
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS", help="also soak this long per mode")
    p.add_argument("--soak-rate", type=float, default=100.0, metavar="FPS", help="soak rate (default 100)")
    p.add_argument("--faults", type=lambda s: [f for f in s.split(",") if f],
                   help=f"only these, comma-separated: {','.join(faults.FAULTS)}")
    p.add_argument("--runs", type=int, help="runs per fault and mode (default 3, --quick 1)")
    p.add_argument("--no-config", action="store_true", help="skip the bad-configuration checks")
    p.add_argument("--cpu-load", type=int, default=0, metavar="N",
                   help="run the faults with N busy processes competing for the CPU (default 0)")
    p.add_argument("--worker-ids", choices=[*WORKER_IDS, "all"], default="all",
                   help="how the faults that replace a worker process name the new one: fixed (the same worker id, "
                        "so the same transactional id), default (none set, as a user gets it: the worker's own "
                        "<hostname>-<slot>, which a restart on the same host takes again), fresh (a new id per "
                        "process, as a replacement pod of a Deployment gets), or all (default; the other faults "
                        "always run with fixed ids)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON report path")
    args = p.parse_args(argv)
    unknown = set(args.faults or ()) - set(faults.FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {', '.join(faults.FAULTS)}")
    return args


def _faults(report: dict[str, Any], chosen: list[str], modes: tuple[str, ...], lab: Lab, scale: faults.Scale,
            runs: int, worker_ids: str) -> None:
    for fault in chosen:
        for ids in _worker_ids(worker_ids, fault):
            for mode in modes:
                row = _row(fault, mode, [_run(lab.with_worker_ids(ids), fault, mode, scale, i) for i in range(runs)])
                row["worker ids"] = ids
                report["rows"].append(row)
                _log(f"{fault} [{mode}, {ids} worker ids]: {row['verdict']} ({row.get('seconds')} s)")


def _worker_ids(choice: str, fault: str) -> tuple[str, ...]:
    """The worker-id policies to run a fault with: only the faults that replace a process can tell them apart."""
    if choice != "all":
        return (choice,)
    return WORKER_IDS if fault in faults.REPLACE_WORKERS else ("fixed",)


def _lab(workdir: Path) -> Lab:
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not given:
        _log("starting a local Kafka broker for the suite")
        return Lab.with_own_broker(workdir)
    broker_dir = os.environ.get("STREAMFER_TEST_BROKER_DIR")
    broker = LocalKafka(broker_dir) if broker_dir else None
    return Lab(workdir, fixed_bootstrap=given, broker=broker)


def _run(lab: Lab, fault: str, mode: str, scale: faults.Scale, index: int) -> RunOutcome | None:
    try:
        return faults.FAULTS[fault](lab, mode, scale)
    except Exception as exc:  # noqa: BLE001 ( a harness failure is a row, not the end of the suite)
        _log(f"{fault} [{mode}] run {index + 1}: harness error {type(exc).__name__}: {exc}")
        return RunOutcome(fault, mode, Audit(), [], {}, 0.0, 0, 0, notes={"stuck": f"harness error: {exc}"})


def _row(fault: str, mode: str, outcomes: list[RunOutcome | None]) -> dict[str, Any]:
    done = [o for o in outcomes if o is not None]
    if not done:
        return {"fault": fault, "mode": mode, "runs": 0, "verdict": "skipped (needs a broker it may restart)"}
    total = Audit()
    for o in done:
        total.add(o.audit)
    problems = [p.splitlines()[0] for o in done for p in o.problems()]
    recovery = RecoverySummary.of(r for o in done for r in o.recovery)
    return {
        "fault": done[0].fault, "key": fault, "mode": mode, "runs": len(done), "produced": total.produced,
        "results": total.results, "dead letters": total.dead_letters, "lost": total.lost,
        "duplicated": total.duplicated, "misrouted": total.misrouted,
        "crashes": sum(len(o.crashes) for o in done), "recovery s (median / max)": recovery.cell(),
        "recovery": dataclasses.asdict(recovery), "seconds": round(sum(o.seconds for o in done)),
        "faults injected": sum(o.faults_injected for o in done),
        "verdict": "FAIL" if problems else "ok",
        "problems": problems, "notes": [o.notes for o in done], "logs": [o.logdir for o in done],
    }


def _config(bootstrap: str) -> dict[str, Any]:
    _log(f"bad configuration: {len(configcases.CASES)} cases")
    outcomes = configcases.run_cases(bootstrap)
    failures = {name: configcases.problems(configcases.CASES[name], got) for name, got in outcomes.items()}
    failures = {name: p for name, p in failures.items() if p}
    return {"cases": len(outcomes), "ok": len(outcomes) - len(failures), "failures": failures}


def _soak_row(outcome: RunOutcome) -> dict[str, Any]:
    s = outcome.notes.get("soak", {})
    return {"fault": outcome.fault, "mode": outcome.mode, "produced": outcome.audit.produced,
            "lost": outcome.audit.lost, "duplicated": outcome.audit.duplicated,
            "verdict": "ok" if not outcome.problems() else "FAIL", "problems": outcome.problems(), **s}


# -- output -----------------------------------------------------------------------------------------------------
def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"streamfer reliability suite, {m['date']} on {m['host_cpu']} ({m['cpu_cores']} CPUs), at {m['commit']}",
             "", *markdown_table(COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in report["rows"]])]
    problems = [(r["fault"], r["mode"], p) for r in report["rows"] for p in r.get("problems", [])]
    if problems:
        lines += ["", "problems:"]
        lines += [f"  {fault} [{mode}]: {p[:300]}" for fault, mode, p in problems]
    if report["config"]:
        c = report["config"]
        lines += ["", f"bad configuration: {c['ok']} of {c['cases']} invalid settings stop start-up with exit "
                  "code 2 naming the setting"]
        lines += [f"  {name}: {'; '.join(p)}" for name, p in c["failures"].items()]
    if report["soak"]:
        cols = ("mode", "produced", "lost", "duplicated", "p50 ms (thirds)", "p99 ms (thirds)", "p99 drift ms",
                "RSS MiB warm", "RSS growth MiB", "max lag", "verdict")
        soak_rows = [[r["mode"], r["produced"], r["lost"], r["duplicated"], "/".join(map(str, r.get("p50_ms", []))),
                      "/".join(map(str, r.get("p99_ms", []))), r.get("p99_drift_ms"), r.get("rss_warm_mib"),
                      r.get("rss_growth_mib"), r.get("max_lag"), r["verdict"]] for r in report["soak"]]
        lines += ["", f"soak: {report['soak'][0]['fault']}", *markdown_table(cols, soak_rows)]
    return "\n".join(lines)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
