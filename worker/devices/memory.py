"""Memory-aware caps for a GPU runner: pure policy (no torch), fed by a probe that reads device memory.

- Peaks: the peak device memory of a batch of n frames of a shape (the runner's input: the model's (H, W, C))
  is measured at graph capture and at warm-up calibration (`measure`, which also records what was allocated
  before the batch as its 0-frame point); between measurements it is a line base + per_frame * n through
  them (one point alone: through the origin, conservatively scaled), so a size never measured is predicted.
- Largest batch: `max_batch(shape, cap)` is the largest n <= cap whose predicted peak stays under
  `memory_fraction` of the device's total memory (worker.devices.graphplan decides from it which CUDA-graph buckets
  are worth capturing). A device whose `runners` (runtime.instances_per_device) may each run a batch at once
  counts each batch's own memory (its peak above the 0-frame point) that many times.
- Several devices: one policy per device, from its own probe. `DeviceMemories` is the batcher's view of them:
  the executor splits a batch larger than one device takes across devices (`split_batch`), so a shape's
  largest batch is what the devices take together.
- Captured graphs: a `GraphBudget` per runner keeps its graphs' measured memory under a share of
  `graph_budget_bytes`, evicting the least recently replayed; the runner releases what it returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar, cast

Shape = tuple[int, int, int]
K = TypeVar("K", bound=Hashable)

# Device memory the device data path (runtime.decode = "device") holds outside PyTorch's allocator, so no peak
# measured here sees it: torchvision's one nvJPEG decoder per process allocates its device buffers with
# cudaMalloc (Huffman-decoded DCT coefficients, 2 bytes a sample, 1.5 samples a pixel for 4:2:0: a batch of 32
# 1080p frames is about 200 MB, 4:4:4 twice that) and keeps them between calls. An estimate from nvJPEG's
# layout, not a GPU measurement yet; taken off each device's limit where the device path decodes.
NVJPEG_HEADROOM_BYTES = 256 << 20


class MemoryProbe(Protocol):
    """What the policy needs from a device (worker.runtime: torch.cuda on a GPU; tests: a fake)."""

    def total_bytes(self) -> int: ...

    def reset_peak(self) -> None:
        """Start a measurement: from now the peak is what is allocated now."""

    def peak_bytes(self) -> int: ...


class BatchSizeLimit(Protocol):
    """What the batcher asks of device memory (a MemoryPolicy, or DeviceMemories over several devices)."""

    def max_batch(self, shape: Shape, cap: int) -> int | None:
        """Largest n <= cap that fits; None when the shape was never measured."""


class MemoryPolicy:
    """Largest batch per shape under a device memory fraction, and the device's byte budget for captured graphs."""

    def __init__(self, total_bytes: int, memory_fraction: float = 0.8, graph_budget_bytes: int | None = None,
                 runners: int = 1, headroom_bytes: int = 0):
        """`headroom_bytes`: device memory held outside PyTorch's allocator (NVJPEG_HEADROOM_BYTES where frames
        are decoded on the device), taken off the limit."""
        if not 0 < memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        if runners < 1:
            raise ValueError("runners must be >= 1")
        if not 0 <= headroom_bytes < total_bytes * memory_fraction:
            raise ValueError("headroom_bytes must be >= 0 and below memory_fraction of the device's memory")
        self.limit_bytes = int(total_bytes * memory_fraction) - headroom_bytes
        # Runners of this device: each may run a batch at the same time as the others.
        self.runners = runners
        # Captured graphs' memory on one device (its runners share it), unless given a budget of its own.
        self.graph_budget_bytes = self.limit_bytes // 4 if graph_budget_bytes is None else graph_budget_bytes
        self._peaks: dict[Shape, dict[int, int]] = {}
        # max_batch answers for measured shapes, each with the count of peaks recorded when it was computed: the
        # batcher asks every time it makes a group (a scan of every size up to the cap), peaks change at warm-up.
        self._recorded = 0
        self._max_batch: dict[tuple[Shape, int], tuple[int, int]] = {}

    # -- batch sizes -----------------------------------------------------------------------------------------
    def record_peak(self, shape: Shape, n: int, peak_bytes: int) -> None:
        """The measured peak device memory of one batch of n frames of `shape` (the largest seen is kept)."""
        seen = self._peaks.setdefault(tuple(shape), {})  # type: ignore[arg-type]
        seen[n] = max(peak_bytes, seen.get(n, 0))
        self._recorded += 1

    def measure(self, probe: MemoryProbe, shape: Shape, n: int, run: Callable[[], object]) -> int:
        """Run one batch under the probe and record its peak, and what was allocated before it as the 0-frame
        point: one measured size then already predicts the next from the model's own size, not through 0 (a
        model taking half the device would otherwise make a batch of 2 look as if it could never fit)."""
        probe.reset_peak()
        before = probe.peak_bytes()
        run()
        peak = probe.peak_bytes()
        self.record_peak(shape, 0, before)
        self.record_peak(shape, n, peak)
        return peak

    def predict_peak(self, shape: Shape, n: int) -> int | None:
        seen = self._peaks.get(tuple(shape))  # type: ignore[arg-type]
        if not seen:
            return None
        if n in seen:
            return seen[n]
        sizes = sorted(seen)
        if len(sizes) == 1:
            m = sizes[0]
            return seen[m] * n // m if n > m > 0 else seen[m]  # never less than a measured smaller batch
        if n < sizes[0]:
            lo, hi = sizes[0], sizes[1]
        elif n > sizes[-1]:
            lo, hi = sizes[-2], sizes[-1]
        else:
            lo, hi = max(s for s in sizes if s < n), min(s for s in sizes if s > n)
        slope = max(0.0, (seen[hi] - seen[lo]) / (hi - lo))
        return max(0, int(seen[lo] + slope * (n - lo)))

    def max_batch(self, shape: Shape, cap: int) -> int | None:
        """Largest n <= cap predicted to peak under the limit, with every runner of the device running such a
        batch at once; None when the shape was never measured."""
        if self.predict_peak(shape, 1) is None:
            return None
        key = (cast(Shape, tuple(shape)), cap)
        recorded = self._recorded
        known = self._max_batch.get(key)
        if known is not None and known[0] == recorded:
            return known[1]
        best = 0
        base = self._base(shape)
        for n in range(1, cap + 1):
            peak = self.predict_peak(shape, n)
            if peak is not None and base + self.runners * max(0, peak - base) <= self.limit_bytes:
                best = n
        best = max(1, best)  # one frame must run (alone) even if it does not fit: the model decides then
        self._max_batch[key] = (recorded, best)
        return best

    def _base(self, shape: Shape) -> int:
        """The measured 0-frame point (what was allocated before a batch: the models, graphs), shared by the
        device's runners; 0 when not measured, so every byte counts per batch (conservative)."""
        return self._peaks.get(tuple(shape), {}).get(0, 0)  # type: ignore[arg-type]


