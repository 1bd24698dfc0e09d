"""The test kit's pure parts: settings become the worker's env vars, the plugin is registered once whether it
comes from the installed entry point or from this checkout's conftest, the in-memory kit (clock, ledger) and
docs/testing.md's example of the real loop over it, run as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from worker.config import load_settings
from worker.frames import SourceRef
from worker.testing import DEAD_LETTER, EITHER, RESULT, FakeClock, FrameLedger, settings_env

ROOT = Path(__file__).resolve().parents[2]


def test_nested_settings_become_worker_env_vars() -> None:
    env = settings_env({"batching": {"max_batch_size": 8, "realtime": {"max_wait_ms": 5},
                                     "preferred_batch_sizes": [4, 8], "tenant_weights": {"a": 2, "b": 1}},
                        "delivery": {"mode": "exactly_once"}, "observability": {"metrics_enabled": False}})
    assert env == {"WORKER_BATCHING_MAX_BATCH_SIZE": "8", "WORKER_BATCHING_REALTIME_MAX_WAIT_MS": "5",
                   "WORKER_BATCHING_PREFERRED_BATCH_SIZES": "4,8", "WORKER_BATCHING_TENANT_WEIGHTS": "a=2,b=1",
                   "WORKER_DELIVERY_MODE": "exactly_once", "WORKER_OBSERVABILITY_METRICS_ENABLED": "false"}


def test_the_worker_reads_those_env_vars_back_as_the_same_settings() -> None:
    settings = load_settings(None, env=settings_env({"batching": {"max_batch_size": 8, "realtime": {"max_wait_ms": 5},
                                                                  "tenant_weights": {"a": 2}},
                                                     "observability": {"metrics_enabled": False}}))
    assert settings.batching.max_batch_size == 8
    assert settings.batching.realtime.max_wait_ms == 5
    assert settings.batching.tenant_weights == {"a": 2}
    assert settings.observability.metrics_enabled is False


def test_the_entry_point_and_the_conftest_name_the_plugin_alike() -> None:
    # pytest skips a pytest_plugins entry already registered under that name: the same name means once.
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    assert entry_points == {"worker.testing.plugin": "worker.testing.plugin"}
    conftest = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    (assign,) = [n for n in conftest.body if isinstance(n, ast.Assign) and n.targets[0].id == "pytest_plugins"]
    assert ast.literal_eval(assign.value) == ["worker.testing.plugin"]


# -- the in-memory kit ----------------------------------------------------------------------------------------------
def kit_example() -> str:
    """The ```python block of docs/testing.md's in-memory kit section."""
    doc = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    section = doc.split("\n## The in-memory kit", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return code


def test_the_docs_example_runs_the_real_loop_over_the_kit_as_written() -> None:
    code = kit_example()
    assert len(code.strip().splitlines()) <= 20
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/testing.md", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    assert tests
    for test in tests:
        test()


def test_the_plugin_loads_the_kit_only_when_asked() -> None:
    """pytest loads the plugin in every session where streamfer is installed: Kafka and Avro wait for first use."""
    check = ("import sys, worker.testing.plugin, worker.testing as t; assert 'confluent_kafka' not in sys.modules; "
             "assert 'fastavro' not in sys.modules; t.FakeConsumer; assert 'confluent_kafka' in sys.modules")
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


def test_the_kit_imports_without_pytest() -> None:
    """The helpers serve the benchmarks and scripts too: only the plugin module (worker.testing.plugin) needs pytest."""
    check = "import sys, worker.testing as t; t.FrameProducer, t.run_worker; assert 'pytest' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


def test_no_kit_module_shadows_a_name_the_kit_exports() -> None:
    """Importing a submodule sets it on the package: a module `ledger` would replace the function `ledger`."""
    import worker.testing as kit

    modules = {module.rsplit(".", 1)[1] for module in kit._KIT}
    assert not modules & set(kit._KIT_MODULE)


def test_the_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(10.0)
    assert clock() == clock() == 10.0
    clock.advance(0.5)
    assert clock() == 10.5


def ref(offset: int, partition: int = 0) -> SourceRef:
    return SourceRef("frames.bulk", partition, offset)


def test_the_ledger_names_lost_duplicated_phantom_and_misrouted_messages() -> None:
    book = FrameLedger()
    for offset in range(4):
        book.sent(ref(offset))
    book.sent(ref(4), DEAD_LETTER)
    book.sent(ref(5), EITHER)
    for offset in (0, 1, 1, 4, 5):
        book.answered(ref(offset), RESULT)
    book.answered(ref(9), RESULT)
    book.answered(None, DEAD_LETTER)
    assert book.lost() == [ref(2), ref(3)]
    assert book.duplicated() == {ref(1): [RESULT, RESULT]} and book.duplicates == 1
    assert book.phantoms == 2  # offset 9 was never sent; one dead letter names no message
    assert book.misrouted() == [ref(4)]  # garbage scored; either answer is fine for offset 5


def test_below_the_commit_an_unanswered_message_is_lost_above_it_unread() -> None:
    book = FrameLedger()
    for offset in range(5):
        book.sent(ref(offset))
    book.add_results([{"source_topic": "frames.bulk", "source_partition": 0, "source_offset": o} for o in (0, 3)])
    committed = {("frames.bulk", 0): 2}
    assert book.lost(committed) == [ref(1)]
    assert book.answered_at_or_above(committed) == 1


def test_a_dead_letter_is_placed_by_its_source_headers() -> None:
    book = FrameLedger()
    book.sent(ref(7), DEAD_LETTER)
    book.add_dead_letters([{"streamfer.source_topic": "frames.bulk", "streamfer.source_partition": "0",
                            "streamfer.source_offset": "7"}, {"streamfer.source_topic": "frames.bulk"}])
    assert book.lost() == [] and book.misrouted() == [] and book.phantoms == 1
