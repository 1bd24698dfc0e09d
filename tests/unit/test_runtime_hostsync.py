"""The start-up host-sync check: device-to-host reads in a model's forward found on a CPU, in each model form,
refused at start when CUDA graphs are to be used and a warning otherwise. (open_nsfw: tests/unit/test_runtime_onnx.py.)
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # makes "model_factories:<fn>" importable, as PYTHONPATH would

import model_factories

from worker.config import ModelSettings, RuntimeSettings
from worker.runtime import ModelContractError, load_model
from worker.runtime import start as build_module
from worker.runtime.deviceplan import DevicePlan
from worker.runtime.hostsync import (
    HostSync,
    ServingState,
    check_host_syncs,
    find_host_syncs,
    scan_graphs,
    start_up_sync_debug,
)
from worker.runtime.start import build_executor

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.* is deprecated:FutureWarning")

ITEM_MODEL = "model_factories:item_gated_model"
FACTORIES = Path(model_factories.__file__)
ITEM_LINE = next(i for i, line in enumerate(FACTORIES.read_text().splitlines(), start=1)
                 if "the host-sync line the start-up check names" in line)
SAMPLE = torch.zeros(2, 3, 16, 16)


def _line_of(fn, text: str) -> int:
    """The line of `fn`'s source that contains `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_model_reading_item_in_forward_is_refused_naming_the_operator_and_the_line():
    loaded = load_model(ModelSettings(source=ITEM_MODEL))
    with pytest.raises(ModelContractError) as err:
        check_host_syncs(loaded, refuse=True)
    message = str(err.value)
    assert f"Tensor.item at {FACTORIES}:{ITEM_LINE} `if out.mean().item() > 100.0:" in message
    assert "ItemGatedNet" in message and "runtime.cuda_graphs = false" in message
    assert err.value.setting == "model.source"


def test_on_a_cpu_the_same_check_logs_a_warning_and_the_model_runs(caplog):
    loaded = load_model(ModelSettings(source=ITEM_MODEL))
    with caplog.at_level(logging.WARNING, logger="worker.runtime.hostsync"):
        findings = check_host_syncs(loaded, refuse=False)
    assert [(f.op, f.where) for f in findings] == [("Tensor.item", f"{FACTORIES}:{ITEM_LINE}")]
    [record] = caplog.records
    assert f"Tensor.item at {FACTORIES}:{ITEM_LINE}" in record.getMessage()
    assert "runtime.cuda_graphs = true the worker refuses this model" in record.getMessage()


def test_the_executor_runs_the_check_at_start_warning_on_a_cpu(caplog):
    with caplog.at_level(logging.WARNING, logger="worker.runtime.hostsync"):
        build_executor(ModelSettings(source=ITEM_MODEL), RuntimeSettings(device="cpu")).close()
    assert any(f"{FACTORIES}:{ITEM_LINE}" in r.getMessage() for r in caplog.records)


def test_the_executor_refuses_the_model_before_any_runner_when_graphs_are_to_be_used(monkeypatch):
    """The plan a GPU with runtime.cuda_graphs = true resolves to, on this CPU: the check refuses the model before
    any runner (and any capture) exists."""
    real_resolve = build_module.resolve_plan

    def graphs_planned(runtime: RuntimeSettings):
        plan = real_resolve(runtime)
        return DevicePlan(plan.devices, plan.precision, cuda_graphs=True, buckets=(1, 2))

    runners = []
    monkeypatch.setattr(build_module, "resolve_plan", graphs_planned)
    monkeypatch.setattr(build_module, "make_engine_runner", lambda *a, **k: runners.append(a))
    with pytest.raises(ModelContractError, match=rf"Tensor.item at {FACTORIES}:{ITEM_LINE}"):
        build_executor(ModelSettings(source=ITEM_MODEL), RuntimeSettings(device="cpu"))
    assert runners == []


def test_the_builtin_model_and_a_plain_factory_model_read_nothing_on_the_host():
    for source in ("builtin", "model_factories:tiny_model"):
        loaded = load_model(ModelSettings(source=source))
        assert check_host_syncs(loaded, refuse=True) == [], source


