"""The device data path (`runtime.decode = "device"`): a batch's frames decoded, resized and cropped on the
runner's device, so a GPU is fed compressed bytes instead of pixels the host decoded.

What must be strict stays on the host, before any byte reaches a decoder: every frame passes the CPU path's own
checks (`decode.check_frame`: dimensions, the pixel limit, a RAW_RGB8 frame's byte count, and a JPEG's structure
walk against its frame header, which refuses bombs, data cut short even when closed with an EOI marker, and stray
bytes). The checked bytes are staged in one host buffer (pinned on CUDA), the JPEGs decoded in one batched
`torchvision.io.decode_jpeg(list, device=...)` call (nvJPEG on CUDA; libjpeg on a CPU, which is how this path
is tested without a GPU) and raw frames copied as uint8. Each group of frames of one size is then resized
(bilinear, antialiased when shrinking, in float32 and rounded once), cropped or letterboxed as the
`ModelContract` says, in torch on the device, into the runner's uint8 NHWC rows; the runner normalises them in
its graph as on the CPU path. With a model set each frame is decoded once and resized for each model into that
model's rows; its models must then take one channel count (`deviceplan.device_decode_serves`). On CUDA the decode
runs on a stream of its own (`OrderedDecode`: nvJPEG writes from its own stream into memory allocated on the
caller's, without waiting for it), the rest on the runner's copy stream, and the batch's `ready_event` marks
its end. A batched decode that fails is retried frame by frame, so only the frame that fails is reported.

Where it differs from the CPU path (`preprocess.Preprocessor`): JPEGs are decoded at full size (no
`jpeg_scaled_decode`); the resize is torch's float filter whatever `resampler` says (within a grey level of
both CPU resamplers); nvJPEG upsamples 4:2:0 chroma nearest-neighbour where libjpeg-turbo interpolates (tens
of grey levels at colour edges); CMYK JPEGs (print files) are decoded on the host and uploaded; and its decoders are not
strict about corrupt entropy-coded data inside a structurally complete JPEG (bit flips in a scan), which the CPU
path's strict libjpeg refuses: such a frame is scored as decoded. docs/configuration.md has the figures.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.io as tvio
from PIL import Image

from worker.frames import Frame
from worker.runtime.decode import FrameDecodeError, check_frame, decode_pixels
from worker.runtime.fitting import check_fits_batch, jpeg_roundtrip, resize_target, to_channels
from worker.runtime.hostbatch import HostBatch, ModelInput
from worker.runtime.models import ModelContract
from worker.runtime.streams import STREAMS, StreamRegistry

log = logging.getLogger(__name__)

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec (0.26, on the GPU machines, does not); the
# calls used here are in both.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)

# At most this many bytes of float32 pixels per resize call: a batch of 32 1080p frames is 800 MB in float32.
RESIZE_CHUNK_BYTES = 128 << 20
_CPP_LOCATION = re.compile(r"^.*\.cpp:\d+,?\s*")


class ByteStaging:
    """1-D uint8 buffers carrying a batch's JPEG bytes and raw pixels to the device, reused across batches
    (pinned on CUDA, where allocating pinned memory costs more than copying into it). Thread-safe; holds at most
    `max_bytes` of idle buffers."""

    def __init__(self, pin_memory: bool = False, max_bytes: int = 256 << 20):
        self.pin_memory = pin_memory
        self.max_bytes = max_bytes
        self._idle: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> buffer, least recently returned first
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` bytes (contents undefined): the smallest idle one that holds them."""
        with self._lock:
            fits = [(buf.numel(), key) for key, buf in self._idle.items() if buf.numel() >= nbytes]
            if fits:
                buf = self._idle.pop(min(fits)[1])
                self._idle_bytes -= buf.numel()
                return buf
        capacity = 1 << max(16, (max(1, nbytes) - 1).bit_length())  # powers of two: few distinct buffers
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin_memory)

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle[id(buf)] = buf
            self._idle_bytes += buf.numel()
            while self._idle_bytes > self.max_bytes:
                _, oldest = self._idle.popitem(last=False)
                self._idle_bytes -= oldest.numel()


