"""The start-up host-sync check: where a model's forward reads device values on the host.

A forward that calls `.item()`, `int()` / `bool()` on a tensor, `.tolist()`, `.cpu()`, or an operator whose output
size depends on the data (`nonzero`, boolean masks, `unique`) makes the host wait for the device on every batch, and
no CUDA graph can capture it: the capture fails on the GPU with `cudaErrorStreamCaptureUnsupported`. This module
finds such places before any capture, on any device, so a model that would not capture is caught on a laptop:

- statically, in TorchScript graphs (`inlined_graph`: `aten::Int`, `aten::item`, `aten::Bool`, ... on a tensor)
  and in fx graphs of aten operators (torch.export), naming the source line each node records;
- by running one forward on the start-up batch under a dispatch mode that records those operators, with the
  Python line that called them and the submodule they ran in. On a CPU every tensor is on the host, so the
  check follows what would be on the device (the input, the model's parameters and buffers, tensors made with
  an explicit `device=`, and everything computed from those). On a CPU a TorchScript model whose graph calls
  no Python is all in its graph, and this forward is skipped;
- on a GPU, also under `torch.cuda.set_sync_debug_mode("error")`, which names any other synchronizing call. That
  mode is process-wide: it is set only at start-up, before any runner of the process serves (`SERVING`), since
  another thread's batch would fail under it; afterwards the check runs without it.

`check_host_syncs` is what the worker runs at start-up: it refuses the model (`HostSyncError`) when CUDA
graphs are to be used, and logs a warning otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from worker.runtime.contract import ModelContractError
from worker.runtime.models import LoadedModel, validation_input

log = logging.getLogger(__name__)

# Operators that hand a tensor's value to the host (TorchScript / aten names, without the namespace).
SCALAR_READS = frozenset({"Int", "Float", "Bool", "Complex", "item", "tolist", "_local_scalar_dense", "is_nonzero",
                          "equal", "allclose", "ScalarImplicit", "IntImplicit", "FloatImplicit", "ComplexImplicit",
                          "cpu", "numpy"})
# Operators whose output size depends on the values: the host waits for the device to size the result.
DATA_DEPENDENT_SHAPES = frozenset({"nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique", "_unique",
                                   "_unique2", "unique_dim", "unique_consecutive", "bincount"})
# ... and these only when given a boolean mask (indexing with it is a nonzero) or tensor repeats.
_MASK_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_MASK_MAKERS = frozenset({"gt", "ge", "lt", "le", "eq", "ne", "logical_and", "logical_or", "logical_xor",
                          "logical_not", "isnan", "isinf", "isfinite", "__and__", "__or__", "__xor__", "__not__"})
# Tensor methods that read values on the host, seen above the dispatcher (some never reach it on a CPU tensor).
_HOST_READ_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                                "__complex__", "__array__", "__format__"})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_TRACED_FRAME = re.compile(r"^(.+)\((\d+)\): \S+$")


class ServingState:
    """Process-wide: whether any runner has begun serving (warmed up or run a batch); runners say so themselves."""

    def __init__(self) -> None:
        self.began = False

    def begin(self) -> None:
        self.began = True


SERVING = ServingState()


@dataclass(frozen=True)
class HostSync:
    """One place where the model's forward reads device values on the host."""

    op: str  # the operator or tensor method, e.g. "aten::Int", "Tensor.item", "aten::nonzero"
    where: str = ""  # "file:line" of the source that calls it, "" when unknown
    code: str = ""  # that source line
    module: str = ""  # the submodule it ran in, e.g. "features.3 (Gate)"
    found_by: str = "forward"  # "TorchScript graph", "fx graph", "forward" or "CUDA sync debug"

    def describe(self) -> str:
        text = self.op
        if self.where:
            text += f" at {self.where}"
        if self.code:
            text += f" `{self.code}`"
        if self.module:
            text += f" in {self.module}"
        return text


HOST_SYNC_FIX = ("keep those values on the device (torch.where, masks instead of indexing, shapes from x.shape or "
                 "constants in the exported graph)")


