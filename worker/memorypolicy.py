"""Memory-aware caps for a GPU runner: pure policy (no torch), fed by a probe that reads device memory.

- Peaks: the peak device memory of a batch of n frames of a shape (the runner's input: the model's (H, W, C))
  is measured at graph capture and at warm-up calibration (`measure`, which also records what was allocated
  before the batch as its 0-frame point); between measurements it is a line base + per_frame * n through
  them (one point alone: through the origin, conservatively scaled), so a size never measured is predicted.
- Largest batch: `max_batch(shape, cap)` is the largest n <= cap whose predicted peak stays under
  `memory_fraction` of the device's total memory (worker.graphplan decides from it which CUDA-graph buckets
  are worth capturing).
- Captured graphs: a `GraphBudget` per runner keeps its graphs' measured memory under a share of
  `graph_budget_bytes`, evicting the least recently replayed; the runner releases what it returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar, cast

Shape = tuple[int, int, int]
K = TypeVar("K", bound=Hashable)


class MemoryProbe(Protocol):
    """What the policy needs from a device (worker.runtime: torch.cuda on a GPU; tests: a fake)."""

    def total_bytes(self) -> int: ...

    def reset_peak(self) -> None:
        """Start a measurement: from now the peak is what is allocated now."""

    def peak_bytes(self) -> int: ...


class MemoryPolicy:
    """Largest batch per shape under a device memory fraction, and the device's byte budget for captured graphs."""

    def __init__(self, total_bytes: int, memory_fraction: float = 0.8, graph_budget_bytes: int | None = None):
        if not 0 < memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        self.limit_bytes = int(total_bytes * memory_fraction)
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
        """Largest n <= cap predicted to peak under the limit; None when the shape was never measured."""
        if self.predict_peak(shape, 1) is None:
            return None
        key = (cast(Shape, tuple(shape)), cap)
        recorded = self._recorded
        known = self._max_batch.get(key)
        if known is not None and known[0] == recorded:
            return known[1]
        best = 0
        for n in range(1, cap + 1):
            peak = self.predict_peak(shape, n)
            if peak is not None and peak <= self.limit_bytes:
                best = n
        best = max(1, best)  # one frame must run (alone) even if it does not fit: the model decides then
        self._max_batch[key] = (recorded, best)
        return best


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
