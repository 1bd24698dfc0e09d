"""Every CUDA stream of the worker is its own (worker/runtime/streams.py), shown with a fake of torch's stream pool:
`torch.cuda.Stream()` hands out the next of 32 streams per device and priority, round-robin."""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass

import pytest
import torch

from worker.runtime.streams import POOL_SIZE, StreamRegistry, check_distinct


@dataclass(frozen=True)
class FakeStream:
    cuda_stream: int
    priority: int


class FakePool:
    """torch's rule: per (device, priority), the next of `POOL_SIZE` streams, round-robin, whoever asks."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], itertools.count] = {}

    def __call__(self, device: torch.device, priority: int) -> FakeStream:
        counter = self._next.setdefault((str(device), priority), itertools.count())
        index = next(counter) % POOL_SIZE
        handle = (torch.device(device).index or 0) * 1_000_000 + (10 - priority) * 1000 + index
        return FakeStream(handle, priority)


class Owner:
    """Stands in for a runner: holds its streams while it lives."""


def test_the_fake_pool_hands_out_one_stream_twice_after_32_draws():
    pool = FakePool()
    draws = [pool(torch.device("cuda", 0), 0) for _ in range(POOL_SIZE + 1)]
    assert draws[0] == draws[POOL_SIZE] and len(set(draws[:POOL_SIZE])) == POOL_SIZE


def test_nine_runners_and_a_decoder_get_distinct_streams_where_the_pool_alone_would_repeat():
    pool, owner = FakePool(), Owner()
    registry = StreamRegistry(make=pool)
    taken = [registry.take("cuda:0", f"role {i}", owner) for i in range(9 * 4 + 1)]
    assert len({s.cuda_stream for s in taken}) == len(taken)


def test_the_worker_never_gets_the_default_priority_stream_a_library_draws():
    pool, owner = FakePool(), Owner()
    registry = StreamRegistry(make=pool)
    nvjpeg = pool(torch.device("cuda", 0), 0)  # torchvision: getStreamFromPool(false), priority 0
    taken = [registry.take("cuda:0", "runner", owner) for _ in range(3 * POOL_SIZE)]
    assert nvjpeg.cuda_stream not in {s.cuda_stream for s in taken}
    assert {s.priority for s in taken} == {-1, -2, -3}


def test_streams_held_by_others_are_skipped_when_the_pool_comes_round_again():
    pool, first, second = FakePool(), Owner(), Owner()
    registry = StreamRegistry(make=pool, priorities=(-1,))
    mine = [registry.take("cuda:0", "first", first) for _ in range(POOL_SIZE - 1)]
    last = registry.take("cuda:0", "second", second)
    assert last.cuda_stream not in {s.cuda_stream for s in mine}
    with pytest.raises(RuntimeError, match=r"no free CUDA stream on cuda:0 for third.*instances_per_device"):
        registry.take("cuda:0", "third", Owner())


def test_a_dropped_runners_streams_are_free_again():
    registry = StreamRegistry(make=FakePool(), priorities=(-1,))
    owner = Owner()
    for _ in range(POOL_SIZE):
        registry.take("cuda:0", "runner", owner)
    assert len(registry.held("cuda:0")) == POOL_SIZE
    del owner
    gc.collect()
    assert registry.held("cuda:0") == {}
    registry.take("cuda:0", "the next runner", Owner())


def test_devices_have_pools_of_their_own():
    registry = StreamRegistry(make=FakePool(), priorities=(-1,))
    owner = Owner()
    for device in ("cuda:0", "cuda:1"):
        for _ in range(POOL_SIZE):
            registry.take(device, "runner", owner)
    assert len(registry.held("cuda:1")) == POOL_SIZE


def test_two_roles_on_one_stream_are_refused_naming_both():
    same = FakeStream(7, -1)
    with pytest.raises(RuntimeError, match="compute and captures are one stream"):
        check_distinct({"compute": same, "copies": FakeStream(8, -1), "captures": same})
    check_distinct({"compute": same, "copies": None})
