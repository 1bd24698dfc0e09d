"""uint8 NHWC pixels -> the model's float input, in torch on the runner's device (inside its CUDA graph where it
captures one)."""

from __future__ import annotations

import numpy as np
import torch

from worker.runtime.models import ModelContract

# The largest float batch a CPU runner's Normaliser keeps between batches (a larger one is allocated per batch).
REUSED_INPUT_MAX_BYTES = 256 << 20


class Normaliser:
    """uint8 NHWC pixels -> the model's float32 input (channel order, scale, mean/std, layout), in torch on the
    pixels' device; zero outside each row's region. Computes pixel * (unit / std) - mean / std in float32,
    the same two roundings the reference preprocessing makes. Build one per device before any graph capture.

    The arithmetic runs on the contiguous NHWC tensor, each image row as one vector with scale and bias tiled
    along it: on CPU a per-channel broadcast over an innermost dimension of 3, or a strided NHWC -> NCHW copy,
    costs two to four times as much. An NCHW model therefore gets an NCHW-shaped tensor in channels_last memory
    format (torch.channels_last: the layout convolutions prefer on CPU and GPU); `validate_output` feeds the
    same at load, so a model that needs contiguous NCHW memory fails there, not on the first batch.

    `contiguous=True` (a runtime that takes contiguous NCHW memory only: onnxruntime) writes each channel's plane
    straight from the NHWC pixels instead, and scales them as planes: no second copy into the layout the session
    takes (at 320x320, 0.25 against 0.54 CPU-ms a frame for normalise plus that copy). Same values, bit for bit."""

    def __init__(self, contract: ModelContract, device: torch.device | str = "cpu", contiguous: bool = False):
        c = contract.channels
        unit = 1.0 / 255.0 if contract.pixel_range == "0-1" else 1.0
        std = np.asarray(contract.std, dtype=np.float32)
        mean = np.asarray(contract.mean, dtype=np.float32)
        self._nchw = contract.input_layout == "NCHW"
        self._planes = contiguous and self._nchw and c > 1
        # (pixel * unit - mean) / std  ==  pixel * scale - bias, with scale and bias rounded to float32 once.
        self._scale = torch.from_numpy((unit / std).astype(np.float32)).to(device)
        self._bias = torch.from_numpy((mean / std).astype(np.float32)).to(device)
        self._bgr = contract.channel_order == "BGR" and c == 3
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # width -> scale and bias tiled along a row
        # On a CPU, the float batch is written into one buffer kept from batch to batch (see _output).
        self._reuse = torch.device(device).type == "cpu"
        self._buffer: torch.Tensor | None = None

    def __call__(self, pixels: torch.Tensor, regions: torch.Tensor | None = None) -> torch.Tensor:
        if self._planes:
            return self._as_planes(pixels, regions)
        n, h, w, c = pixels.shape
        out = self._output((n, h, w, c), pixels.device)
        if self._bgr:
            for i in range(3):  # channel by channel: half the cost of pixels.flip(-1) on CPU
                out[..., i].copy_(pixels[..., 2 - i])
        else:
            out.copy_(pixels)
        scale, bias = self._tiled(w)
        rows = out.view(n * h, w * c)
        rows.mul_(scale).sub_(bias)
        if regions is not None:
            # A region is a rectangle: multiply the image rows by 1 inside it and 0 outside, then the columns
            # (each widened to its c values first: a broadcast over an innermost dimension of c is slow); adding
            # 0.0 turns the -0.0 of negative values times 0 into 0.0 and changes nothing else. Four times
            # cheaper on CPU than masked_fill_.
            rows_in, cols_in = _inside(regions, h, w)
            image = out.view(n, h, w * c)
            image.mul_(rows_in.to(out.dtype).unsqueeze(2))
            image.mul_(cols_in.to(out.dtype).unsqueeze(2).expand(n, w, c).reshape(n, 1, w * c))
            image.add_(0.0)
        return out.permute(0, 3, 1, 2) if self._nchw else out

    def _as_planes(self, pixels: torch.Tensor, regions: torch.Tensor | None) -> torch.Tensor:
        """Contiguous NCHW: a plane per channel copied from the pixels, then scaled per channel over whole planes
        (a broadcast over a middle dimension: the innermost one is the plane's h * w values)."""
        n, h, w, c = pixels.shape
        out = self._output((n, c, h, w), pixels.device)
        for i in range(c):
            out[:, i].copy_(pixels[..., 2 - i if self._bgr else i])
        planes = out.view(n, c, h * w)
        planes.mul_(self._scale.view(1, c, 1)).sub_(self._bias.view(1, c, 1))
        if regions is not None:
            rows_in, cols_in = _inside(regions, h, w)  # see __call__: adding 0.0 turns -0.0 into 0.0
            out.mul_(rows_in.to(out.dtype).view(n, 1, h, 1))
            out.mul_(cols_in.to(out.dtype).view(n, 1, 1, w))
            out.add_(0.0)
        return out

    def _output(self, shape: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
        """The float batch's memory. On a CPU, a view of one buffer kept from batch to batch (up to
        REUSED_INPUT_MAX_BYTES): a fresh one is fresh pages, whose first touch made normalising a 224x224 frame cost
        77-84 us instead of 42-47. The runner's thread alone uses it, and the batch's scores are copied off it
        (ScoresToHost) before the next batch. On CUDA the caching allocator hands back warm memory already, and a
        graph's capture must allocate from its own pool: a fresh tensor there."""
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        if not self._reuse or 4 * numel > REUSED_INPUT_MAX_BYTES:
            return torch.empty(shape, dtype=torch.float32, device=device)
        if self._buffer is None or self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return self._buffer[:numel].view(shape)

    def _tiled(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and bias repeated for one image row of `width` pixels (made once per width; a graph's warm-up
        makes its widths' before capture)."""
        tiled = self._rows.get(width)
        if tiled is None:
            tiled = self._rows[width] = (self._scale.repeat(width), self._bias.repeat(width))
        return tiled


def _inside(regions: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] and [n, W] bool: the rows and the columns inside each row's (top, left, height, width) region.
    Shape-static (graph-safe)."""
    top, left, h, w = (regions[:, i:i + 1] for i in range(4))
    ys = torch.arange(height, device=regions.device)
    xs = torch.arange(width, device=regions.device)
    return (ys >= top) & (ys < top + h), (xs >= left) & (xs < left + w)
