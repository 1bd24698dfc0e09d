"""Device planning at start-up: runtime settings resolved to concrete devices, precision, CUDA-graph buckets and
the data path (checked against what this machine supports: ConfigError otherwise), one memory policy per GPU, and
the executor's one-line description of it all."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.config import ConfigError, RuntimeSettings
from worker.devices.memory import NVJPEG_HEADROOM_BYTES, MemoryPolicy, MemoryProbe
from worker.runtime.contract import ModelContract
from worker.runtime.runners import CudaMemoryProbe


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's memory policy and the probe that measures it; the runners of one device share one."""

    policy: MemoryPolicy
    probe: MemoryProbe


@dataclass(frozen=True)
class DevicePlan:
    """Devices, precision and graph sizes resolved from RuntimeSettings."""

    devices: tuple[torch.device, ...]
    precision: str
    cuda_graphs: bool
    buckets: tuple[int, ...] = ()
    # runtime.decode resolved: frames decoded and resized on the runner's device (devicepath), else on the host.
    decode_on_device: bool = False


def resolve_plan(runtime: RuntimeSettings) -> DevicePlan:
    """RuntimeSettings -> concrete devices and checks of what this machine supports; ConfigError otherwise."""
    requested = runtime.device
    cuda_ok = torch.cuda.is_available()
    if requested == "auto":
        requested = "cuda" if cuda_ok else "cpu"
    if requested == "cpu":
        devices: tuple[torch.device, ...] = (torch.device("cpu"),)
    elif requested.startswith("cuda"):
        if not cuda_ok:
            raise ConfigError([f"runtime.device: {runtime.device!r} asks for a GPU but torch sees none "
                               "(torch.cuda.is_available() is False); use 'auto' or 'cpu'"])
        count = torch.cuda.device_count()
        if requested == "cuda":
            devices = tuple(torch.device("cuda", i) for i in range(count))
        else:
            try:
                index = int(requested.split(":", 1)[1])
            except ValueError:
                raise ConfigError([f"runtime.device: {runtime.device!r} is not cuda:N"]) from None
            if not 0 <= index < count:
                raise ConfigError([f"runtime.device: {runtime.device!r} but only {count} GPU(s) are visible"])
            devices = (torch.device("cuda", index),)
    else:
        raise ConfigError([f"runtime.device: {runtime.device!r} must be auto, cpu, cuda or cuda:N"])
    on_cuda = devices[0].type == "cuda"
    if runtime.precision == "fp16" and not on_cuda:
        raise ConfigError(["runtime.precision: fp16 autocast needs a CUDA device; on cpu use fp32 or bf16"])
    if runtime.precision == "bf16" and on_cuda and not all(_bf16_ok(d) for d in devices):
        raise ConfigError(["runtime.precision: this GPU does not support bf16; use fp16 or fp32"])
    cuda_graphs = on_cuda and runtime.cuda_graphs
    buckets = tuple(sorted(set(runtime.graph_batch_sizes))) if cuda_graphs else ()
    decode_on_device = runtime.decode == "device" or (runtime.decode == "auto" and on_cuda)
    return DevicePlan(devices=devices, precision=runtime.precision, cuda_graphs=cuda_graphs, buckets=buckets,
                 decode_on_device=decode_on_device)


def check_device_decode_at_start(runtime: RuntimeSettings, devices: Sequence[torch.device]) -> None:
    """The device data path decodes a JPEG on every device before the model loads; ConfigError saying why not."""
    why = f"runtime.decode = {runtime.decode!r} decodes on {', '.join(str(d) for d in devices)}"
    try:
        from worker.runtime.devicepath import check_device_decode  # torchvision: ~1.3 s to import
    except ImportError as exc:
        raise ConfigError([f"runtime.decode: {why} with torchvision, which cannot be imported ({exc}); install "
                           "torchvision for this torch (pip install torchvision), or set runtime.decode = \"cpu\""]
                          ) from exc
    for device in devices:
        try:
            check_device_decode(device)
        except Exception as exc:  # any failure: the path cannot work here, said at start
            raise ConfigError([f"runtime.decode: {why}, but torchvision cannot decode a JPEG on {device} "
                               f"({type(exc).__name__}: {str(exc).strip()[:300]}); set runtime.decode = \"cpu\" "
                               "to decode on the host"]) from exc


