"""A disk tier namespace shared by several processes: its byte budget holds for all of them.

Every process whose disk tier has the same identity (``kvmem serve`` instances and vLLM
workers of one model, layout and rank, pointed at one directory) writes into one
namespace. Its bytes are counted in one ledger: eight bytes in ``usage.lock`` beside the
block folders, read and changed under an exclusive ``fcntl.flock`` of that file (on NFS
the client turns it into a POSIX lock the server keeps). A block file is renamed into
place and counted under the lock; a block another process put there first is kept and
the new copy dropped. When the namespace would pass its budget, the oldest files by
modification time (a load touches its file) are removed first, down to a low-water mark
so the scan that finds them runs seldom, and the ledger is set to what that scan found: a
process killed between a rename and its count leaves the ledger off by one file until
then.

Removing a file another process reads is safe: a reader opens the file before reading,
and an unlinked open file stays readable. A process whose index still names a removed
file finds it missing at its next load and recomputes those tokens.

A namespace on a read-only file system has no ledger (nothing is written there).

``tier_id`` names the namespace where it lies: a random id written once (``tier.id``), so
that a router hearing of a block from several instances sharing it counts it once, and
two volumes holding the same model are told apart.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

LEDGER = "usage.lock"
TIER_ID = "tier.id"
_COUNT = struct.Struct("<Q")
LOW_WATER_FRACTION = 1 / 16  # an eviction scan frees this much of the budget beyond the need
log = logging.getLogger("kvmem.tiers")


def block_files(root: Path, suffix: str) -> Iterator[tuple[str, os.DirEntry]]:
    """(block name, entry) of every regular block file in the namespace ``root``; links,
    folders and temporary files are not block files."""
    with contextlib.suppress(OSError), os.scandir(root) as folders:
        for folder in folders:
            if not folder.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError), os.scandir(folder.path) as files:
                for entry in files:
                    if entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False):
                        yield entry.name[:-len(suffix)], entry


def unlink_in_namespace(path: str | Path) -> None:
    """Remove the file ``path`` of the namespace, following no link to its folder (a folder
    swapped for a link would lead outside the namespace: ELOOP or ENOTDIR, raised)."""
    path = Path(path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.unlink(path.name, dir_fd=fd)
    finally:
        os.close(fd)


def tier_id(root: Path) -> str:
    """The namespace's id: read from ``tier.id``, which the first process to ask writes
    (``O_EXCL``: the others read the winner's); '' when it can be neither read nor made."""
    path = root / TIER_ID
    with contextlib.suppress(FileExistsError, OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex)
    for _ in range(50):  # the winner may not have written it yet
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd) as f:
                if len(text := f.read(64).strip()) == 32:
                    return text
        time.sleep(0.01)
    return ""


class SharedUsage:
    """The ledger of one namespace (see the module docstring)."""

    def __init__(self, root: Path, budget_bytes: int, suffix: str) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.suffix = suffix
        self.used_bytes = 0  # the namespace's bytes as last seen under the lock
        self._fd: int | None = None  # until ``open``

    def open(self) -> None:
        """Open (or create) the ledger of the namespace, which exists now. Something else
        under its name (a link, a FIFO, a folder) is left alone, with one logged line:
        this process then keeps to the budget on its own."""
        path = self.root / LEDGER
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # a read-only namespace: no writes to count
            self._fd = None
            if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
                self._not_a_ledger(exc.strerror or str(exc))
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._fd = None
            self._not_a_ledger("not a regular file")
            return
        self._fd = fd

    def _not_a_ledger(self, why: str) -> None:
        log.warning("disk offload tier %s: %s is not a ledger (%s); it is left alone and this "
                    "process keeps to the budget by its own blocks only", self.root, LEDGER, why)

    @property
    def shared(self) -> bool:
        return self._fd is not None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The ledger's count, under the lock; set ``self.used_bytes`` to change it."""
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            data = os.pread(self._fd, _COUNT.size, 0)
            self.used_bytes = _COUNT.unpack(data)[0] if len(data) == _COUNT.size else 0
            before = self.used_bytes
            yield before
            if self.used_bytes != before:
                os.pwrite(self._fd, _COUNT.pack(max(self.used_bytes, 0)), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def current(self) -> int:
        """The ledger's count now (one 8-byte read, no lock: a write of it is one call)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                data = os.pread(self._fd, _COUNT.size, 0)
                if len(data) == _COUNT.size:
                    return _COUNT.unpack(data)[0]
        return self.used_bytes

    def recount(self) -> None:
        """Set the ledger to the bytes of the block files there now."""
        if self._fd is None:
            return
        with self._locked():
            self.used_bytes = sum(_size(entry) for _, entry in block_files(self.root, self.suffix))

    def place(self, tmp: Path, path: Path, nbytes: int,
              keep: Callable[[str], bool]) -> tuple[bool, list[str]]:
        """Rename the written ``tmp`` to ``path`` and count its ``nbytes``, first removing
        the oldest files when the namespace would pass its budget (never one ``keep``
        names). Returns (placed, names removed); not placed: another process had put the
        block there already, which is kept, and ``tmp`` is removed."""
        if self._fd is None:
            os.replace(tmp, path)
            return True, []
        with self._locked():
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    unlink_in_namespace(tmp)
                    return False, []
            removed = []
            if self.used_bytes + nbytes > self.budget_bytes:
                target = self.budget_bytes - nbytes - int(self.budget_bytes * LOW_WATER_FRACTION)
                removed = self._evict(target, keep)
            os.replace(tmp, path)
            self.used_bytes += nbytes
            return True, removed

    def remove(self, path: Path, nbytes: int) -> None:
        """Remove a block file of ``nbytes`` and uncount it (nothing when it is gone)."""
        if self._fd is None:
            with contextlib.suppress(OSError):
                unlink_in_namespace(path)
            return
        with self._locked(), contextlib.suppress(OSError):
            unlink_in_namespace(path)
            self.used_bytes -= nbytes

    def _evict(self, target: int, keep: Callable[[str], bool]) -> list[str]:
        """Remove the oldest files until the namespace holds ``target`` bytes at most;
        the ledger becomes what the scan found less what it removed."""
        files = []
        for name, entry in block_files(self.root, self.suffix):
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                files.append((info.st_mtime_ns, name, info.st_size, entry.path))
        self.used_bytes = sum(size for _, _, size, _ in files)
        removed = []
        for _, name, size, path in sorted(files):
            if self.used_bytes <= target:
                break
            if keep(name):
                continue
            with contextlib.suppress(OSError):
                unlink_in_namespace(path)
                self.used_bytes -= size
                removed.append(name)
        return removed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
