"""Each guard of the loop and delivery, removed in turn: the pipeline unit tests must fail every time.

    .venv/bin/python tests/guard_mutations.py

Not part of the suite (it edits the sources, runs tests/unit/test_pipeline.py, and puts them back); it shows
that every test in tests/unit/test_pipeline.py that names a guarantee can fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DELIVERY, SOURCE, PIPELINE = "worker/loop/delivery.py", "worker/kafka/consumer.py", "worker/loop/pipeline.py"
FLOW, READING = "worker/loop/flow.py", "worker/loop/admission.py"

# (guard, file, the code that implements it, the code without it)
MUTATIONS = [
    ("hold-back below the commit point", DELIVERY, "if o[0] < point)]", "if True)]"),
    ("at-least-once drops stale work", DELIVERY,
     "            if self.assignments.is_current(out.source):\n                self._awaiting_ack",
     "            if True:\n                self._awaiting_ack"),
    ("exactly-once drops stale work", DELIVERY,
     "            if not self.assignments.is_current(out.source):\n                continue\n            tp =",
     "            tp ="),
    ("messages of a partition awaiting its committed offset dropped", SOURCE,
     "            if tp in waiting:\n", "            if False:\n"),
    ("re-deliveries within an assignment dropped", SOURCE,
     "if expected is not None and source.offset < expected:", "if False:"),
    ("an aborted transaction rewinds", DELIVERY,
     "                return self._replace_stuck_sink(stuck)\n            return self._rewind()",
     "                return self._replace_stuck_sink(stuck)\n            return CommitResult.NOTHING"),
    ("a stuck producer is replaced", DELIVERY,
     "        self.sink = self._sink_factory()\n        return self._rewind()",
     "        return CommitResult.NOTHING"),
    ("reading pauses at the uncommitted cap", FLOW,
     "        if self._tracker.uncommitted() >= self._settings.max_uncommitted_frames:",
     "        if False:"),
    ("a long commit interval commits early near the uncommitted cap", DELIVERY,
     "                and self.tracker.uncommitted() < self.settings.max_uncommitted_frames // 2:",
     "                :"),
    ("a refused output is dead-lettered by reference", DELIVERY,
     "            replacement = self._replacement(out, str(exc))", "            raise"),
    ("drain waits for running batches", PIPELINE,
     "            self._inflight.dispatch(batch)\n        self._collect_finished(wait=True)\n        self._emit()",
     "            self._inflight.dispatch(batch)\n        self._emit()"),
    ("idle counts from the first assignment", PIPELINE,
     "        if self._last_activity is None:\n            return 0.0",
     "        if self._last_activity is None:\n            self._last_activity = 0.0"),
    ("exit-when-idle waits until caught up", PIPELINE,
     "                    if self.source.caught_up():", "                    if True:"),
    ("revoked partitions are committed before they go", PIPELINE,
     "        self._emit()\n        self._commit(final=True)\n        self._release(tps)",
     "        self._release(tps)"),
    ("commit outcomes served before a revocation reach its final commit", PIPELINE,
     "        self.delivery.commits_reported(commits)\n", ""),
    ("repeated frames dead-lettered", READING, "            if first is not None:\n", "            if False:\n"),
]


def main() -> int:
    survived = []
    for name, rel, guard, without in MUTATIONS:
        path = ROOT / rel
        source = path.read_text()
        if source.count(guard) != 1:
            print(f"{name}: the guard's code is not found once in {rel}; update this list")
            return 2
        path.write_text(source.replace(guard, without))
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", "tests/unit/test_pipeline.py", "-q", "-x",
                                  "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
        finally:
            path.write_text(source)
        failed = [line.split("::")[1].split(" ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED")]
        print(f"{name}: {'caught by ' + ', '.join(failed) if run.returncode else 'NOT CAUGHT'}")
        if not run.returncode:
            survived.append(name)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
