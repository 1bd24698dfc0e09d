"""ONNX models on the torch runtime: converted once (onnx2torch, then traced to TorchScript) and cached on disk.

Conversion needs `onnx` and `onnx2torch` (the `models` extra) and takes seconds, most of it importing them; the
cached TorchScript file, keyed by the ONNX file's hash, the torch and converter versions and the input shape,
loads without either in a fraction of a second. The traced module runs on the same runners as any other
model (shape batching, bucket padding, CUDA graphs). An ONNX operator the converter lacks is a start-up error
naming the operator.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.runtime.contract import VALIDATION_BATCH, VALIDATION_HW, ModelContract, ModelContractError

log = logging.getLogger(__name__)

# Bump when what is cached changes, so old entries are ignored rather than misread or reused.
# 2: constant shape arguments folded into Python values before tracing (worker.runtime.onnx_fold).
# 3: shape arguments computed from a fixed-size input pinned first (worker.runtime.onnx_static).
CACHE_FORMAT = 3
CONVERTER = "onnx2torch"
# The traced module must agree with the converted one on a batch size it was not traced with.
TRACE_CHECK_TOLERANCE = 1e-4


def load_onnx(path: Path, contract: ModelContract, cache_dir: Path, device: torch.device) -> nn.Module:
    """The ONNX model as a TorchScript module on `device`, from the cache, or converted and cached now."""
    if not path.is_file():
        raise ModelContractError(f"model.source {str(path)!r}: no such ONNX file")
    sample = (VALIDATION_BATCH, *contract.input_shape(contract.input_size or VALIDATION_HW))
    cached = cache_path(path, sample, cache_dir)
    if cached.is_file():
        try:
            return _load_cached(cached, device)
        except Exception as exc:  # noqa: BLE001 (a damaged cache entry is converted again, not fatal)
            log.warning("cached ONNX conversion unreadable, converting again path=%s error=%s", cached, exc)
    t0 = time.perf_counter()
    traced = convert_onnx(path, contract, sample)
    try:
        _save_atomically(traced, cached)
    except (OSError, RuntimeError) as exc:  # torch reports an unwritable file as RuntimeError
        log.warning("converted ONNX model %s in %.1fs but cannot cache it (%s); every start will convert again: "
                    "point model.cache_dir at a writable directory", path, time.perf_counter() - t0, exc)
        return traced.to(device)
    log.info("converted ONNX model %s to TorchScript in %.1fs; cached as %s", path, time.perf_counter() - t0, cached)
    return _load_cached(cached, device)


def _load_cached(cached: Path, device: torch.device) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # TorchScript is deprecated upstream, but converted graphs with a shape computed at run time cannot be
        # torch.export-ed (onnx2torch's converters branch on tensor values) and a TorchScript file loads without
        # the converter.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(str(cached), map_location=device)


def cache_path(path: Path, sample_shape: tuple[int, ...], cache_dir: Path) -> Path:
    """Where the conversion of this file, for this input shape, torch and converter, is (or will be) kept."""
    key = "|".join([_file_sha256(path), f"format {CACHE_FORMAT}", f"torch {torch.__version__}",
                    f"{CONVERTER} {_version(CONVERTER)}", f"sample {list(sample_shape[1:])}"])
    return cache_dir / "onnx" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.ts"


def convert_onnx(path: Path, contract: ModelContract, sample_shape: tuple[int, ...]) -> torch.jit.ScriptModule:
    """ONNX file -> onnx2torch GraphModule, its constant shape arguments folded -> TorchScript traced on a zero
    sample of `sample_shape` (CPU)."""
    # Imported here for cost, not to dodge a cycle: onnx and onnx2torch take seconds to import, and a cached
    # conversion loads without them (test_a_restart_loads_the_cached_conversion_..._without_the_converter).
    try:
        import onnx
        from onnx2torch import convert

        from worker.runtime.onnx_fold import fold_constants
    except ImportError as exc:
        raise ModelContractError(
            f"model.source {str(path)!r}: converting an ONNX model needs onnx and onnx2torch ({exc.name} is "
            "missing): pip install 'streamfer[models]' (./dev setup does)"
        ) from None
    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # protobuf raises several types for a bad file
        raise ModelContractError(f"model.source {str(path)!r}: not a readable ONNX file ({exc})") from exc
    _check_operators(proto, path)
    _check_input(proto, path, contract, sample_shape)
    if contract.input_size is not None:  # a fixed input: shapes computed from it are constants, batch aside
        from worker.runtime.onnx_static import pin_shape_arguments

        proto, pinned = pin_shape_arguments(proto, sample_shape)
        if pinned:
            log.info("ONNX model %s: %d shape argument(s) computed from the input pinned for its fixed size",
                     path, pinned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnx2torch and the tracer warn about every constant they fold
        try:
            module = convert(proto).eval()
        except NotImplementedError as exc:
            raise ModelContractError(
                f"model.source {str(path)!r}: {CONVERTER} cannot convert this graph: {exc}; re-export the model "
                "without that operator or attribute, or export it from its framework to TorchScript / torch.export"
            ) from exc
        folded = fold_constants(module)
        log.info("ONNX model %s: %s", path, folded.describe())
        with torch.no_grad():
            sample = torch.zeros(sample_shape)
            traced = torch.jit.trace(module, sample, check_trace=False)
            _check_trace(module, traced, sample_shape, path)
    return traced


def _check_operators(proto: Any, path: Path) -> None:
    """Name every operator the converter has no converter for, before converting (which stops at the first)."""
    from onnx2torch.node_converters.registry import get_converter

    opsets = {imp.domain: imp.version for imp in proto.opset_import}
    missing: dict[str, str] = {}
    for node in proto.graph.node:
        version = opsets.get(node.domain, 0)
        try:
            get_converter(operation_type=node.op_type, version=version, domain=node.domain)
        except NotImplementedError:
            where = f"{node.domain}::" if node.domain else ""
            missing.setdefault(f"{where}{node.op_type} (opset {version})", node.name or "unnamed")
    if missing:
        listed = ", ".join(f"{op} at node {name!r}" for op, name in missing.items())
        raise ModelContractError(
            f"model.source {str(path)!r}: ONNX operator(s) not supported by {CONVERTER} "
            f"{_version(CONVERTER)}: {listed}; re-export the model without them (or at another opset), or export "
            "it from its framework to TorchScript / torch.export"
        )


def _check_input(proto: Any, path: Path, contract: ModelContract, sample_shape: tuple[int, ...]) -> None:
    """The graph's declared input against what the contract will feed, so a layout mistake is named."""
    initializers = {init.name for init in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ModelContractError(
            f"model.source {str(path)!r}: the graph has {len(inputs)} inputs ({[i.name for i in inputs]}); the "
            "worker feeds one image batch"
        )
    dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[0].type.tensor_type.shape.dim]
    fed = list(sample_shape[1:])
    declared = dims[1:]
    if len(declared) != len(fed) or any(d is not None and d != f for d, f in zip(declared, fed, strict=True)):
        shown = ["N", *("?" if d is None else d for d in declared)]
        raise ModelContractError(
            f"model.source {str(path)!r}: the graph's input {inputs[0].name!r} is {shown}, but the worker would "
            f"feed [N, {', '.join(map(str, fed))}] ({contract.describe_input()}); set model.input_layout "
            "(NCHW or NHWC) and model.input_size to match the graph",
            setting="model.input_layout",
        )