class HostSyncError(ModelContractError):
    """The model's forward reads device values on the host where CUDA graphs are to be used; `findings` name
    each place (the message lists them), so a tool can show them one by one."""

    def __init__(self, kind: str, findings: Sequence[HostSync]) -> None:
        listed = "; ".join(f.describe() for f in findings)
        super().__init__(
            f"the {kind} model's forward reads device values on the host, which no CUDA graph can capture: "
            f"{listed}; {HOST_SYNC_FIX}, or set runtime.cuda_graphs = false to run it eager"
        )
        self.findings = tuple(findings)


def check_host_syncs(loaded: LoadedModel, refuse: bool) -> list[HostSync]:
    """Find host syncs in `loaded`'s forward; with `refuse` (CUDA graphs to be used) raise HostSyncError
    naming them, else log one warning. Returns the findings (empty for a model that can be captured)."""
    if loaded.engine != "torch":  # issue 61: an onnxruntime session reads no device value; nothing to capture
        return []
    findings = find_host_syncs(loaded.module, validation_input(loaded.contract, loaded.device))
    if not findings:
        return findings
    if refuse:
        raise HostSyncError(loaded.kind, findings)
    log.warning("the %s model's forward reads device values on the host (%d place(s)): %s; on a GPU with "
                "runtime.cuda_graphs = true the worker refuses this model: %s", loaded.kind, len(findings),
                "; ".join(f.describe() for f in findings), HOST_SYNC_FIX)
    return findings


def find_host_syncs(module: Callable[[torch.Tensor], Any], sample: torch.Tensor) -> list[HostSync]:
    """The graphs' host syncs, then those one forward on `sample` runs into (deduplicated by source line).

    A TorchScript model whose graph calls no Python is all in its graph: on a CPU the forward would find nothing
    more, so it is skipped (for open_nsfw it is most of the check's cost); on a GPU it runs, under the CUDA sync
    debug mode."""
    static = scan_graphs(module) if isinstance(module, nn.Module) else []
    if not sample.is_cuda and _all_in_its_graph(module):
        return _unique(static)
    dynamic = trace_forward(module, sample)
    if static:
        # A forward inside TorchScript or an fx graph has no Python line of its own: the graph's findings name it.
        dynamic = [f for f in dynamic if f.where]
    return _unique(static + dynamic)


# --- the graphs ---

def scan_graphs(module: nn.Module) -> list[HostSync]:
    """Host syncs recorded in the TorchScript and fx graphs inside `module` (its own and its submodules')."""
    findings: list[HostSync] = []
    for sub in _graph_modules(module):
        if isinstance(sub, torch.jit.ScriptModule):
            graph = sub.inlined_graph  # held: its nodes are invalid once the graph is freed
            findings.extend(scan_torchscript(graph))
        else:
            assert isinstance(sub, fx.GraphModule)
            findings.extend(scan_fx(sub.graph))
    return findings


def _all_in_its_graph(module: object) -> bool:
    """A TorchScript module that calls no Python function (`prim::PythonOp`, from @torch.jit.ignore)."""
    if not isinstance(module, torch.jit.ScriptModule):
        return False
    graph = module.inlined_graph  # held: its nodes are invalid once the graph is freed
    return not any(n.kind() == "prim::PythonOp" for n in _nodes(graph.block()))


def _graph_modules(module: nn.Module) -> Iterator[nn.Module]:
    """`module` and its submodules that carry a graph, outermost only (a ScriptModule's inlined graph holds its
    submodules')."""
    if isinstance(module, (torch.jit.ScriptModule, fx.GraphModule)):
        yield module
        if isinstance(module, torch.jit.ScriptModule):
            return
    for child in module.children():
        yield from _graph_modules(child)


