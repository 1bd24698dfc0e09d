"""Memory-aware caps for a GPU runner: pure policy (no torch), fed by a probe that reads device memory.

- Peaks: the peak device memory of a batch of n frames of a shape is measured at warm-up / capture
  (`record_peak`); between measurements it is a line base + per_frame * n through them (one measurement:
  through the origin's slope, conservatively scaled), so a size never measured is still predicted.
- Largest batch: `max_batch(shape, cap)` is the largest n <= cap whose predicted peak stays under
  `memory_fraction` of the device's total memory; `reachable(shape, buckets, cap)` the buckets below it (a
  bucket the byte cap makes unreachable is never worth capturing).
- Captured graphs: `admit_graph(key, bytes)` keeps the graphs' memory under `graph_budget_bytes`, evicting the
  least recently used (`touch` on every replay); the caller releases what it returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, cast

Shape = tuple[int, int, int]


class MemoryProbe(Protocol):
    """What the policy needs from a device (worker.runtime: torch.cuda on a GPU; tests: a fake)."""

    def total_bytes(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak_bytes(self) -> int: ...


class MemoryPolicy:
    """Largest batch per shape under a device memory fraction, and an LRU budget for captured graphs."""

    def __init__(self, total_bytes: int, memory_fraction: float = 0.8, graph_budget_bytes: int | None = None):
        if not 0 < memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        self.limit_bytes = int(total_bytes * memory_fraction)
        # Graphs share the limit with the batches themselves unless given a budget of their own.
        self.graph_budget_bytes = self.limit_bytes // 4 if graph_budget_bytes is None else graph_budget_bytes
        self._peaks: dict[Shape, dict[int, int]] = {}
        # max_batch answers for measured shapes, each with the count of peaks recorded when it was computed: the
        # batcher asks every time it makes a group (a scan of every size up to the cap), peaks change at warm-up.
        self._recorded = 0
        self._max_batch: dict[tuple[Shape, int], tuple[int, int]] = {}
        self._graphs: OrderedDict[Hashable, int] = OrderedDict()
        self.graph_bytes = 0

    # -- batch sizes -----------------------------------------------------------------------------------------
    def record_peak(self, shape: Shape, n: int, peak_bytes: int) -> None:
        """The measured peak device memory of one batch of n frames of `shape` (the largest seen is kept)."""
        seen = self._peaks.setdefault(tuple(shape), {})  # type: ignore[arg-type]
        seen[n] = max(peak_bytes, seen.get(n, 0))
        self._recorded += 1

    def measure(self, probe: MemoryProbe, shape: Shape, n: int, run: Callable[[], object]) -> int:
        """Run one batch under the probe and record its peak."""
        probe.reset_peak()
        run()
        peak = probe.peak_bytes()
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
            return seen[m] * n // m if n > m else seen[m]  # never predict less than a measured smaller batch
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

    def reachable(self, shape: Shape, buckets: Sequence[int], cap: int) -> tuple[int, ...]:
        """The buckets worth capturing for `shape`: those at most the memory and byte caps allow (and the
        smallest one above them, since a batch of the largest allowed size is padded up to it)."""
        limit = self.max_batch(shape, cap)
        limit = cap if limit is None else min(limit, cap)
        ordered = sorted(buckets)
        kept = [b for b in ordered if b <= limit]
        above = [b for b in ordered if b > limit]
        if above and (not kept or kept[-1] < limit):
            kept.append(above[0])
        return tuple(kept)

    # -- captured graphs -------------------------------------------------------------------------------------
    def admit_graph(self, key: Hashable, nbytes: int) -> list[Hashable]:
        """Account a newly captured graph; the least recently used graphs to release so the total stays within
        the budget (never the new one)."""
        if key in self._graphs:
            self.graph_bytes -= self._graphs.pop(key)
        self._graphs[key] = nbytes
        self.graph_bytes += nbytes
        evicted: list[Hashable] = []
        while self.graph_bytes > self.graph_budget_bytes and len(self._graphs) > 1:
            old, size = self._graphs.popitem(last=False)
            self.graph_bytes -= size
            evicted.append(old)
        return evicted

    def touch(self, key: Hashable) -> None:
        """A replay: the graph becomes the most recently used."""
        if key in self._graphs:
            self._graphs.move_to_end(key)

    @property
    def graphs(self) -> tuple[Hashable, ...]:
        """Captured graphs, least recently used first."""
        return tuple(self._graphs)