class Masked(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        kept = flat[flat > 0]  # a boolean mask: a nonzero inside
        spread = torch.repeat_interleave(flat[:, :2], (flat[0, :2] > 0).long() + 1, dim=1)  # sized by values
        return torch.stack([kept.sum(), flat.nonzero().float().sum(), spread.sum()])[None, :2].expand(x.shape[0], 2)


def test_boolean_masks_nonzero_and_repeats_by_values_are_found_in_a_forward_and_in_torchscript():
    lines = [_line_of(Masked.forward, text) for text in ("flat[flat > 0]", "repeat_interleave", "flat.nonzero()")]
    found = find_host_syncs(Masked(), SAMPLE)
    assert [(f.op, f.where) for f in found] == [
        (op, f"{__file__}:{line}") for op, line in zip(("aten::index", "aten::repeat_interleave", "aten::nonzero"),
                                                       lines, strict=True)]
    scanned = scan_graphs(torch.jit.script(Masked()))
    assert [(f.op, f.where) for f in scanned] == [(f.op, f.where) for f in found]


class HostArithmetic(nn.Module):
    """Reads tensors on the host that are never on the device: sizes, and a tensor made without a device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(torch.tensor(x.shape).prod().item())
        on_device = torch.ones(1, device=x.device)
        return x.reshape(x.shape[0], -1)[:, :2] * (n > 0) * on_device


def test_values_that_live_on_the_host_are_not_syncs():
    assert find_host_syncs(HostArithmetic(), SAMPLE) == []


class MadeOnTheDevice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((1,), 2.0, device=x.device)
        return x.flatten(1)[:, :2] * float(scale)  # a tensor made on the input's device, read on the host


def test_a_tensor_made_on_the_inputs_device_is_followed_to_its_read():
    [found] = find_host_syncs(MadeOnTheDevice(), SAMPLE)
    assert (found.op, found.where) == ("Tensor.__float__",
                                       f"{__file__}:{_line_of(MadeOnTheDevice.forward, 'float(scale)')}")


class Scripted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.flatten(1)[:, :5]
        if bool(y.sum() > 0):
            y = y * 2
        return y


def test_a_scripted_model_is_scanned_in_its_graph_and_keeps_its_line_when_saved(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.script(Scripted()).save(str(path))
    loaded = load_model(ModelSettings(source=str(path)))
    [found] = check_host_syncs(loaded, refuse=False)
    line = _line_of(Scripted.forward, "if bool(")
    assert found == HostSync(op="aten::Bool", where=f"{__file__}:{line}", code="if bool(y.sum() > 0):",
                             found_by="TorchScript graph")


class Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1)[:, :2]


def test_a_traced_shape_is_not_a_sync():
    """Tracing records x.size(0) as a tensor read with aten::Int (prim::NumToTensor): on the host, not a sync."""
    traced = torch.jit.trace(Flatten(), SAMPLE)
    assert any(n.kind() == "aten::Int" for n in traced.inlined_graph.nodes())
    assert scan_graphs(traced) == [] and find_host_syncs(traced, SAMPLE) == []


class Exported(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, :5] * x.max().item()


def test_an_exported_program_is_found_in_its_fx_graph_with_the_line_it_records(tmp_path):
    path = tmp_path / "exported.pt2"
    torch.export.save(torch.export.export(Exported(), (SAMPLE,)), str(path))
    loaded = load_model(ModelSettings(source=str(path), input_size=SAMPLE.shape[2:]))
    found = check_host_syncs(loaded, refuse=False)
    line = _line_of(Exported.forward, ".item()")
    assert [(f.op, f.where, f.found_by) for f in found] == [("aten::item", f"{__file__}:{line}", "fx graph")]


def test_a_finding_describes_itself_as_the_message_lists_it():
    found = HostSync(op="aten::Int", where="code/__torch__/m.py:10", code="_4 = int(_3)", module="head (Linear)")
    assert found.describe() == "aten::Int at code/__torch__/m.py:10 `_4 = int(_3)` in head (Linear)"


# -- the CUDA sync-debug mode is process-wide: start-up only (issue 45, item 7) --------------------------------------
@pytest.fixture
def sync_debug_calls(monkeypatch):
    """torch.cuda's process-wide sync-debug mode, recorded (the calls need a CUDA build; the rule does not)."""
    calls: list[str] = []
    mode = ["default"]

    def set_mode(value: str) -> None:
        calls.append(value)
        mode[0] = value

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    return calls


def test_before_any_runner_serves_the_check_sets_the_sync_debug_mode_and_restores_it(sync_debug_calls):
    with start_up_sync_debug(ServingState()) as on:
        assert on and sync_debug_calls == ["error"]
    assert sync_debug_calls == ["error", "default"]


def test_once_a_runner_serves_the_check_never_sets_the_process_wide_mode(sync_debug_calls, caplog):
    serving = ServingState()
    serving.begin()
    with start_up_sync_debug(serving) as on:
        assert not on
    assert sync_debug_calls == []
    assert "runs without it" in caplog.text


def test_the_executor_checks_before_its_runners_exist_and_they_serve_after(monkeypatch):
    """The order the rule relies on: from_settings runs the check before it builds any runner."""
    order: list[str] = []
    real_check = build_module.check_host_syncs
    real_make = build_module.make_engine_runner
    monkeypatch.setattr(build_module, "check_host_syncs",
                        lambda *a, **k: (order.append("check"), real_check(*a, **k))[1])
    monkeypatch.setattr(build_module, "make_engine_runner",
                        lambda *a, **k: (order.append("runner"), real_make(*a, **k))[1])
    with build_executor(ModelSettings(), RuntimeSettings(device="cpu", warmup_batches=1)):
        pass
    assert order == ["check", "runner"]