def scan_torchscript(graph: torch._C.Graph) -> list[HostSync]:
    """Nodes that read a device tensor on the host. A tensor made from a size (`prim::NumToTensor`, what tracing
    records for `x.shape[0]`) lives on the host and is skipped, as is anything computed from such tensors only."""
    host_values: set[torch._C.Value] = set()
    masks: set[torch._C.Value] = set()  # boolean tensors (a scripted graph's types carry no dtype)
    findings = []
    for node in _nodes(graph.block()):
        kind = node.kind()
        if kind.split("::", 1)[-1] in _MASK_MAKERS:
            masks.update(node.outputs())
        tensor_inputs = [v for v in node.inputs() if isinstance(v.type(), torch._C.TensorType)]
        if kind == "prim::NumToTensor" or (tensor_inputs and all(v in host_values for v in tensor_inputs)) \
                or (not tensor_inputs and _made_on_the_cpu(node)):
            host_values.update(node.outputs())
            continue
        name = kind.split("::", 1)[-1]
        device_inputs = [v for v in tensor_inputs if v not in host_values]
        if not device_inputs:
            continue
        if name in SCALAR_READS or name in DATA_DEPENDENT_SHAPES or _masks_or_repeats(node, name, masks):
            where, code = _torchscript_source(str(node.sourceRange()))
            findings.append(HostSync(op=kind, where=where, code=code, found_by="TorchScript graph"))
    return findings


def _made_on_the_cpu(node: torch._C.Node) -> bool:
    """A factory given the constant device "cpu" (what tracing records for `device=x.device` on a CPU): it makes
    its tensor on the host on any machine, since loading onto a GPU moves tensors, not the code's constants."""
    return any(isinstance(v.type(), torch._C.DeviceObjType) and v.node().kind() == "prim::Constant"
               and str(v.toIValue()) == "cpu" for v in node.inputs())


def _nodes(block: torch._C.Block) -> Iterator[torch._C.Node]:
    for node in block.nodes():
        yield node
        for inner in node.blocks():
            yield from _nodes(inner)


def _masks_or_repeats(node: torch._C.Node, name: str, masks: set[torch._C.Value]) -> bool:
    """aten::index / index_put with a boolean mask, or repeat_interleave with tensor repeats and no output size."""
    inputs = list(node.inputs())
    if name == "repeat_interleave":  # sized by its repeats' values unless given output_size (its last input)
        size = inputs[-1]
        return "Tensor repeats" in node.schema() and size.node().kind() == "prim::Constant" and size.toIValue() is None
    if name not in _MASK_INDEXING or len(inputs) < 2:
        return False
    indices = inputs[1].node()
    values = list(indices.inputs()) if indices.kind() == "prim::ListConstruct" else []
    return any(v in masks or (isinstance(v.type(), torch._C.TensorType) and v.type().scalarType() in ("Bool", "Byte"))
               for v in values)


def _torchscript_source(source_range: str) -> tuple[str, str]:
    """(file:line, code) from a node's source range: the original file where TorchScript kept it (scripted), else
    the serialized code; for a traced module not yet saved, the innermost frame outside torch."""
    lines = source_range.splitlines()
    for i, line in enumerate(lines):
        match = _FILE_LINE.search(line)
        if match and match.group(1):
            code = ""
            for j in range(i + 1, len(lines)):
                if "<--- HERE" in lines[j]:
                    code = lines[j - 1].strip()
                    break
            return f"{match.group(1)}:{match.group(2)}", code
    for line in lines:
        match = _TRACED_FRAME.match(line.strip())
        if match and not match.group(1).startswith(_TORCH_DIR):
            return f"{match.group(1)}:{match.group(2)}", ""
    return "", ""


def scan_fx(graph: fx.Graph) -> list[HostSync]:
    """aten operator nodes of an fx graph (torch.export) that read values on the host, with the line they record."""
    findings = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        qualified = node.target._schema.name  # e.g. "aten::_local_scalar_dense"
        name = qualified.split("::", 1)[-1]
        if name in SCALAR_READS or name in DATA_DEPENDENT_SHAPES:
            where, code = _fx_source(node.meta.get("stack_trace") or "")
            findings.append(HostSync(op=qualified, where=where, code=code, found_by="fx graph"))
    return findings