class DecodeTurn:
    """One decode at a time, and the event marking the end of the last one (see `OrderedDecode`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.previous: torch.cuda.Event | None = None


# torchvision keeps one nvJPEG decoder per process, behind a lock: the turn is process-wide too.
NVJPEG_TURN = DecodeTurn()


class OrderedDecode:
    """torchvision's batched CUDA decode, ordered against the GPU work around it (pytorch/vision issue 9606,
    torchcodec issue 1634).

    `decode_jpeg(list, device="cuda")` allocates its outputs on the caller's current stream, then nvJPEG writes
    them from its own stream without waiting for that one. The caching allocator hands a block freed on a
    stream to the next request on the same stream at once, trusting stream order: called on the runner's copy
    stream, a decode could be given memory that the previous batch's queued resize still reads, and write over
    it (wrong pixels, silently). So the call runs on `stream`, a stream of its own on which no kernel of ours
    runs (torchvision makes it wait for nvJPEG before returning); the consumer stream waits for it, and each
    output is recorded on the consumer, so its memory is not handed out again before the consumer is done.

    One at a time (torchvision keeps one nvJPEG decoder per process behind a lock): before each call the thread
    sleeps on a blocking event until the previous decode is done, so that nvJPEG's own wait for its stream at
    the start of the call finds nothing to spin on."""

    def __init__(self, stream: torch.cuda.Stream, decode: Callable[..., list] | None = None,
                 use_stream: Callable[[torch.cuda.Stream], contextlib.AbstractContextManager] = torch.cuda.stream,
                 make_event: Callable[[], torch.cuda.Event] = lambda: torch.cuda.Event(blocking=True),
                 turn: DecodeTurn = NVJPEG_TURN) -> None:
        self.stream = stream
        self._decode = decode or decode_jpegs
        self._use_stream = use_stream
        self._make_event = make_event
        self._turn = turn

    def __call__(self, data: list[torch.Tensor], mode: tvio.ImageReadMode, device: torch.device,
                 consumer: torch.cuda.Stream) -> list[torch.Tensor | FrameDecodeError]:
        with self._turn.lock:
            if self._turn.previous is not None:
                self._turn.previous.synchronize()
            with self._use_stream(self.stream):
                out = self._decode(data, mode, device)
            done = self._make_event()
            done.record(self.stream)
            self._turn.previous = done
        consumer.wait_stream(self.stream)
        for image in out:
            if not isinstance(image, FrameDecodeError):
                image.record_stream(consumer)
        return out


@dataclass
class _Staged:
    """One checked frame of a batch: a JPEG for the device's decoder, or host pixels (a raw frame, or a CMYK JPEG
    decoded on the host) to upload as they are; where its bytes sit in the staging buffer."""

    index: int
    frame: Frame
    host: np.ndarray | None = None  # (h, w, model channels) uint8; None for a JPEG decoded on the device
    start: int = 0
    stop: int = 0


class DevicePreprocessor:
    """Frames -> the runners' uint8 NHWC batch, one per model (a single model's, or a set's: each frame decoded
    once, then resized for each model), made on their device (see the module docstring); thread-safe. Every model
    takes the same channel count (`deviceplan.device_decode_serves` sends other sets to the host path).

    With a `pool` of `workers` threads, the host part of a JPEG round trip (`model.jpeg_roundtrip_quality`) is
    spread across them; `prepare` must then not itself run on that pool. `steps`: the decode and the resize it runs
    on the device (`DeviceSteps`; by default torchvision's decode and `fit_on_device`)."""

    def __init__(self, contracts: ModelContract | Sequence[ModelContract], staging: ByteStaging | None = None,
                 pool: concurrent.futures.Executor | None = None, workers: int = 1, streams: StreamRegistry = STREAMS,
                 steps: DeviceSteps | None = None):
        self.contracts = (contracts,) if isinstance(contracts, ModelContract) else tuple(contracts)
        if len({c.channels for c in self.contracts}) != 1:
            raise ValueError("DevicePreprocessor decodes to one channel count: every model must take the same")
        self.contract = contract = self.contracts[0]
        self._steps = steps or DeviceSteps()
        self.staging = staging or ByteStaging()
        self._pool = pool if workers > 1 else None
        self._workers = workers
        self._mode = tvio.ImageReadMode.GRAY if contract.channels == 1 else tvio.ImageReadMode.RGB
        self._streams = streams
        self._decoders: dict[torch.device, OrderedDecode] = {}  # per CUDA device, made at its first batch
        self._decoders_lock = threading.Lock()

    def prepare(self, frames: Sequence[Frame], shape: tuple[int, int, int], device: torch.device | str,
                stream: torch.cuda.Stream | None = None) -> HostBatch:
        """The batch on `device` (`pixels` and `device_pixels` are the same device tensor); frames that fail a
        check or their decode are `failures` beside it. On CUDA the work is queued on `stream` (the runner's copy
        stream) and `ready_event` recorded after it."""
        started_at = time.time()
        t0 = time.perf_counter()
        frames = list(frames)
        device = torch.device(device)
        failures: dict[int, FrameDecodeError] = {}
        staged: list[_Staged] = []
        for i, frame in enumerate(frames):
            try:
                staged.append(self._admit(i, frame, (shape[0], shape[1])))
            except FrameDecodeError as exc:
                failures[i] = exc
        buffer = self._stage(staged)
        with _on(device, stream), torch.no_grad():
            images = self._to_device(staged, buffer, device, failures)
            kept = [i for i in range(len(frames)) if i in images]
            inputs = [self._fitted(contract, [(frames[i], images[i]) for i in kept], shape, device)
                      for contract in self.contracts]
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        return HostBatch(
            frames=[frames[i] for i in kept],
            inputs=inputs,
            failures=[(frames[i], failures[i]) for i in sorted(failures)],
            started_at=started_at,
            preprocess_ms=(time.perf_counter() - t0) * 1000.0,
            ready_event=event,
            release=lambda: self.staging.give_back(buffer),
        )

    def _fitted(self, contract: ModelContract, items: list[tuple[Frame, torch.Tensor]], shape: tuple[int, int, int],
                device: torch.device) -> ModelInput:
        """The decoded frames fitted to one model's input, on the device (`pixels` is `device_pixels`)."""
        hwc = (*contract.model_input_hw((shape[0], shape[1])), contract.channels)
        out = torch.zeros((len(items), *hwc), dtype=torch.uint8, device=device)
        regions = self._fit(out, items, contract)
        if contract.jpeg_roundtrip_quality and items:
            out = self._roundtrip(out, regions, contract.jpeg_roundtrip_quality)
        full = (0, 0, hwc[0], hwc[1])
        host_regions = None if all(r == full for r in regions) else torch.tensor(regions, dtype=torch.int32)
        return ModelInput(pixels=out, regions=host_regions, device_pixels=out,
                          device_regions=None if host_regions is None else host_regions.to(device))

    def _admit(self, index: int, frame: Frame, batch_hw: tuple[int, int]) -> _Staged:
        """The CPU path's checks, before any byte is decoded; FrameDecodeError when the frame fails one."""
        for contract in self.contracts:
            check_fits_batch(contract, frame, batch_hw)
        info = check_frame(frame)
        if info is not None and info.components != 4:
            return _Staged(index, frame)
        # A raw frame is uploaded as it is (its channels converted as on the CPU path); a CMYK JPEG (print files,
        # never video) is decoded on the host as on the CPU path, which neither nvJPEG nor libjpeg's RGB output do.
        pixels = decode_pixels(frame, frame.channels if info is None else self.contract.channels)
        return _Staged(index, frame, np.ascontiguousarray(to_channels(pixels, self.contract.channels)))

    def _stage(self, staged: list[_Staged]) -> torch.Tensor:
        """Copy every frame's bytes into one staging buffer: the JPEGs, then the raw pixels in one span (one copy
        to the device)."""
        staged.sort(key=lambda s: s.host is not None)
        sizes = [len(s.frame.data) if s.host is None else s.host.nbytes for s in staged]
        buffer = self.staging.take(sum(sizes))
        host = buffer.numpy().data  # a memoryview: assigning bytes to its slice costs a quarter of numpy's
        pos = 0
        for s, size in zip(staged, sizes):
            host[pos:pos + size] = s.frame.data if s.host is None else s.host.reshape(-1).data
            s.start, s.stop = pos, pos + size
            pos += size
        return buffer

    @staticmethod
    def _jpeg_views(jpegs: list[_Staged], buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each staged JPEG's bytes as a view of the staging buffer, cut in one call (they lie first, in order)."""
        return list(torch.split(buffer[:jpegs[-1].stop], [s.stop - s.start for s in jpegs]))

    def _to_device(self, staged: list[_Staged], buffer: torch.Tensor, device: torch.device,
                   failures: dict[int, FrameDecodeError]) -> dict[int, torch.Tensor]:
        """Frame index -> its pixels on the device as (channels, height, width) uint8; a frame whose JPEG does not
        decode (or decodes to another size than its header's) goes to `failures`."""
        images: dict[int, torch.Tensor] = {}
        jpegs = [s for s in staged if s.host is None]
        if jpegs:
            data = self._jpeg_views(jpegs, buffer)
            if device.type == "cuda":
                decoded = self._decoder(device)(data, self._mode, device, torch.cuda.current_stream(device))
            else:
                decoded = self._steps.decode(data, self._mode, device)
            for s, image in zip(jpegs, decoded):
                expected = (self.contract.channels, s.frame.height, s.frame.width)
                if isinstance(image, FrameDecodeError):
                    failures[s.index] = image
                elif tuple(image.shape) != expected:
                    failures[s.index] = FrameDecodeError(
                        f"JPEG decoded to {list(image.shape)} (channels, height, width), not the {list(expected)} its "
                        "header and the model give")
                else:
                    images[s.index] = image
        raws = [s for s in staged if s.host is not None]
        if raws:
            lo = raws[0].start
            span = buffer[lo:raws[-1].stop].to(device, non_blocking=True)
            for s in raws:
                assert s.host is not None
                images[s.index] = span[s.start - lo:s.stop - lo].view(s.host.shape).permute(2, 0, 1)
        return images

    def _decoder(self, device: torch.device) -> OrderedDecode:
        with self._decoders_lock:
            decoder = self._decoders.get(device)
            if decoder is None:
                stream = self._streams.take(device, "the device path's decoding", self)
                decoder = self._decoders[device] = OrderedDecode(stream, decode=self._steps.decode)
            return decoder

    def _fit(self, out: torch.Tensor, items: list[tuple[Frame, torch.Tensor]],
             contract: ModelContract) -> list[tuple[int, int, int, int]]:
        """Write each item's pixels into its row of `out`, resized / cropped / letterboxed per `contract`, frames
        of one size together; each row's (top, left, height, width) region of real pixels."""
        regions: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(items)
        by_size: dict[tuple[int, int], list[int]] = {}
        for row, (_, image) in enumerate(items):
            by_size.setdefault((int(image.shape[1]), int(image.shape[2])), []).append(row)
        for (h, w), rows in by_size.items():
            per_call = max(1, RESIZE_CHUNK_BYTES // (4 * contract.channels * h * w))
            for lo in range(0, len(rows), per_call):
                chunk = rows[lo:lo + per_call]
                pixels, (top, left) = self._steps.fit(torch.stack([items[r][1] for r in chunk]), contract)
                ph, pw = int(pixels.shape[2]), int(pixels.shape[3])
                # Rows in a run (every frame of a batch of one size) as a slice: an index tensor is a host->device
                # copy from pageable memory, which waits.
                index: slice | torch.Tensor = (slice(chunk[0], chunk[-1] + 1) if chunk[-1] - chunk[0] == len(chunk) - 1
                                               else torch.tensor(chunk, dtype=torch.long, device=out.device))
                out[index, top:top + ph, left:left + pw] = pixels.permute(0, 2, 3, 1)
                for r in chunk:
                    regions[r] = (top, left, ph, pw)
        return regions

    def _roundtrip(self, out: torch.Tensor, regions: list[tuple[int, int, int, int]], quality: int) -> torch.Tensor:
        """`model.jpeg_roundtrip_quality` on the host (Pillow, as the CPU path): each row's real pixels through a
        JPEG encode and decode, spread over the pool; the rows go back to the device."""
        host = out.cpu().numpy()

        def rows(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                top, left, h, w = regions[i]
                cut = np.ascontiguousarray(host[i, top:top + h, left:left + w])
                host[i, top:top + h, left:left + w] = jpeg_roundtrip(cut, quality)

        n = len(regions)
        chunks = min(n, self._workers) if self._pool is not None else 1
        if chunks <= 1:
            rows(0, n)
        else:
            assert self._pool is not None
            bounds = [n * k // chunks for k in range(chunks + 1)]
            for f in [self._pool.submit(rows, lo, hi) for lo, hi in zip(bounds, bounds[1:])]:
                f.result()
        return torch.from_numpy(host).to(out.device)


def fit_on_device(images: torch.Tensor, contract: ModelContract) -> tuple[torch.Tensor, tuple[int, int]]:
    """[n, C, h, w] uint8 frames of one size -> their pixels in the model input as the contract says, and their
    (top, left) offset in it (non-zero only for letterbox): `fitting.fit_to_input`'s semantics, on the device."""
    size = contract.input_size
    h, w = int(images.shape[2]), int(images.shape[3])
    target = resize_target(contract, (h, w))
    if size is None or target is None:
        return images, (0, 0)
    resized = resize_on_device(images, target)
    if contract.resize == "letterbox":
        return resized, ((size[0] - target[0]) // 2, (size[1] - target[1]) // 2)
    if contract.resize in ("shorter_side_crop", "stretch_crop"):
        top, left = (target[0] - size[0]) // 2, (target[1] - size[1]) // 2
        return resized[:, :, top:top + size[0], left:left + size[1]], (0, 0)
    return resized, (0, 0)


def resize_on_device(images: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of [n, C, h, w] uint8, antialiased when shrinking (Pillow's filter, as the CPU path's
    resamplers), computed in float32 and rounded once: the same call on a GPU and a CPU."""
    if (int(images.shape[2]), int(images.shape[3])) == size_hw:
        return images
    resized = F.interpolate(images.float(), size=size_hw, mode="bilinear", align_corners=False, antialias=True)
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def decode_jpegs(data: list[torch.Tensor], mode: tvio.ImageReadMode,
                 device: torch.device) -> list[torch.Tensor | FrameDecodeError]:
    """Decode the JPEGs (1-D uint8 host tensors) on `device` in one batched call; when it fails, each frame alone,
    so that only the frames that fail are reported (each as a FrameDecodeError saying why)."""
    try:
        return list(tvio.decode_jpeg(data, mode=mode, device=device))
    except Exception as exc:  # noqa: BLE001 (torchvision raises RuntimeError or ValueError; each frame is retried)
        if len(data) == 1:
            return [_decode_error(exc)]
        log.debug("batched JPEG decode failed; decoding frame by frame size=%d error=%s", len(data), exc)
    out: list[torch.Tensor | FrameDecodeError] = []
    for one in data:
        try:
            out.append(tvio.decode_jpeg([one], mode=mode, device=device)[0])
        except Exception as exc:  # noqa: BLE001 (this frame alone fails)
            out.append(_decode_error(exc))
    return out


@dataclass(frozen=True)
class DeviceSteps:
    """What the device does to a batch: decode its JPEGs, and fit frames of one size into a model's input. A
    benchmark without a device stands them in (bench/host_cost.py); the rest of DevicePreprocessor runs as it is."""

    decode: Callable[[list[torch.Tensor], tvio.ImageReadMode, torch.device],
                     list[torch.Tensor | FrameDecodeError]] = decode_jpegs
    fit: Callable[[torch.Tensor, ModelContract], tuple[torch.Tensor, tuple[int, int]]] = fit_on_device


def check_device_decode(device: torch.device | str) -> None:
    """Decode a small JPEG on `device` as a batch would: raises (RuntimeError, ...) when this torchvision cannot,
    e.g. a build without its image extension or without nvJPEG. Also pays the decoder's set-up before the first
    batch."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 60)).save(buf, format="JPEG", quality=90)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    with torch.no_grad():
        [image] = tvio.decode_jpeg([data], mode=tvio.ImageReadMode.RGB, device=torch.device(device))
    if tuple(image.shape) != (3, 8, 16):
        raise RuntimeError(f"a 16x8 JPEG decoded to shape {list(image.shape)} on {device}")


def _decode_error(exc: BaseException) -> FrameDecodeError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return FrameDecodeError(f"JPEG does not decode: {_CPP_LOCATION.sub('', text)}")


@contextlib.contextmanager
def _on(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        yield