def _check_trace(module: nn.Module, traced: torch.jit.ScriptModule, sample_shape: tuple[int, ...],
                 path: Path) -> None:
    """A trace can bake the batch size into a reshape; run both on another batch size and compare."""
    probe = torch.rand((VALIDATION_BATCH + 1, *sample_shape[1:])) * 255.0
    try:
        want, got = module(probe), traced(probe)
        same = isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.shape == got.shape and \
            torch.allclose(want, got, rtol=TRACE_CHECK_TOLERANCE, atol=TRACE_CHECK_TOLERANCE)
    except Exception as exc:  # whatever the converted graph raises, the message names it
        raise ModelContractError(
            f"model.source {str(path)!r}: the converted model fails on a batch of {VALIDATION_BATCH + 1} "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); export the "
            "ONNX model with a dynamic batch dimension"
        ) from exc
    if not same:
        raise ModelContractError(
            f"model.source {str(path)!r}: tracing the converted model changed its output on a batch of "
            f"{VALIDATION_BATCH + 1} (a shape computed from the batch size); export the ONNX model with a dynamic "
            "batch dimension, or export the original to TorchScript / torch.export"
        )


def _save_atomically(module: torch.jit.ScriptModule, target: Path) -> None:
    """Write next to the target and rename, so a concurrent start never reads half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        module.save(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
