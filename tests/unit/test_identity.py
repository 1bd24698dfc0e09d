"""The default worker id `<hostname>-<slot>`: the lowest slot free on the host, held by a lock while the process
lives, released however it ends; an explicit worker id wins; `--processes N` children get slots 0..N-1."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.config import ConfigError, load_settings
from worker.identity import (
    SlotError,
    child_identities,
    claim_slot,
    default_slot_dir,
    lock_path,
    worker_identity,
)

NS = "streamfer"


@pytest.fixture
def slots(tmp_path: Path) -> Path:
    return tmp_path / "slots"


def test_the_first_holder_gets_slot_0_and_the_next_the_lowest_free_one(slots: Path) -> None:
    first, second, third = (claim_slot(slots, NS) for _ in range(3))
    assert (first.number, second.number, third.number) == (0, 1, 2)
    second.release()
    assert claim_slot(slots, NS).number == 1  # the lowest free, not the next unused


def test_a_released_slot_is_free_again_and_its_lock_file_is_gone(slots: Path) -> None:
    held = claim_slot(slots, NS)
    held.release()
    assert not held.path.exists()
    assert claim_slot(slots, NS).number == 0


def test_the_directory_is_made_private_when_missing(slots: Path) -> None:
    claim_slot(slots / "deeper", NS)
    assert (slots / "deeper").stat().st_mode & 0o777 == 0o700


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from worker.identity import claim_slot
    slot = claim_slot(Path(sys.argv[1]), sys.argv[2])
    print(slot.number, flush=True)
    time.sleep(600)
""")


def start_holder(slots: Path, namespace: str = NS) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(slots), namespace], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_slot_held_by_another_process_is_skipped_and_freed_when_it_is_sigkilled(slots: Path) -> None:
    other, number = start_holder(slots)
    try:
        assert number == 0
        mine = claim_slot(slots, NS)
        assert mine.number == 1
        mine.release()
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(10)
    # The kernel dropped the dead process's lock: a restart on this host gets its slot, hence its id.
    assert claim_slot(slots, NS).number == 0


def test_asking_for_a_held_slot_names_the_holder_and_the_setting(slots: Path) -> None:
    other, number = start_holder(slots)
    try:
        with pytest.raises(SlotError, match=rf"slot 0 .* held .*pid {other.pid}") as info:
            claim_slot(slots, NS, slot=number)
        assert info.value.setting == "observability.worker_slot"
        assert claim_slot(slots, NS, slot=3).number == 3
    finally:
        other.kill()
        other.wait(10)


def test_slots_are_counted_per_transactional_id_prefix(slots: Path) -> None:
    assert claim_slot(slots, "deployment-a").number == 0
    assert claim_slot(slots, "deployment-b").number == 0
    assert claim_slot(slots, "deployment-a").number == 1


def test_any_prefix_makes_a_file_name_of_its_own(tmp_path: Path) -> None:
    names = {lock_path(tmp_path, prefix, 0).name for prefix in ("a/b", "a_b", "..", "a b", "a-b")}
    assert len(names) == 5
    assert all("/" not in n and not n.startswith(".") for n in names)


def test_every_slot_held_is_an_error_naming_the_worker_id_setting(slots: Path) -> None:
    claim_slot(slots, NS, max_slots=2), claim_slot(slots, NS, max_slots=2)
    with pytest.raises(SlotError) as info:
        claim_slot(slots, NS, max_slots=2)
    assert info.value.setting == "observability.worker_id"


def test_a_directory_that_cannot_be_made_is_an_error_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SlotError, match="cannot be used") as info:
        claim_slot(blocker / "slots", NS)
    assert info.value.setting == "observability.worker_slot_dir"
    assert "observability.worker_id" in str(info.value)