def _fx_source(stack_trace: str) -> tuple[str, str]:
    """The innermost frame of an fx node's recorded stack (its last `File "...", line N` and the code under it)."""
    lines = stack_trace.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _FILE_LINE.search(lines[i])
        if match:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{match.group(1)}:{match.group(2)}", code
    return "", ""


# --- one forward ---

def trace_forward(module: Callable[[torch.Tensor], Any], sample: torch.Tensor) -> list[HostSync]:
    """Run `module(sample)` once, recording every host sync it runs into (see the module docstring)."""
    recorder = _Recorder(module, sample, stop_at=sys._getframe())
    with recorder.watching():
        module(sample)
    return recorder.findings


class _Recorder:
    """The state of one checked forward: what would be on the device, the submodule running, the findings."""

    def __init__(self, module: Callable[[torch.Tensor], Any], sample: torch.Tensor, stop_at: FrameType) -> None:
        self.findings: list[HostSync] = []
        self.on_cuda = sample.is_cuda
        # Tensors that would be on the device, by id (a WeakSet would compare tensors with ==, elementwise).
        self._device: dict[int, weakref.ref[torch.Tensor]] = {}
        self._add(sample)
        self._modules: list[str] = []
        self._module = module
        self._stop_at = stop_at  # the frame that runs the forward: the model's code is inside it
        if isinstance(module, nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                self._add(t)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if isinstance(self._module, nn.Module):
                stack.enter_context(self._module_names(self._module))
            stack.enter_context(torch.inference_mode())
            # Unoptimised, the TorchScript executor runs the graph as it is instead of optimising it again for a
            # forward under a Python mode (seconds for open_nsfw, once).
            stack.enter_context(torch.jit.optimized_execution(False))
            if self.on_cuda:
                stack.enter_context(start_up_sync_debug())
            stack.enter_context(_Functions(self))
            stack.enter_context(_Dispatch(self))
            yield

    def is_on_device(self, t: torch.Tensor) -> bool:
        if self.on_cuda:
            return t.is_cuda
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def mark(self, value: Any) -> None:
        if not self.on_cuda:
            for t in _tensors(value):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        key = id(t)

        def forget(_: weakref.ref[torch.Tensor]) -> None:
            self._device.pop(key, None)

        self._device[key] = weakref.ref(t, forget)

    def record(self, op: str, found_by: str = "forward") -> None:
        where, code = self._caller()
        module = self._modules[-1] if self._modules else ""
        self.findings.append(HostSync(op=op, where=where, code=code, module=module, found_by=found_by))

    def _caller(self) -> tuple[str, str]:
        """The innermost frame of the model's own code: not torch's, not this module's, not fx-generated code."""
        frame = sys._getframe(1)
        while frame is not None and frame is not self._stop_at:
            path = frame.f_code.co_filename
            if not (path.startswith(_TORCH_DIR) or path == __file__ or path.startswith("<")):
                return f"{path}:{frame.f_lineno}", _source_line(path, frame.f_lineno)
            frame = frame.f_back  # type: ignore[assignment]
        return "", ""

    @contextlib.contextmanager
    def _module_names(self, root: nn.Module) -> Iterator[None]:
        """Hooks naming the submodule running (ScriptModules take no hooks: their graph names the line)."""
        def enter(label: str) -> Callable[..., None]:
            return lambda *_: self._modules.append(label)

        def leave(*_: Any) -> None:  # a forward hook returning a value would replace the module's output
            self._modules.pop()

        handles = []
        for name, sub in _hookable(root):
            handles.append(sub.register_forward_pre_hook(enter(f"{name} ({type(sub).__name__})" if name
                                                                else type(sub).__name__)))
            handles.append(sub.register_forward_hook(leave))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _hookable(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    if isinstance(root, torch.jit.ScriptModule):
        return
    yield prefix, root
    for name, child in root.named_children():
        yield from _hookable(child, f"{prefix}.{name}" if prefix else name)


class _Functions(TorchFunctionMode):
    """Tensor methods that read values on the host, and tensors made on an explicit device (followed on a CPU)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor) \
                and self.recorder.is_on_device(args[0]):
            self.recorder.record(f"Tensor.{name}")
        out = func(*args, **kwargs)
        if _names_a_device(name, args, kwargs) or any(self.recorder.is_on_device(t) for t in _tensors((args, kwargs))):
            self.recorder.mark(out)
        return out


def _names_a_device(name: str, args: tuple, kwargs: dict) -> bool:
    """A factory or `.to()` given a device (not the string "cpu"): its result would be on the model's device."""
    if name == "cpu":
        return False
    given = kwargs.get("device")
    if given is None and name in ("to", "cuda"):
        given = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None if name == "to" else "cuda")
    return given is not None and given != "cpu"


class _Dispatch(TorchDispatchMode):
    """aten operators that read values on the host or size their output by them, inside TorchScript too."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Keeps TorchDispatchMode from wrapping __torch_dispatch__ in torch._dynamo.disable, whose first call
        # imports torch._dynamo: 2-3 s of start-up, for a forward that never runs under torch.compile.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::", 1)[-1]
        inputs = list(_tensors((args, kwargs)))
        on_device = any(self.recorder.is_on_device(t) for t in inputs)
        if on_device and (name in SCALAR_READS or name in DATA_DEPENDENT_SHAPES
                          or _mask_or_repeats(func, name, args, kwargs)
                          or _copies_to_host(name, args, kwargs, self.recorder.on_cuda)):
            self.recorder.record(f"aten::{name}")
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            if "synchronizing CUDA operation" not in str(exc):
                raise
            self.recorder.record(f"aten::{name} (a synchronizing CUDA call)", found_by="CUDA sync debug")
            with _sync_debug("default"):
                out = func(*args, **kwargs)
        if on_device:
            self.recorder.mark(out)
        return out


def _mask_or_repeats(func: Any, name: str, args: tuple, kwargs: dict) -> bool:
    """Indexing with a boolean mask (a nonzero inside), or repeat_interleave sized by tensor repeats."""
    if name == "repeat_interleave":
        # Overloads: "Tensor" (repeats only), "self_Tensor" (input, repeats, dim, output_size), "self_int".
        size_at = {"Tensor": 2, "self_Tensor": 3}.get(func._overloadname)
        return size_at is not None and kwargs.get("output_size", args[size_at] if len(args) > size_at else None) \
            is None
    if name not in _MASK_INDEXING or len(args) < 2:
        return False
    indices = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _copies_to_host(name: str, args: tuple, kwargs: dict, on_cuda: bool) -> bool:
    """A copy from the device to the host; only visible on a GPU (on a CPU `.to(x.device)` looks the same)."""
    if not on_cuda or name not in ("_to_copy", "to", "copy_"):
        return False
    if name == "copy_":
        return len(args) > 1 and isinstance(args[0], torch.Tensor) and not args[0].is_cuda and args[1].is_cuda
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


@contextlib.contextmanager
def start_up_sync_debug(serving: ServingState = SERVING) -> Iterator[bool]:
    """CUDA's sync-debug mode "error" for the checked forward (True), restored after; only while no runner of the
    process serves: the mode is process-wide, and would fail another thread's batch at its first synchronising
    call. Once one serves, nothing is set (False) and the check names what the graphs and the forward show."""
    if serving.began:
        log.warning("host-sync check after a runner began serving: CUDA's sync-debug mode is process-wide, so the "
                    "check runs without it (the graph scan and the traced forward still run)")
        yield False
        return
    with _sync_debug("error"):
        yield True


@contextlib.contextmanager
def _sync_debug(mode: str) -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _source_line(path: str, line: int) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            for number, text in enumerate(fh, start=1):
                if number == line:
                    return text.strip()
    except OSError:
        pass
    return ""


def _unique(findings: list[HostSync]) -> list[HostSync]:
    """One finding per source line (or per operator where the line is unknown), the first seen."""
    seen: set[tuple[str, str]] = set()
    out = []
    for f in findings:
        key = (f.where, f.module) if f.where else (f.op, f.module)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
