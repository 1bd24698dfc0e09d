"""docs/testing.md's example test runs as written, in a pytest of its own, with the plugin as users get it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "testing.md"

pytestmark = pytest.mark.integration


def example_code() -> str:
    """The one ```python block of the doc's "## Example" section."""
    section = DOC.read_text(encoding="utf-8").split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return code


def test_the_example_is_a_test_file() -> None:
    code = example_code()
    compile(code, "example", "exec")
    assert re.findall(r"^def (test_\w+)", code, re.MULTILINE)


def test_the_documented_example_passes_against_the_real_worker(kafka_bootstrap: str, tmp_path: Path) -> None:
    (tmp_path / "test_example.py").write_text(example_code(), encoding="utf-8")
    installed = any(ep.name == "worker.testing.plugin" for ep in entry_points(group="pytest11"))
    # A checkout that is not pip-installed lacks the entry point: load the plugin by name instead.
    plugin = [] if installed else ["-p", "worker.testing.plugin"]
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                           "test_example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b2 passed\b", proc.stdout), proc.stdout[-2000:]
