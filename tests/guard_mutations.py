import subprocess, sys, shutil
M = [
 ("M1 hold-back filter", "worker/delivery.py", "if o[0] < point)]", "if True)]"),
 ("M2 at-least-once stale filter", "worker/delivery.py", "            if self.assignments.is_current(out.source):\n                self._awaiting_ack", "            if True:\n                self._awaiting_ack"),
 ("M3 exactly-once stale filter", "worker/delivery.py", "            if not self.assignments.is_current(out.source):\n                continue\n            tp =", "            tp ="),
 ("M4 drop rebalanced", "worker/source.py", "        if self._rebalanced_in_poll:\n            messages = self._drop_rebalanced", "        if False:\n            messages = self._drop_rebalanced"),
 ("M5 redelivery guard", "worker/source.py", "if expected is not None and source.offset < expected:", "if False:"),
 ("M6 abort rewinds", "worker/delivery.py", "                return self._replace_stuck_sink(stuck)\n            return self._rewind()", "                return self._replace_stuck_sink(stuck)\n            return CommitResult.NOTHING"),
 ("M7 stuck replaced", "worker/delivery.py", "        self.sink = self._sink_factory(self.on_ack, self.on_rejected)\n        return self._rewind()", "        return CommitResult.NOTHING"),
 ("M8 refused replaced", "worker/delivery.py", "            replacement = self._replacement(out, str(exc))", "            raise"),
 ("M9 drain waits", "worker/pipeline.py", "            self._dispatch(batch)\n        self._collect_finished(wait=True)\n        self._emit()", "            self._dispatch(batch)\n        self._emit()"),
 ("M10 idle before assignment", "worker/pipeline.py", "        if self._last_activity is None:\n            return 0.0", "        if self._last_activity is None:\n            self._last_activity = 0.0"),
 ("M11 exit waits for caught_up", "worker/pipeline.py", "                    if self.source.caught_up():", "                    if True:"),
 ("M12 revoke commits first", "worker/pipeline.py", "        self._emit()\n        self._commit(final=True)\n        self._release(tps)", "        self._release(tps)"),

]
for name, path, old, new in M:
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run([".venv/bin/python", "-m", "pytest", "tests/unit/test_pipeline.py", "-q", "-p", "no:cacheprovider", "-x", "--timeout", "60"], capture_output=True, text=True)
        last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l][-1:]
        failed = [l.split("::")[1].split(" ")[0] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name}: {'CAUGHT' if r.returncode else 'NOT CAUGHT'} {failed} {last}")
    finally:
        open(path, "w").write(src)
