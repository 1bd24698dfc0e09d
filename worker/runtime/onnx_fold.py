"""Constant shape arguments of an onnx2torch graph folded into Python values, so forward reads nothing on the host.

onnx2torch keeps ONNX's shape-like inputs (Reshape's shape, Slice's starts, Pad's pads, ...) as tensors and turns
them into Python values inside forward (`int()`, `.tolist()`, `torch.Size(tensor)`): on a GPU one device-to-host
sync per call, which stalls the stream and which no CUDA graph can capture. Where such an input is a constant of
the graph (an initializer, a Constant node, or computed from those alone), `fold_constants` reads it once, at
conversion, and the node becomes a plain torch call with Python values, with ONNX's semantics (Reshape's `0`
copies the input's dimension, `-1` is inferred). Constant subgraphs (ConstantOfShape or Range of constants, a
Concat of initializers) are computed once and kept as buffers. A shape computed from the input at run time
(Shape -> Gather -> Concat -> Reshape) is not constant and stays as it is; the start-up check
(`worker.runtime.hostsync`) names it. The folded forms name no device: the module is traced on the CPU and loaded
onto the runner's device, and a device in a traced call is a constant (tests/unit/test_runtime_onnx.py scans for it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from onnx2torch.node_converters.constant import OnnxConstant
from onnx2torch.node_converters.cumsum import OnnxCumSum
from onnx2torch.node_converters.expand import OnnxExpand
from onnx2torch.node_converters.pad import OnnxPadDynamic
from onnx2torch.node_converters.reduce import OnnxReduceSumDynamicAxes
from onnx2torch.node_converters.reshape import OnnxReshape
from onnx2torch.node_converters.resize import OnnxResize, OnnxResizeV10
from onnx2torch.node_converters.slice import OnnxSlice
from onnx2torch.node_converters.split import OnnxSplit13
from onnx2torch.node_converters.squeeze import OnnxSqueezeDynamicAxes
from onnx2torch.node_converters.tile import OnnxTile
from onnx2torch.node_converters.topk import OnnxTopK
from onnx2torch.node_converters.unsqueeze import OnnxUnsqueezeDynamicAxes
from torch import fx, nn

# ONNX Resize mode and spatial rank -> torch.nn.functional.interpolate's mode (onnx2torch's own table).
_RESIZE_MODES = {("nearest", 1): "nearest", ("nearest", 2): "nearest", ("nearest", 3): "nearest",
                 ("linear", 1): "linear", ("linear", 2): "bilinear", ("linear", 3): "trilinear",
                 ("cubic", 2): "bicubic"}
# torch.nn.functional.pad's mode -> ONNX Pad's (OnnxPadDynamic keeps the torch name).
_PAD_MODES = {"constant", "reflect", "replicate"}


@dataclass(frozen=True)
class FoldReport:
    """What `fold_constants` changed: the nodes now called with Python values, and the constant nodes computed."""

    folded: tuple[str, ...]  # "<ONNX operator> <node name>"
    computed: int

    def describe(self) -> str:
        ops = sorted({f.split(" ", 1)[0] for f in self.folded})
        return f"{len(self.folded)} node(s) with constant shape arguments folded ({', '.join(ops) or 'none'}), " \
               f"{self.computed} constant node(s) computed once"


# --- the folded forms: plain torch calls with Python values, ONNX semantics ---

def reshape(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """ONNX Reshape (allowzero = 0, the only form onnx2torch converts): 0 copies the input's dimension, -1 is
    inferred."""
    return torch.reshape(x, [x.shape[i] if d == 0 else d for i, d in enumerate(shape)])


def expand(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """ONNX Expand: broadcasts both ways (a 1 in `shape` keeps the input's dimension), as onnx2torch computes it.
    `new_ones`, not `torch.ones(..., device=x.device)`: tracing records the latter's device as a constant (the
    conversion's, "cpu"), so the traced model would fail on any other device."""
    return x * x.new_ones(shape)


def tile(x: torch.Tensor, repeats: tuple[int, ...]) -> torch.Tensor:
    return x.repeat(repeats)


def slice_(x: torch.Tensor, starts: tuple[int, ...], ends: tuple[int, ...], axes: tuple[int, ...],
           steps: tuple[int, ...]) -> torch.Tensor:
    """ONNX Slice; a negative step flips the axis and slices it forwards (torch has no negative steps)."""
    index: list[slice] = [slice(None)] * x.dim()
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = axis + x.dim() if axis < 0 else axis
        if step < 0:
            flips.append(axis)
            start, end, step = -start - 1, -end - 1, -step
        index[axis] = slice(start, end, step)
    if flips:
        x = torch.flip(x, flips)
    return x[tuple(index)]


def pad(x: torch.Tensor, pads: tuple[int, ...], mode: str, value: float) -> torch.Tensor:
    """`pads` already in torch's order (last dimension first)."""
    return F.pad(x, pads, mode=mode, value=value)


def resize(x: torch.Tensor, mode: str, align_corners: bool | None, scales: tuple[float, ...]) -> torch.Tensor:
    """ONNX Resize by `scales` of the spatial dimensions (batch and channels at 1, checked at conversion)."""
    return F.interpolate(x, scale_factor=list(scales), mode=mode, align_corners=align_corners)


def squeeze(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """ONNX Squeeze: no axes squeezes every dimension of size 1."""
    return torch.squeeze(x, dim=axes) if axes else torch.squeeze(x)


def unsqueeze(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """ONNX Unsqueeze: axes index the output, so insert in ascending order (negatives counted from its end)."""
    rank = x.dim() + len(axes)
    for axis in sorted(a + rank if a < 0 else a for a in axes):
        x = torch.unsqueeze(x, axis)
    return x


def reduce_sum(x: torch.Tensor, axes: tuple[int, ...], keepdims: bool, noop_with_empty_axes: bool) -> torch.Tensor:
    if not axes:
        if noop_with_empty_axes:
            return x
        axes = tuple(range(x.dim()))
    return torch.sum(x, dim=axes, keepdim=keepdims)


def split(x: torch.Tensor, sizes: tuple[int, ...], axis: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.split(x, list(sizes), dim=axis))


def topk(x: torch.Tensor, k: int, dim: int, largest: bool, sorted_: bool) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(x, k=k, dim=dim, largest=largest, sorted=sorted_)
    return values, indices


def cumsum(x: torch.Tensor, axis: int, exclusive: bool, reverse: bool) -> torch.Tensor:
    """ONNX CumSum: `exclusive` leaves each element out of its own sum, `reverse` sums from the end."""
    if reverse:
        x = torch.flip(x, (axis,))
    out = torch.cumsum(x, dim=axis)
    if exclusive:
        out = out - x
    return torch.flip(out, (axis,)) if reverse else out


# --- the pass ---

class _NotConstant(Exception):
    """An argument the fold needs is computed at run time."""


# A folded node: the function above that replaces it, and its arguments (the input node, then Python values).
_Built = tuple[Callable[..., Any], tuple[Any, ...]]
_Rule = Callable[[nn.Module, "_Args"], _Built | None]


class _Args:
    """A node's arguments by the converter module's parameter names; constants read as Python values."""

    def __init__(self, node: fx.Node, module: nn.Module, constants: dict[fx.Node, Any]) -> None:
        self.values = inspect.signature(module.forward).bind(*node.args, **node.kwargs).arguments
        self._constants = constants

    def node(self, name: str) -> Any:
        return self.values[name]

    def tensor(self, name: str) -> torch.Tensor | None:
        """The constant tensor given for `name`, None when the input is absent; _NotConstant when computed."""
        value = self.values.get(name)
        if value is None:
            return None
        if not isinstance(value, fx.Node) or value not in self._constants:
            raise _NotConstant(name)
        constant = self._constants[value]
        if not isinstance(constant, torch.Tensor):
            raise _NotConstant(name)
        return constant

    def ints(self, name: str) -> tuple[int, ...] | None:
        t = self.tensor(name)
        return None if t is None else tuple(int(v) for v in t.reshape(-1).tolist())

    def floats(self, name: str) -> tuple[float, ...] | None:
        t = self.tensor(name)
        return None if t is None else tuple(float(v) for v in t.reshape(-1).tolist())


def _reshape(module: nn.Module, a: _Args) -> _Built | None:
    shape = a.ints("shape")
    return (reshape, (a.node("input_tensor"), shape)) if shape is not None else None


def _expand(module: nn.Module, a: _Args) -> _Built | None:
    shape = a.ints("shape")
    return (expand, (a.node("input_tensor"), shape)) if shape is not None else None


def _tile(module: nn.Module, a: _Args) -> _Built | None:
    repeats = a.ints("repeats")
    return (tile, (a.node("input_tensor"), repeats)) if repeats is not None else None


def _slice(module: nn.Module, a: _Args) -> _Built | None:
    starts, ends = a.ints("starts"), a.ints("ends")
    if starts is None or ends is None:
        return None
    axes = a.ints("axes") or tuple(range(len(starts)))
    steps = a.ints("steps") or (1,) * len(starts)
    return slice_, (a.node("input_tensor"), starts, ends, axes, steps)


def _pad(module: nn.Module, a: _Args) -> _Built | None:
    assert isinstance(module, OnnxPadDynamic)
    onnx_pads = a.ints("pads")
    value = a.floats("constant_value")
    if onnx_pads is None or module.mode not in _PAD_MODES:
        return None
    # ONNX: all begins, then all ends, first dimension first; torch: (begin, end) pairs, last dimension first.
    half = len(onnx_pads) // 2
    torch_pads = [p for begin, end in zip(onnx_pads[:half][::-1], onnx_pads[half:][::-1], strict=True)
                  for p in (begin, end)]
    if module.mode != "constant":
        if any(torch_pads[-4:]):
            return None  # torch pads no batch or channel dimension in these modes: onnx2torch's error stays
        torch_pads = torch_pads[:-4]
    return pad, (a.node("input_tensor"), tuple(torch_pads), module.mode, value[0] if value else 0.0)


def _resize(module: nn.Module, a: _Args) -> _Built | None:
    """Resize by constant scales. Constant sizes are left to onnx2torch: they fix the batch, so such a graph
    fails the trace check on another batch size anyway."""
    if isinstance(module, OnnxResizeV10):
        module, roi, sizes = module._resize, None, None  # the V10 wrapper's only part
    else:
        roi, sizes = a.tensor("roi"), a.tensor("sizes")
    assert isinstance(module, OnnxResize)
    scales = a.floats("scales")
    if not scales or (sizes is not None and sizes.numel()) or (roi is not None and roi.numel() and
                                                              not module.ignore_roi):
        return None  # no scales, sizes instead, or a region of interest (which onnx2torch refuses at run time)
    mode = _RESIZE_MODES.get((module.onnx_mode, len(scales) - 2))
    if mode is None or scales[:2] != (1.0, 1.0):
        return None  # interpolate cannot scale batch or channels: onnx2torch's error stays
    return resize, (a.node("input_tensor"), mode, module.align_corners, scales[2:])


def _squeeze(module: nn.Module, a: _Args) -> _Built | None:
    axes = a.ints("axes")
    return squeeze, (a.node("input_tensor"), axes or ())


def _unsqueeze(module: nn.Module, a: _Args) -> _Built | None:
    axes = a.ints("axes")
    return (unsqueeze, (a.node("input_tensor"), axes)) if axes is not None else None


def _reduce_sum(module: nn.Module, a: _Args) -> _Built | None:
    assert isinstance(module, OnnxReduceSumDynamicAxes)
    axes = a.ints("axes") or ()
    return reduce_sum, (a.node("input_tensor"), axes, bool(module._keepdims),
                        bool(module._noop_with_empty_axes))


def _split(module: nn.Module, a: _Args) -> _Built | None:
    assert isinstance(module, OnnxSplit13)
    sizes = a.ints("split")
    return (split, (a.node("input_tensor"), sizes, module.axis)) if sizes is not None else None


def _topk(module: nn.Module, a: _Args) -> _Built | None:
    assert isinstance(module, OnnxTopK)
    k = a.ints("k")
    return (topk, (a.node("input_tensor"), k[0], module.dim, module.largest, module.sorted)) if k else None


def _cumsum(module: nn.Module, a: _Args) -> _Built | None:
    assert isinstance(module, OnnxCumSum)
    axis = a.ints("axis")
    return (cumsum, (a.node("input_tensor"), axis[0], module.exclusive, module.reverse)) if axis else None


_RULES: dict[type[nn.Module], tuple[str, _Rule]] = {
    OnnxReshape: ("Reshape", _reshape),
    OnnxExpand: ("Expand", _expand),
    OnnxTile: ("Tile", _tile),
    OnnxSlice: ("Slice", _slice),
    OnnxPadDynamic: ("Pad", _pad),
    OnnxResize: ("Resize", _resize),
    OnnxResizeV10: ("Resize", _resize),
    OnnxSqueezeDynamicAxes: ("Squeeze", _squeeze),
    OnnxUnsqueezeDynamicAxes: ("Unsqueeze", _unsqueeze),
    OnnxReduceSumDynamicAxes: ("ReduceSum", _reduce_sum),
    OnnxSplit13: ("Split", _split),
    OnnxTopK: ("TopK", _topk),
    OnnxCumSum: ("CumSum", _cumsum),
}


def fold_constants(gm: fx.GraphModule) -> FoldReport:
    """Rewrite `gm` in place: constant nodes computed once into buffers, converter modules whose shape-like
    arguments are constant replaced by the plain torch calls above."""
    constants: dict[fx.Node, Any] = {}
    folded: list[str] = []
    computed = 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            constants[node] = _attribute(gm, str(node.target))
        elif node.op == "call_module" and isinstance(module := gm.get_submodule(str(node.target)), OnnxConstant):
            constants[node] = module.value
        elif node.op in ("call_module", "call_function", "call_method"):
            inputs = node.all_input_nodes
            if inputs and all(i in constants for i in inputs):
                value = _evaluate(gm, node, constants)
                if value is not _FAILED:
                    if isinstance(value, torch.Tensor):
                        node = _replace_by_buffer(gm, node, value)
                        computed += 1
                    constants[node] = value
                    continue
            if node.op == "call_module":
                name = _fold_module(gm, node, constants)
                if name is not None:
                    folded.append(f"{name} {node.target}")
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return FoldReport(folded=tuple(folded), computed=computed)


def _fold_module(gm: fx.GraphModule, node: fx.Node, constants: dict[fx.Node, Any]) -> str | None:
    module = gm.get_submodule(str(node.target))
    rule = _RULES.get(type(module))
    if rule is None:
        return None
    operator, build = rule
    try:
        built = build(module, _Args(node, module, constants))
    except _NotConstant:
        return None
    if built is None:
        return None
    function, args = built
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_function(function, args)
    replacement.name = node.name
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    return operator


_FAILED = object()


def _evaluate(gm: fx.GraphModule, node: fx.Node, constants: dict[fx.Node, Any]) -> Any:
    """A node whose inputs are all constants, run once; _FAILED when it raises (the trace will then say why)."""
    args = fx.node.map_arg(node.args, lambda n: constants[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: constants[n])
    try:
        with torch.no_grad():
            if node.op == "call_module":
                return gm.get_submodule(str(node.target))(*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], str(node.target))(*args[1:], **kwargs)
            return node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 (left in the graph: running it reports the error)
        return _FAILED


def _replace_by_buffer(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor) -> fx.Node:
    name = f"folded_constant_{sum(1 for _ in gm.buffers(recurse=False))}"
    gm.register_buffer(name, value.detach().clone())
    with gm.graph.inserting_before(node):
        replacement = gm.graph.get_attr(name)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    return replacement


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