def test_a_read_only_directory_is_an_error_naming_the_setting(slots: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, whom permission bits do not stop: the file system's refusal is simulated.
    slots.mkdir()

    def read_only(*_args: object, **_kwargs: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(SlotError, match="read-only") as info:
        claim_slot(slots, NS)
    assert info.value.setting == "observability.worker_slot_dir"


def test_the_default_directory_is_the_users_runtime_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_slot_dir() == tmp_path / "streamfer"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert default_slot_dir() == tmp_path / f"streamfer-{os.getuid()}"


def test_a_default_directory_of_another_user_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "streamfer").mkdir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(SlotError, match="belongs to uid"):
        claim_slot(default_slot_dir(), NS)


def settings(slots: Path, **observability: str):
    env = {"WORKER_OBSERVABILITY_WORKER_SLOT_DIR": str(slots)}
    env.update({f"WORKER_OBSERVABILITY_{k.upper()}": v for k, v in observability.items()})
    return load_settings(env=env)


def test_the_default_worker_id_is_the_host_and_its_slot_held_until_the_block_ends(slots: Path) -> None:
    with worker_identity(settings(slots)) as first, worker_identity(settings(slots)) as second:
        assert first.observability.worker_id == f"{socket.gethostname()}-0"
        assert second.observability.worker_id == f"{socket.gethostname()}-1"
    with worker_identity(settings(slots)) as again:
        assert again.observability.worker_id == f"{socket.gethostname()}-0"


def test_an_explicit_worker_id_wins_and_takes_no_slot(slots: Path) -> None:
    with worker_identity(settings(slots, worker_id="pod-7")) as s:
        assert s.observability.worker_id == "pod-7"
    assert not slots.exists()


def test_a_configured_slot_is_taken_exactly(slots: Path) -> None:
    with worker_identity(settings(slots, worker_slot="5")) as s:
        assert s.observability.worker_id == f"{socket.gethostname()}-5"


def test_processes_children_get_slots_0_to_n_minus_1(slots: Path) -> None:
    assert child_identities(settings(slots), 3) == [{"WORKER_OBSERVABILITY_WORKER_SLOT": str(i)} for i in range(3)]
    assert child_identities(settings(slots, worker_slot="4"), 2) == [
        {"WORKER_OBSERVABILITY_WORKER_SLOT": "4"}, {"WORKER_OBSERVABILITY_WORKER_SLOT": "5"}]
    assert child_identities(settings(slots, worker_id="host"), 2) == [
        {"WORKER_OBSERVABILITY_WORKER_ID": "host-p0"}, {"WORKER_OBSERVABILITY_WORKER_ID": "host-p1"}]


def test_a_child_environment_names_a_slot_its_settings_accept(slots: Path) -> None:
    (env,) = child_identities(settings(slots), 1)
    assert load_settings(env={"WORKER_OBSERVABILITY_WORKER_SLOT_DIR": str(slots), **env}).observability.worker_slot == 0


@pytest.mark.parametrize("env, field", [
    ({"WORKER_OBSERVABILITY_WORKER_SLOT": "1024"}, "observability.worker_slot"),
    ({"WORKER_OBSERVABILITY_WORKER_SLOT": "-2"}, "observability.worker_slot"),
    ({"WORKER_OBSERVABILITY_WORKER_SLOT": "1", "WORKER_OBSERVABILITY_WORKER_ID": "w"}, "observability.worker_slot"),
])
def test_bad_slot_settings_are_named(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env=env)
    assert info.value.setting == field


def test_reading_settings_takes_no_slot(tmp_path: Path) -> None:
    settings = load_settings(env={"WORKER_OBSERVABILITY_WORKER_SLOT_DIR": str(tmp_path / "s")})
    assert settings.observability.worker_id == ""
    assert not (tmp_path / "s").exists()


def test_a_configured_directory_may_be_a_symbolic_link_the_default_one_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert claim_slot(tmp_path / "link", NS).number == 0
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "streamfer").symlink_to(tmp_path / "real")
    with pytest.raises(SlotError, match="symbolic link"):
        claim_slot(default_slot_dir(), NS)
