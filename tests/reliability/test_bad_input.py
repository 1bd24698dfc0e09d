"""Bad input: truncated and random bytes, wrong schema, zero or huge dimensions, mismatched byte counts,
corrupt JPEG, oversized messages. Each goes to the dead-letter topic with a reason header and its source
coordinates, and the worker keeps scoring the good frames interleaved with it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from worker.codec.schemas import MessageDecodeError, decode_frame
from worker.frames import Encoding, Priority, SourceRef
from worker.runtime.models import ModelContract
from worker.runtime.preprocess import Preprocessor
from worker.testing import EITHER, RESULT
from worker.tools.read_results import read_dead_letters, read_results

from . import faults
from .badinput import catalogue, frame_bytes
from .conftest import assert_kept
from .harness import MODES, Lab, Outgoing, Run, RunOutcome, Sent, audit, digest

# -- the decoders never raise anything but their own errors (no broker) -----------------------------------------
damaged_frames = st.one_of(
    st.binary(max_size=3000),
    st.builds(lambda w, h, c, data: frame_bytes(w, h, c, Encoding.RAW_RGB8, data),
              st.integers(-3, 100_000), st.integers(-3, 100_000), st.integers(-1, 6), st.binary(max_size=4000)),
    st.builds(lambda w, h, data: frame_bytes(w, h, 3, Encoding.JPEG, data),
              st.integers(-3, 9000), st.integers(-3, 9000), st.binary(max_size=3000)),
    st.builds(lambda w, h, cut: frame_bytes(w, h)[:cut], st.integers(1, 48), st.integers(1, 48), st.integers(0, 9000)),
    st.builds(lambda raw, at, flip: _flip(raw, at, flip), st.sampled_from([frame_bytes(), frame_bytes(
        encoding=Encoding.JPEG)]), st.integers(0, 10_000), st.integers(1, 255)),
)


def _flip(raw: bytes, at: int, mask: int) -> bytes:
    b = bytearray(raw)
    b[at % len(b)] ^= mask
    return bytes(b)


PREPROCESSOR = Preprocessor(ModelContract(name="m", version="1", labels=("a", "b")))


@settings(max_examples=400, deadline=None)
@given(damaged_frames)
def test_a_damaged_message_is_a_named_decode_error_never_a_crash(payload: bytes) -> None:
    """The source turns any bytes into a Frame or a MessageDecodeError; a Frame then either decodes or
    becomes a FrameDecodeError beside its batch. Nothing else escapes, so one message cannot crash-loop the
    worker."""
    try:
        frame = decode_frame(payload, SourceRef("frames.standard", 0, 0), Priority.STANDARD, time.time())
    except MessageDecodeError as exc:
        assert str(exc)
        event("rejected by the source")
        return
    batch = PREPROCESSOR.prepare([frame], frame.shape)
    assert len(batch.frames) + len(batch.failures) == 1
    for _, exc in batch.failures:
        assert str(exc)
    event("preprocessed" if batch.frames else "rejected by preprocessing")


# -- against the worker -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def catalogue_run(lab: Lab) -> Callable[[str], RunOutcome]:
    """The catalogue run of a mode, made on first use and shared by the tests that look at it."""
    cache: dict[str, RunOutcome] = {}

    def get(mode: str) -> RunOutcome:
        if mode not in cache:
            cache[mode] = faults.bad_input(lab, mode, faults.QUICK)
        return cache[mode]

    return get


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_every_kind_of_bad_input_is_dead_lettered_with_a_reason_and_good_frames_still_flow(
        mode: str, catalogue_run: Callable[[str], RunOutcome]) -> None:
    outcome = assert_kept(catalogue_run(mode))
    kinds = {b.kind for b in catalogue()}
    assert outcome.audit.dead_letters >= len(kinds)
    # Mutated copies of one good frame that still decode repeat its (stream_id, frame_index): dead-lettered as
    # duplicates (limits.duplicate_window_frames), never scored twice.
    assert set(outcome.audit.error_types) <= {"MessageDecodeError", "FrameDecodeError", "DuplicateFrame"}


@pytest.mark.integration
def test_a_dead_letter_carries_the_original_message_bytes(catalogue_run: Callable[[str], RunOutcome]) -> None:
    outcome = catalogue_run("at_least_once")
    assert outcome.audit.dead_letters_without_original == 0


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["at_least_once", pytest.param("exactly_once", marks=pytest.mark.slow)])
def test_oversized_messages_take_the_error_path_without_a_crash(lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.oversized_input(lab, mode, faults.QUICK))
    assert outcome.audit.dead_letters == 2 and outcome.audit.results >= 1


@pytest.fixture(scope="module")
def fuzz_run(lab: Lab) -> Iterator[Run]:
    """One worker that the hypothesis examples below feed, example after example."""
    run = Run(lab, "fuzzed input", "at_least_once")
    run.fleet.start("w0")
    yield run
    run.abandon()


@pytest.mark.integration
@settings(max_examples=6, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(damaged_frames, min_size=1, max_size=6))
def test_fuzzed_bytes_between_good_frames_each_get_exactly_one_answer(fuzz_run: Run, payloads: list[bytes]) -> None:
    """Each fuzzed message ends as one dead letter with its reason and coordinates (or, if it happens to be
    a valid frame, one result); the good frames around it are all scored."""
    run = fuzz_run
    items: list[Outgoing] = []
    for i, payload in enumerate(payloads):
        items.extend(run.factory.frames(2))
        items.append(Outgoing(run.topics.inputs[i % 3], b"fuzz", Sent("fuzz", EITHER), raw=payload))
    run.feed(items, wait=True)
    assert run.wait(run.caught_up, 90), f"the worker stopped consuming: {run.fleet.log_tail('w0')}"
    assert not run.fleet.crashes, run.fleet.crashes
    results = read_results(run.lab.bootstrap, run.topics.results, idle_timeout_s=0.5)
    dead_letters = read_dead_letters(run.lab.bootstrap, run.topics.dead_letter, idle_timeout_s=0.5)
    a = audit(run.sent, results, dead_letters)
    assert (a.lost, a.duplicated, a.misrouted, a.phantom, a.bad_headers) == (0, 0, 0, 0, 0), a
    # Fuzz is scored only where the bytes really are a usable frame.
    usable = run.notes.setdefault("usable_fuzz", set())  # over every example fed to this worker
    usable.update(digest(p) for p in payloads if _usable_frame(p))
    answered = {SourceRef(r["source_topic"], r["source_partition"], r["source_offset"]) for r in results}
    for ref, sent in run.sent.items():
        if sent.kind == "fuzz" and ref in answered:
            assert sent.digest in usable, f"fuzz at {ref} was scored"


def _usable_frame(payload: bytes) -> bool:
    try:
        frame = decode_frame(payload, SourceRef("t", 0, 0), Priority.STANDARD, time.time())
    except MessageDecodeError:
        return False
    return not PREPROCESSOR.prepare([frame], frame.shape).failures


def test_the_catalogue_covers_every_kind_of_damage_named_in_the_issue() -> None:
    kinds = " ".join(b.kind for b in catalogue()).lower()
    for damage in ("truncated", "random bytes", "wrong schema", "zero", "huge", "byte count", "corrupt jpeg"):
        assert damage in kinds
    assert all(b.expect != RESULT for b in catalogue())
