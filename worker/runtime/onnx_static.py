"""Shape arguments an ONNX graph computes from its input, made constant for a fixed input size, batch kept dynamic.

YOLO-style exports compute their head's reshapes and anchor grids at run time (Shape -> Gather -> Concat ->
Reshape, Range, Expand). onnx2torch converts such a graph, but tracing it to TorchScript bakes in the batch size
of the trace (`torch.tensor(x.shape)` is a constant to the tracer), so the converted model would fail on any other
batch. With the contract's fixed input size, these values depend on the batch at most: `pin_shape_arguments`
evaluates each such argument with onnxruntime at batch 1 and 2, and replaces it by a constant where it is the same
for both, or, for a Reshape whose target's first dimension is the batch of a batch-first input, by the constant
shape with 0 there (ONNX Reshape's "copy the input's dimension"). What still depends on the batch is left as it is
(the trace check then refuses the model with its message). The constants are then folded (worker.runtime.onnx_fold).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Inputs of these operators (by position) are shape-like: sizes, indices, counts, scales.
SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Range": (0, 1, 2), "ConstantOfShape": (0,), "Tile": (1,),
                "Slice": (1, 2, 3, 4), "Resize": (1, 2, 3), "Unsqueeze": (1,), "Squeeze": (1,), "Pad": (1, 2)}
PROBE_BATCHES = (1, 2)


def pin_shape_arguments(proto: Any, sample_shape: tuple[int, ...]) -> tuple[Any, int]:
    """The graph with its run-time shape arguments made constant where the batch allows (module docstring), and
    how many it replaced. `sample_shape`: one batch of the model's input ([N, ...], N ignored)."""
    import onnx
    from onnx import numpy_helper

    graph = proto.graph
    constant = {init.name for init in graph.initializer}
    constant |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    targets = []  # (node, input position, tensor name)
    for node in graph.node:
        for i in SHAPE_INPUTS.get(node.op_type, ()):
            if i < len(node.input) and node.input[i] and node.input[i] not in constant:
                targets.append((node, i, node.input[i]))
    if not targets:
        return proto, 0
    reshaped = {name: node.input[0] for node, i, name in targets if node.op_type == "Reshape"}
    wanted = sorted({name for _, _, name in targets} | set(reshaped.values()))
    values = [_evaluate(proto, wanted, sample_shape, batch) for batch in PROBE_BATCHES]
    replaced: dict[str, np.ndarray] = {}
    for _node, _i, name in targets:
        a, b = values[0][name], values[1][name]
        if a.shape == b.shape and np.array_equal(a, b):
            replaced[name] = a
        elif name in reshaped and a.ndim == 1 and a.shape == b.shape and \
                _batch_first(a, b, values[0][reshaped[name]], values[1][reshaped[name]]):
            replaced[name] = np.concatenate([np.zeros(1, dtype=a.dtype), a[1:]])
    if not replaced:
        return proto, 0
    pinned = onnx.ModelProto()
    pinned.CopyFrom(proto)
    for node in pinned.graph.node:
        for i, name in enumerate(node.input):
            if name in replaced:
                node.input[i] = f"{name}__pinned"
    pinned.graph.initializer.extend(numpy_helper.from_array(v, f"{k}__pinned") for k, v in replaced.items())
    _drop_dead_nodes(pinned.graph)
    return pinned, len(replaced)


def _batch_first(a: np.ndarray, b: np.ndarray, data_a: np.ndarray, data_b: np.ndarray) -> bool:
    """A Reshape target differing only in its first value, which is the batch, as is its input's first dimension."""
    return bool(np.array_equal(a[1:], b[1:]) and int(a[0]) == PROBE_BATCHES[0] and int(b[0]) == PROBE_BATCHES[1]
                and data_a.shape[:1] == (PROBE_BATCHES[0],) and data_b.shape[:1] == (PROBE_BATCHES[1],))


def _evaluate(proto: Any, names: list[str], sample_shape: tuple[int, ...], batch: int) -> dict[str, np.ndarray]:
    """The values of `names` for a zero input of `batch` x sample_shape[1:] (onnxruntime, on the CPU)."""
    import onnx
    import onnxruntime
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    existing = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in existing)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: np.zeros((batch, *sample_shape[1:]), dtype=np.float32)}
    outputs = session.run(names, feed)
    # Reshape inputs are kept only for their shape: a large activation is not worth holding.
    return {n: (v if v.size <= 64 else np.empty(v.shape, dtype=v.dtype)) for n, v in zip(names, outputs, strict=True)}


def _drop_dead_nodes(graph: Any) -> None:
    """Remove the nodes no graph output depends on any more (the Shape -> Gather chains that were pinned)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for n in graph.node for i in n.input}
    kept_inits = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