class DeviceMemories:
    """The memory policies of every device a batch may run on, as the batcher sees them: a batch larger than one
    device takes is split across devices (`split_batch`), each part within its own device's largest batch, so a
    shape's largest batch is the sum of the devices' (a device that never measured the shape: no bound)."""

    def __init__(self, policies: Sequence[MemoryPolicy]) -> None:
        if not policies:
            raise ValueError("DeviceMemories needs at least one device's MemoryPolicy")
        self.policies = tuple(policies)

    def max_batch(self, shape: Shape, cap: int) -> int | None:
        known = [p.max_batch(shape, cap) for p in self.policies]
        if all(k is None for k in known):
            return None
        return min(cap, sum(cap if k is None else k for k in known))


def split_batch(n: int, caps: Sequence[int | None]) -> list[tuple[int, int]]:
    """How a batch of n frames runs on devices whose largest batches for its shape are `caps`, listed in the order
    the devices are to be used (the least loaded first; None: no known limit): whole on the first when it takes
    them all; else over as few of the first devices as take them together, shared evenly within each one's cap
    (the parts finish together); past what all of them take at once, full parts on each device in turn.
    Returns (position in `caps`, frames) in frame order."""
    if not caps:
        raise ValueError("split_batch needs at least one device")
    limits = [n if c is None else max(1, c) for c in caps]
    if n <= limits[0]:
        return [(0, n)]
    used, together = 0, 0
    while used < len(limits) and together < n:
        together += limits[used]
        used += 1
    if together < n:
        parts, left = [], n
        for i in range(n):  # at least one frame a part: n parts at most
            take = min(limits[i % len(limits)], left)
            parts.append((i % len(limits), take))
            left -= take
            if not left:
                break
        return parts
    shares: dict[int, int] = {}
    left = n
    # Smallest cap first: a device that cannot take an even share takes its cap, the others share the rest.
    for j, i in enumerate(sorted(range(used), key=lambda i: limits[i])):
        shares[i] = min(limits[i], -(-left // (used - j)))
        left -= shares[i]
    return [(i, shares[i]) for i in range(used) if shares[i]]


class GraphBudget(Generic[K]):
    """Captured graphs' measured device memory under a byte budget, least recently used out first (None: no
    budget). One per runner: only the thread that replays a graph may release it."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._graphs: OrderedDict[K, int] = OrderedDict()
        self.used_bytes = 0
        self.evictions = 0

    def fits(self, nbytes: int) -> bool:
        """Whether a graph of nbytes fits beside the graphs held now, evicting none."""
        return self.budget_bytes is None or self.used_bytes + nbytes <= self.budget_bytes

    def admit(self, key: K, nbytes: int) -> list[K]:
        """Account a newly captured graph; the least recently used graphs to release so the total stays within
        the budget (never the new one, which is kept even alone over it)."""
        if key in self._graphs:
            self.used_bytes -= self._graphs.pop(key)
        self._graphs[key] = nbytes
        self.used_bytes += nbytes
        evicted: list[K] = []
        while self.budget_bytes is not None and self.used_bytes > self.budget_bytes and len(self._graphs) > 1:
            old, size = self._graphs.popitem(last=False)
            self.used_bytes -= size
            evicted.append(old)
        self.evictions += len(evicted)
        return evicted

    def touch(self, key: K) -> None:
        """A replay: the graph becomes the most recently used."""
        if key in self._graphs:
            self._graphs.move_to_end(key)

    @property
    def graphs(self) -> dict[K, int]:
        """Held graphs and their bytes, least recently used first."""
        return dict(self._graphs)
