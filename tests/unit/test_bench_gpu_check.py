"""bench/gpu_check.py's section runner, where no GPU runs it: each section in a process of its own under its own cap,
so one that raises or hangs costs only that cap, and every section that ended has its files in the output folder.

The sections here are this module's functions (`run_plan` takes the section list), run by the real runner as any
section is: in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import gpu_check

HERE = "tests.unit.test_bench_gpu_check"
HANG_CAP_S = 4.0
ROOMY_CAP_S = 90.0  # a section that ends by itself: far more than it takes, so a raise ending early shows


def ends(check: Any, section: Any) -> None:
    section.add("figure", f"measured on {check.device()}")


def raises(check: Any, section: Any) -> None:
    section.add("before the raise", "kept")
    raise RuntimeError("made to raise")


def hangs(check: Any, section: Any) -> None:
    section.add("before the hang", "kept")
    threading.Event().wait()  # never set: only the cap ends this


def spec(name: str, function: str, cap_s: float = ROOMY_CAP_S, needs_cuda: bool = False) -> gpu_check.Spec:
    return gpu_check.Spec(name, f"a section that {function}", f"{HERE}:{function}", cap_s, needs_cuda=needs_cuda)


def files(out: Path, name: str) -> dict[str, Any]:
    folder = out / "sections"
    assert (folder / f"{name}.md").read_text().startswith(gpu_check.TABLE_HEAD)
    return json.loads((folder / f"{name}.json").read_text())


def test_a_section_that_raises_or_hangs_costs_only_its_own_cap_and_every_section_that_ended_has_its_files(
        tmp_path: Path) -> None:
    plan = [spec("first", "ends"), spec("raising", "raises"), spec("hanging", "hangs", HANG_CAP_S),
            spec("after", "ends"), spec("gpu_only", "ends", needs_cuda=True)]
    opts = gpu_check.Options(cuda=False, out=tmp_path, budget_s=600.0, torch_threads=1, quick=True)
    t0 = time.monotonic()
    sections = {s.name: s for s in gpu_check.run_plan(plan, opts)}
    elapsed = time.monotonic() - t0

    assert [s.status for s in sections.values()] == ["ok", "failed", "timeout", "ok", "skipped"]
    # The raise ends its section at once, its row before it kept, its error named.
    raising = files(tmp_path, "raising")
    assert raising["status"] == "failed" and raising["reason"] == "RuntimeError: made to raise"
    assert raising["rows"] == [["before the raise", "kept"]] and sections["raising"].seconds < ROOMY_CAP_S / 3
    # The hang costs its cap and no more; its row before the hang is kept.
    hanging = files(tmp_path, "hanging")
    assert hanging["status"] == "timeout" and "cap of 4s" in hanging["reason"]
    assert hanging["rows"] == [["before the hang", "kept"]]
    assert HANG_CAP_S <= sections["hanging"].seconds < HANG_CAP_S + 5.0
    # The sections before and after ran, each with its own files; the skipped one says why.
    for name in ("first", "after"):
        assert files(tmp_path, name)["status"] == "ok"
        assert files(tmp_path, name)["rows"] == [["figure", "measured on cpu"]]
    assert files(tmp_path, "gpu_only")["reason"] == "needs CUDA (torch sees no GPU, or --cpu)"
    # The summary has every section in plan order, the hang's included; the whole run waited on no cap but the hang's.
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in summary["sections"]] == [s.name for s in plan]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| hanging | timeout: ran past its cap of 4s" in md and "| raising | failed: RuntimeError" in md
    assert elapsed < ROOMY_CAP_S


def test_a_section_that_does_not_fit_the_budget_left_is_skipped_saying_so(tmp_path: Path) -> None:
    plan = [spec("big", "ends", cap_s=1000.0)]
    opts = gpu_check.Options(cuda=False, out=tmp_path, budget_s=100.0, torch_threads=1, quick=True)
    [big] = gpu_check.run_plan(plan, opts)
    assert big.status == "skipped" and big.reason.startswith("budget: ") and "cap is 1000s" in big.reason
    assert files(tmp_path, "big")["status"] == "skipped"


def test_the_plan_runs_the_smoke_step_first_and_the_device_path_and_end_to_end_before_the_cpu_path() -> None:
    names = [s.name for s in gpu_check.PLAN]
    assert names[0] == "smoke" and gpu_check.PLAN[0].cap(cuda=True) == 45
    assert names.index("e2e_device") < names.index("limit_device") < names.index("e2e_cpu")
    assert max(names.index("e2e_device"), names.index("limit_device")) < min(names.index("e2e_cpu"),
                                                                            names.index("limit_cpu"))
    for s in gpu_check.PLAN:  # every target resolves, as its process will resolve it
        module, function = s.target.split(":")
        assert callable(getattr(__import__(module), function)), s.target


def test_only_names_known_sections() -> None:
    proc = subprocess.run([sys.executable, gpu_check.__file__, "--cpu", "--only", "smoke,nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown section(s) nope" in proc.stderr


def test_the_dev_script_installs_the_carried_wheels_by_their_pinned_names() -> None:
    """A stale wheel of another version left in .whl/ must not be installed beside the pinned one."""
    dev = (Path(gpu_check.REPO) / "dev").read_text()
    body = dev[dev.index("gpu_check() {"):dev.index("\n}\n", dev.index("gpu_check() {"))]
    install = body[body.index("pip install"):]
    assert "$GPU_WHEELS" in install and ".whl/*.whl" not in install


def test_the_processes_section_reads_nvidia_smis_memory_per_process_and_nothing_where_it_does_not_answer(
        tmp_path, monkeypatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '4242, 1530\\n4243, 1498.5\\nnot a row\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_check._device_memory_by_pid() == {4242: 1530.0, 4243: 1498.5}
    fake.write_text("#!/bin/sh\nexit 9\n")
    assert gpu_check._device_memory_by_pid() == {}
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gpu_check._device_memory_by_pid() == {}
