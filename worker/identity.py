"""The worker's id: `observability.worker_id` when set, else `<hostname>-<slot>`, the slot being the lowest one free
on this host, held by a lock for the life of the process.

Why a slot and not the pid: a process restarted on the same host (by systemd, a container restart, a supervisor)
finds its predecessor's slot free again and takes it, so it has the same worker id, hence the same transactional id
(`<transactional_id_prefix>-<worker_id>`): its `init_transactions` fences the dead process and aborts its open
transaction at once, instead of leaving that transaction to hold the partitions' committed offsets until the broker
aborts it (`transaction.timeout.ms`). The lock is an exclusive `flock` on a file, which the kernel drops when the
process ends, however it ends (SIGKILL too): a slot is never left taken by a dead process.

Slots are counted per `delivery.transactional_id_prefix`, the namespace the transactional ids share: workers of
another deployment on the same host (another prefix) do not move this one's numbers. Resolved when a worker process
starts (`worker run`, `run_worker`), never when settings are only read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from worker.config import MAX_WORKER_SLOTS, Settings
from worker.errors import OperatorError

log = logging.getLogger(__name__)

SLOT_SETTING = "observability.worker_slot"
SLOT_DIR_SETTING = "observability.worker_slot_dir"


class SlotError(OperatorError):
    """No slot can be held: the directory cannot be used, the slot asked for is taken, or every slot is."""


@dataclass
class HostSlot:
    """A held slot: the lock lasts while the file descriptor is open (the process's life, or until `release`)."""

    number: int
    path: Path
    fd: int

    def release(self) -> None:
        """Remove the lock file, then drop the lock: a process that opened the file before it went checks, once it
        has the lock, that the path is still that file, and starts again when it is not (see `_try_slot`)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if _same_file(self.fd, self.path):
                self.path.unlink()
        os.close(self.fd)
        self.fd = -1


def default_slot_dir() -> Path:
    """Where the lock files live when `observability.worker_slot_dir` is empty: the user's runtime directory
    (`$XDG_RUNTIME_DIR/streamfer`, per user, cleared at logout or reboot) when there is one, else
    `<temp dir>/streamfer-<uid>` (the temp dir is `$TMPDIR` or /tmp; in a container, the container's own)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "streamfer"
    return Path(tempfile.gettempdir()) / f"streamfer-{os.getuid()}"


def slot_dir(settings: Settings) -> Path:
    configured = settings.observability.worker_slot_dir
    return Path(configured).expanduser() if configured else default_slot_dir()


def lock_path(directory: Path, namespace: str, slot: int) -> Path:
    """The lock file of `slot` in `namespace` (the transactional id prefix), a file name whatever the prefix holds."""
    safe = re.sub(r"[^A-Za-z0-9._-]|^\.", "_", namespace)
    if safe != namespace:
        safe = f"{safe}-{hashlib.blake2b(namespace.encode(), digest_size=4).hexdigest()}"
    return directory / f"{safe}.slot-{slot}.lock"


def claim_slot(directory: Path, namespace: str, slot: int | None = None, max_slots: int = MAX_WORKER_SLOTS) -> HostSlot:
    """Hold `slot`, or the lowest free slot when None. Raises SlotError naming the setting to change."""
    _prepare(directory)
    if slot is not None:
        held = _try_slot(directory, namespace, slot)
        if held is None:
            holder = _holder(lock_path(directory, namespace, slot))
            raise SlotError(f"slot {slot} of {namespace!r} on this host is held by another worker process{holder} "
                            f"(lock {lock_path(directory, namespace, slot)}): stop it first, or leave {SLOT_SETTING} "
                            "unset (-1) to take the lowest free slot", setting=SLOT_SETTING)
        return held
    for n in range(max_slots):
        held = _try_slot(directory, namespace, n)
        if held is not None:
            return held
    raise SlotError(f"all {max_slots} slots of {namespace!r} in {directory} are held by running workers: set "
                    "observability.worker_id for each process instead", setting="observability.worker_id")


def _prepare(directory: Path) -> None:
    """Make the directory (0700) if needed. The default one, under a temp dir other users share, must be this user's
    own and not a symbolic link: another user's directory there could take or fake this user's slots."""
    default = directory == default_slot_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.lstat() if default else directory.stat()
    except OSError as exc:
        raise _dir_error(directory, exc) from None
    if not stat.S_ISDIR(st.st_mode):
        raise SlotError(f"the worker slot directory {directory} is not a directory (a file, or for the default one a "
                        f"symbolic link); set {SLOT_DIR_SETTING} to a directory of this user's, or set "
                        "observability.worker_id", setting=SLOT_DIR_SETTING)
    if default and st.st_uid != os.getuid():
        raise SlotError(f"the worker slot directory {directory} belongs to uid {st.st_uid}, not to this user "
                        f"({os.getuid()}); remove it, set {SLOT_DIR_SETTING} to a directory of this user's, or set "
                        "observability.worker_id", setting=SLOT_DIR_SETTING)


def _dir_error(directory: Path, exc: OSError) -> SlotError:
    why = {errno.EROFS: "read-only", errno.EACCES: "not writable by this user", errno.EPERM: "not writable by this "
           "user", errno.ENOENT: "missing, and cannot be made"}.get(exc.errno or 0, exc.strerror or str(exc))
    return SlotError(f"the worker slot directory {directory} cannot be used ({why}: {exc}): the default worker id "
                     f"<hostname>-<slot> needs a lock file there; set {SLOT_DIR_SETTING} to a writable local "
                     "directory (e.g. an emptyDir or tmpfs mount), or set observability.worker_id explicitly",
                     setting=SLOT_DIR_SETTING)


def _try_slot(directory: Path, namespace: str, slot: int) -> HostSlot | None:
    """The slot if its lock could be taken now, else None (another process holds it)."""
    path = lock_path(directory, namespace, slot)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise _dir_error(directory, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:  # e.g. ENOLCK on a network file system without locks
            os.close(fd)
            raise SlotError(f"cannot lock {path} ({exc}): put {SLOT_DIR_SETTING} on a local file system, or set "
                            "observability.worker_id", setting=SLOT_DIR_SETTING) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it between our open and our lock: take the new file
    # The holder's pid, for the message another process gets when it asks for this slot.
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as exc:
        os.close(fd)
        raise _dir_error(directory, exc) from None
    return HostSlot(slot, path, fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def default_worker_id(slot: int, hostname: str | None = None) -> str:
    return f"{hostname or socket.gethostname()}-{slot}"


@contextlib.contextmanager
def worker_identity(settings: Settings) -> Iterator[Settings]:
    """The settings with `observability.worker_id` resolved: as given, or `<hostname>-<slot>` with the slot held
    until the block ends (for `worker run`, the process's life)."""
    o = settings.observability
    if o.worker_id:
        yield settings
        return
    slot = claim_slot(slot_dir(settings), settings.delivery.transactional_id_prefix,
                      None if o.worker_slot < 0 else o.worker_slot)
    worker_id = default_worker_id(slot.number)
    log.debug("worker id %s: slot %d held by %s", worker_id, slot.number, slot.path)
    try:
        yield dataclasses.replace(settings, observability=dataclasses.replace(o, worker_id=worker_id))
    finally:
        slot.release()


def child_identities(settings: Settings, processes: int) -> list[dict[str, str]]:
    """The environment that names each of `worker run --processes N`'s children: with an explicit worker id,
    `<id>-p<i>`; else slot S+i (S = observability.worker_slot, 0 when unset), so child i keeps its slot, hence its
    id, across restarts of the whole group."""
    o = settings.observability
    if o.worker_id:
        return [{"WORKER_OBSERVABILITY_WORKER_ID": f"{o.worker_id}-p{i}"} for i in range(processes)]
    first = max(0, o.worker_slot)
    return [{"WORKER_OBSERVABILITY_WORKER_SLOT": str(first + i)} for i in range(processes)]