def device_decode_serves(contracts: Sequence[ModelContract], runtime: RuntimeSettings) -> bool:
    """Whether the device data path serves these models: it decodes each frame once, to one channel count, then
    resizes for each model, so models that take different channel counts (grey and colour) are decoded on the host.
    `auto` then falls back to the host; `device` is refused here, the one place it is, with ConfigError."""
    channels = sorted({c.channels for c in contracts})
    if len(channels) == 1:
        return True
    if runtime.decode == "device":
        raise ConfigError([f"runtime.decode: \"device\" decodes each frame once to one channel count, but the models "
                           f"take {' and '.join(map(str, channels))} channels; set runtime.decode = \"cpu\" or "
                           "\"auto\" (which then decodes on the host)"])
    return False


def device_memories(plan: DevicePlan, runtime: RuntimeSettings, runners: int) -> dict[torch.device, DeviceMemory]:
    """On GPUs, one memory policy per device from its own total memory, counting its `runners` (instances_per_device)
    as batches that may run on it at once; none on CPU. Untested without a GPU: the policies are tested with fake
    probes (tests/unit/test_memorypolicy.py, test_graphplan.py, test_runtime_executor.py)."""
    if plan.devices[0].type != "cuda":
        return {}
    out = {}
    for device in plan.devices:
        probe = CudaMemoryProbe(device)
        policy = MemoryPolicy(probe.total_bytes(), runtime.memory_fraction, runners=runners,
                              headroom_bytes=NVJPEG_HEADROOM_BYTES if plan.decode_on_device else 0)
        out[device] = DeviceMemory(policy, probe)
    return out


def graph_memory(memory: DeviceMemory | None, runners: int) -> tuple[MemoryPolicy | None, int | None]:
    """A runner's memory policy (its device's) and graph budget: the device's, shared equally by its `runners`,
    each keeping its own graphs."""
    if memory is None:
        return None, None
    return memory.policy, memory.policy.graph_budget_bytes // runners


def _bf16_ok(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported()


def loaded_precision(plan: DevicePlan, precisions: Sequence[str]) -> DevicePlan:
    """The plan with the precision its models were loaded at, where a loader chose one ("" keeps the plan's): int8
    falls back to fp32 where it does not pay (worker.runtime.quantize)."""
    chosen = "+".join(dict.fromkeys(p or plan.precision for p in precisions)) or plan.precision
    return dataclasses.replace(plan, precision=chosen)


def describe(plan: DevicePlan, kind: str, engine: str = "torch", runners: int = 1,
             session_threads: int | None = None) -> str:
    """One line for the start-up log and check-model: devices, runners, precision, engine, model kind, decode."""
    if plan.devices[0].type == "cpu":
        threads = session_threads if engine == "onnxruntime" and session_threads else torch.get_num_threads()
        each = f"{threads} thread{'' if threads == 1 else 's'}"
        where = f"cpu ({runners} runners x {each})" if runners > 1 else f"cpu ({each})"
    else:
        names = sorted({torch.cuda.get_device_name(d) for d in plan.devices})
        where = f"{', '.join(str(d) for d in plan.devices)} ({', '.join(names)})"
    mode = engine if engine != "torch" else (
        f"torch cuda graphs {list(plan.buckets)}" if plan.cuda_graphs else "torch eager")
    decode = "frames decoded on the device" if plan.decode_on_device else "frames decoded on the host"
    return f"{where}, {plan.precision}, {mode}, {kind} model, {decode}"
