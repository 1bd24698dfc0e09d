"""Helpers of the runtime tests: tiny model factories loaded by `module:function` (as a user's model.source
names them), CPU runners standing in for devices, and builders of test frames.

The tests put this folder on sys.path and name the factories "model_factories:<function>".
"""

from __future__ import annotations

import io
import threading

import numpy as np
import torch
from PIL import Image
from torch import nn

from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.runtime.models import ModelContract
from worker.runtime.runners import EagerRunner, RunResult

NUM_LABELS = 5
# A frame whose top-left pixel is pure red (255, 0, 0) carries the marker: channel 0 at (0, 0) normalises to
# (1 - 0.485) / 0.229 = 2.25, which no other test frame reaches there (they use values <= 200).
MARKER_THRESHOLD = 2.0


class TinyNet(nn.Module):
    def __init__(self, num_labels: int = NUM_LABELS):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyNet()


def wrong_output_model() -> nn.Module:
    return TinyNet(num_labels=3)


def not_a_module() -> str:
    return "not a model"


def failing_factory() -> nn.Module:
    raise RuntimeError("weights server unreachable")


class TupleOutput(TinyNet):
    def forward(self, x: torch.Tensor):  # type: ignore[override]
        return super().forward(x), x


def tuple_output_model() -> nn.Module:
    return TupleOutput()


def _has_marker(x: torch.Tensor) -> torch.Tensor:
    return x[:, 0, 0, 0] > MARKER_THRESHOLD


class PoisonNet(TinyNet):
    """Raises when any frame of the batch carries the marker, like a model with a data-dependent bug."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(_has_marker(x).any()):
            raise ValueError("poisoned input")
        return super().forward(x)


def poison_model() -> nn.Module:
    torch.manual_seed(0)
    return PoisonNet()


class NaNNet(TinyNet):
    """Outputs NaN for the rows that carry the marker."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return torch.where(_has_marker(x)[:, None], torch.full_like(out, float("nan")), out)


def nan_model() -> nn.Module:
    torch.manual_seed(0)
    return NaNNet()


class ItemGatedNet(TinyNet):
    """Reads a value of its activations on the host (`.item()`): a device-to-host sync no CUDA graph captures."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.mean().item() > 100.0:  # the host-sync line the start-up check names
            out = out / 2
        return out


def item_gated_model() -> nn.Module:
    torch.manual_seed(0)
    return ItemGatedNet()


class Gate:
    """Blocks the first model call after arm() (only that one) until release(), holding an inference open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self.entered = threading.Event()
        self.released = threading.Event()

    def arm(self) -> None:
        with self._lock:
            self.entered.clear()
            self.released.clear()
            self._armed = True

    def release(self) -> None:
        with self._lock:
            self._armed = False
        self.released.set()

    def pass_through(self) -> None:
        with self._lock:
            hold, self._armed = self._armed, False
        if hold:
            self.entered.set()
            if not self.released.wait(timeout=30):
                raise TimeoutError("gate was never released")


GATE = Gate()


class GatedNet(TinyNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        GATE.pass_through()
        return super().forward(x)


def gated_model() -> nn.Module:
    torch.manual_seed(0)
    return GatedNet()


# --- runners standing in for devices ---

class DeviceProbe:
    """A fake GPU's memory (worker.devices.memory.MemoryProbe) for the CPU runner standing in for it: `base` bytes
    held (the model), `per_frame` more for each frame of a batch its runner runs."""

    def __init__(self, total: int, base: int, per_frame: int) -> None:
        self.total, self.base, self.per_frame = total, base, per_frame
        self.peak = base

    def total_bytes(self) -> int:
        return self.total

    def reset_peak(self) -> None:
        self.peak = self.base

    def peak_bytes(self) -> int:
        return self.peak

    def ran(self, n: int) -> None:
        self.peak = max(self.peak, self.base + self.per_frame * n)


class StandInRunner(EagerRunner):
    """A CPU runner standing in for one device (or one instance on it): records the batch sizes it runs and reports
    them to its device's `probe`; holds each batch while `gate` is cleared (`entered` tells one is held); once
    `broken`, raises on every batch as a failed device would."""

    def __init__(self, contract: ModelContract, probe: DeviceProbe | None = None) -> None:
        super().__init__(tiny_model(), contract, torch.device("cpu"))
        self.probe = probe
        self.sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.broken = False

    def run(self, pixels: torch.Tensor, ready=None, regions=None) -> RunResult:
        n = int(pixels.shape[0])
        self.sizes.append(n)
        if self.probe is not None:
            self.probe.ran(n)
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("the runner's gate was never opened")
        if self.broken:
            raise RuntimeError("device lost")
        return super().run(pixels, ready, regions)


# --- frames ---

def pixels(seed: int, height: int, width: int, marker: bool = False) -> np.ndarray:
    """Deterministic (height, width, 3) uint8 pixels in 0..200; `marker` makes the top-left pixel pure red."""
    img = np.random.default_rng(seed).integers(0, 201, (height, width, 3), dtype=np.uint8)
    if marker:
        img[0, 0] = (255, 0, 0)
    return img


def raw_frame(index: int, height: int = 32, width: int = 32, *, data: bytes | None = None,
              marker: bool = False, channels: int = 3) -> Frame:
    if data is None:
        data = pixels(index, height, width, marker).tobytes()
    return _frame(index, height, width, channels, Encoding.RAW_RGB8, data)


def jpeg_frame(index: int, height: int = 32, width: int = 32, *, data: bytes | None = None,
               declared: tuple[int, int] | None = None) -> Frame:
    """A JPEG frame; `declared` = (height, width) overrides the dimensions written in the header."""
    if data is None:
        buf = io.BytesIO()
        Image.fromarray(pixels(index, height, width)).save(buf, format="JPEG", quality=95)
        data = buf.getvalue()
    h, w = declared or (height, width)
    return _frame(index, h, w, 3, Encoding.JPEG, data)


def _frame(index: int, height: int, width: int, channels: int, encoding: Encoding, data: bytes) -> Frame:
    return Frame(stream_id="cam", frame_index=index, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                 width=width, height=height, channels=channels, encoding=encoding, data=data,
                 source=SourceRef("frames.standard", 0, index))


def scaled_model(num_labels: int = NUM_LABELS, scale: float = 1.0) -> nn.Module:
    """A factory taking keyword arguments, as model.options passes them."""
    torch.manual_seed(0)
    model = TinyNet(num_labels)
    with torch.no_grad():
        model.head.weight.mul_(scale)
    return model
