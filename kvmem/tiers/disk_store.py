"""The disk tier: one file per block under a directory namespaced by the tier identity.

Layout: ``<dir>/kvmem-<digest>/<name[:2]>/<name>.kvb`` with ``identity.json`` beside the
block folders saying which model and layout the digest stands for. A block file is a fixed
header (magic, format version, name length, payload length, checksum, namespace digest),
the block's name, then the payload. The checksum (xxh3-128) covers everything after it:
the namespace, the name and the payload, so a file is bound to the tier that wrote it
(weights, layout, rank) and to its block. Files are written to a temporary name and
renamed, so a crash leaves either a whole file or none; every load checks the header, the
namespace, the name and the checksum, and a file copied from another rank's or model's
folder under the same name fails its load (counted in ``failed_loads``, recomputed). On
start-up the namespace is scanned, so blocks written by an earlier process with the same
identity are found again (oldest first in LRU order). A directory that disappears
disables the tier with a warning.

Only regular files are the tier's. Whatever else the folder holds under a block's or a
temporary file's name (a directory, a symbolic link, a FIFO, a device) is left alone,
counted (``skipped_files``) and logged; no link inside the tier's folder is ever followed,
for reading or for writing, and every file is opened without blocking (``O_NONBLOCK``) and
used only when ``fstat`` says it is a regular file, so a FIFO put in a block's place fails
that load instead of waiting for a writer.

Blocks encode users' prompts: the namespace and its folders are created 0700 and files
0600 whatever the umask, and a namespace left with wider modes is narrowed on start-up.

Several processes may share a namespace (instances of one model behind a router, their
disk tiers in one directory): the budget holds for the namespace as a whole
(``shared_dir``), a block one process wrote is found by the others by its name on disk
when their index lacks it (``contains``, ``pin``: one ``stat``), and a temporary file is
removed at start-up only when it is stale (its writer gone, or old), never while another
process writes it. A full, read-only or unwritable directory skips the stores, with one
logged line per cause until a write succeeds again; its blocks are still loaded.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import torch
import xxhash

from kvmem.errors import ConfigError
from kvmem.tiers.config import (
    DISK_ENTRY_OVERHEAD_BYTES,
    FLAG_NAMES,
    FORMAT_VERSION,
    SettingNames,
    TierIdentity,
)
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.policy import LRUPolicy
from kvmem.tiers.shared_dir import SharedUsage, unlink_in_namespace
from kvmem.tiers.stats import CHECKSUM, NAMESPACE, TierStats
from kvmem.tiers.store import BlockStore, Entry, IndexListener, LoadError
from kvmem.units import GiB, format_bytes

MAGIC = b"KVMEMBLK"
# magic, version, name length, payload length, checksum, namespace digest; the checksum
# covers the bytes after it (namespace, name, payload)
_HEADER = struct.Struct("<8sIIQ16s16s")
_CHECKED_FROM = _HEADER.size - 16
log = logging.getLogger("kvmem.tiers")

SUFFIX = ".kvb"
DIR_MODE = 0o700
FILE_MODE = 0o600
STALE_TMP_S = 600.0  # a temporary file this old is a crashed write, whoever wrote it
# Names a host among the hosts or containers that share a directory: pids repeat across
# them (each container has its own pid namespace), host names do not
HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
# write errors that leave the tier readable: its stores are skipped, its loads go on
UNWRITABLE = {errno.ENOSPC: "the file system is full", errno.EDQUOT: "the quota is spent",
              errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
              errno.EPERM: "permission denied"}


class DiskStore(BlockStore):
    name = "disk"

    def __init__(self, root: str | Path, budget_bytes: int, block_nbytes: int,
                 identity: TierIdentity, policy: LRUPolicy, faults: Faults = NO_FAULTS,
                 on_change: IndexListener | None = None,
                 names: SettingNames = FLAG_NAMES) -> None:
        """``names``: how errors name the settings (kvmem's flags, vLLM's config keys)."""
        super().__init__(budget_bytes, policy, faults, on_change)
        self.block_nbytes = block_nbytes
        self.root = identity.namespace_dir(root)
        self.namespace = identity.digest_bytes()
        # files of freed entries, removed after the lock (``_after_unlock``); removals and
        # the renames that put a block file in place take turns under ``_files_lock``
        self._doomed: list[tuple[str, Path]] = []
        self._files_lock = threading.Lock()
        self._write_errors: set[int] = set()  # causes logged since the last write that worked
        self.shared = SharedUsage(self.root, budget_bytes, SUFFIX)
        check_disk_budget(budget_bytes, Path(root), names)
        try:
            if Path(root).exists() and not Path(root).is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
            Path(root).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)  # if it is ours
            if not os.path.lexists(self.root):
                self.root.mkdir(mode=DIR_MODE)
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise ConfigError(f"{names.disk_dir} {root}: {exc.strerror}") from None
            self.disable(f"{self.root} cannot be created ({exc.strerror}); prompts are "
                         "recomputed")  # no namespace yet: nothing there to load either
            return
        if not _is_real_dir(self.root):
            self.stats.skipped_files += 1
            self.disable(f"{self.root} is not a directory of its own (a link or a file); "
                         "remove it to use the disk tier")
            return
        try:
            self.root.chmod(DIR_MODE)  # an earlier version made it 0755
            identity_file = self.root / "identity.json"
            if not _is_real_dir(identity_file):  # a directory there is counted by the scan
                _write_replacing(identity_file, (identity.to_json() + "\n").encode())
        except OSError as exc:
            if exc.errno not in UNWRITABLE:
                raise ConfigError(f"{names.disk_dir} {root}: {exc.strerror}") from None
            self._write_failed(exc)  # its blocks are still read
        self.shared.open()
        self._scan()
        self.shared.recount()

    def path_of(self, name: str) -> Path:
        return block_path(self.root, name)

    def _scan(self) -> None:
        """Index the block files an earlier process left under this identity; remove
        leftover temporary files and block files of the wrong size; skip and count the
        rest (anything not a regular file), following no link."""
        found, skipped = [], []
        for folder in _entries(self.root):
            if folder.is_symlink() or folder.name == "identity.json" and folder.is_dir():
                skipped.append(folder.name)
            elif folder.is_dir(follow_symlinks=False):
                for entry in _entries(folder.path):
                    if SUFFIX not in entry.name:
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        skipped.append(f"{folder.name}/{entry.name}")
                        continue
                    name = entry.name[:-len(SUFFIX)]
                    if not entry.name.endswith(SUFFIX):  # a temporary file
                        if _stale_temporary(entry):  # of a write a crash interrupted
                            _remove(entry.path)
                    elif entry.stat(follow_symlinks=False).st_size == self._entry_bytes(name):
                        found.append((entry.stat(follow_symlinks=False).st_mtime_ns, name))
                    else:
                        _remove(entry.path)
        if skipped:
            log.warning("disk offload tier %s: skipped %d entries that are not regular files "
                        "(%s%s); they are left alone", self.root, len(skipped),
                        ", ".join(skipped[:5]), ", ..." if len(skipped) > 5 else "")
        with self._changing():
            self.stats.skipped_files += len(skipped)
            for _, name in sorted(found):
                entry = Entry(name, self._entry_bytes(name), self.path_of(name), ready=True,
                              fresh=False)
                self._entries[name] = entry
                self._used += entry.nbytes
                self._policy.inserted(name)
                if self.on_change is not None:
                    self.on_change(self.name, name, True)
            self._make_room(0)  # the budget may be smaller than last time

    def _entry_bytes(self, name: str) -> int:
        return _HEADER.size + len(name.encode()) + self.block_nbytes

    @property
    def entry_nbytes(self) -> int:
        return self.block_nbytes + DISK_ENTRY_OVERHEAD_BYTES

    def snapshot(self) -> TierStats:
        """The namespace's usage when it is shared (every process's blocks)."""
        stats = super().snapshot()
        if self.shared.shared:
            stats.used_bytes = self.shared.current()
            stats.used_blocks = round(stats.used_bytes / self.entry_nbytes)
        return stats

    # -- blocks other processes wrote -----------------------------------------------------
    def contains(self, name: str) -> bool:
        return super().contains(name) or self._discover(name)

    def pin(self, name: str) -> Entry | None:
        entry = super().pin(name)
        if entry is None and self._discover(name):
            entry = super().pin(name)
        return entry

    def _discover(self, name: str) -> bool:
        """Index ``name``'s file when another process wrote it (the lock is not held for
        the ``stat``). Room is made by forgetting the least recently used entries, whose
        files stay for the others: the namespace's own budget removes files."""
        if not self._enabled:
            return False
        nbytes = self._entry_bytes(name)
        try:
            info = os.stat(self.path_of(name), follow_symlinks=False)
        except (OSError, ValueError):
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
            return False
        with self._changing():
            if name in self._entries:
                return self._entries[name].ready
            if not self._enabled or not self._unindex_for(nbytes):
                return False
            entry = Entry(name, nbytes, self.path_of(name), ready=True, fresh=False)
            self._entries[name] = entry
            self._used += nbytes
            self._policy.inserted(name)
            if self.on_change is not None:
                self.on_change(self.name, name, True)
        return True

    def _unindex_for(self, nbytes: int) -> bool:
        """Forget unpinned entries, least recently used first, until ``nbytes`` fit; their
        files are kept (lock held)."""
        doomed, evictions = len(self._doomed), self.stats.evictions
        fits = self._make_room(nbytes)
        del self._doomed[doomed:]  # the files of the entries forgotten stay
        self.stats.evictions = evictions
        return fits

    def _removed_elsewhere(self, names: list[str]) -> None:
        """This store's write removed these files to keep the namespace within its budget
        (other processes' blocks too): forget those it indexed."""
        with self._changing():
            self.stats.evictions += len(names)
            for name in names:
                entry = self._entries.get(name)
                if entry is not None and entry.ready:
                    self._forget(entry)

    def _pinned(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and entry.pins > 0

    def _allocate(self, name: str) -> Path:
        return self.path_of(name)

    def _write(self, entry: Entry, row: torch.Tensor) -> None:
        payload = row.numpy()
        name = entry.name.encode()
        checksum = xxhash.xxh3_128(self.namespace)
        checksum.update(name)
        checksum.update(payload)
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(name), payload.nbytes,
                              checksum.digest(), self.namespace)
        path: Path = entry.handle
        path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
        if not _is_real_dir(path.parent):  # a link would lead out of the tier's folder
            raise OSError(errno.ELOOP, f"{path.parent} is not a directory of the tier")
        tmp = _temporary(path)
        self.faults.before_write()
        f = _private_file(tmp)  # what is already at the name is never removed here
        try:
            with f:
                f.write(header)
                f.write(name)
                f.write(memoryview(payload))
            with self._files_lock:
                _, removed = self.shared.place(tmp, path, entry.nbytes, self._pinned)
            self._write_errors.clear()
            self.faults.after_write(path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        if removed:
            self._removed_elsewhere(removed)

    def _read(self, entry: Entry, out: torch.Tensor) -> None:
        data = bytearray(entry.nbytes)
        with _open_regular(entry.handle, os.O_RDONLY) as f:
            if os.fstat(f.fileno()).st_size != entry.nbytes:
                raise LoadError(f"file size differs from the expected {entry.nbytes} bytes")
            size = f.readinto(data)
            trailing = f.read(1)
        if size != entry.nbytes or trailing:
            raise LoadError(f"file size differs from the expected {entry.nbytes} bytes")
        magic, version, name_len, payload_len, checksum, namespace = _HEADER.unpack_from(data)
        start = _HEADER.size + name_len
        if magic != MAGIC or version != FORMAT_VERSION or payload_len != self.block_nbytes:
            raise LoadError("not a block file of this format")
        if namespace != self.namespace:
            raise LoadError(f"file belongs to another tier (namespace {namespace.hex()[:24]}: "
                            "another model, layout or rank), copied into this one", NAMESPACE)
        if data[_HEADER.size:start].decode(errors="replace") != entry.name:
            raise LoadError("file holds another block")
        if xxhash.xxh3_128_digest(memoryview(data)[_CHECKED_FROM:]) != checksum:
            raise LoadError("checksum mismatch", CHECKSUM)
        out.copy_(torch.frombuffer(data, dtype=torch.uint8, offset=start))
        with contextlib.suppress(OSError):  # its age orders the namespace's evictions
            os.utime(entry.handle, follow_symlinks=False)

    def _release(self, entry: Entry) -> None:
        if self._enabled:
            self._doomed.append((entry.name, entry.handle))

    def _after_unlock(self) -> None:
        if not self._doomed:  # whoever adds to it calls this next
            return
        with self._files_lock:
            with self._lock:  # a block stored again meanwhile keeps its (new) file
                doomed = [(name, path) for name, path in self._doomed
                          if name not in self._entries]
                self._doomed = []
            for name, path in doomed:
                self.shared.remove(path, self._entry_bytes(name))

    def _io_failed(self, exc: OSError) -> None:
        if not self.root.is_dir():
            self.disable(f"directory {self.root} is gone ({exc.strerror or exc})")
        elif exc.errno in UNWRITABLE:
            self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        """One line per cause until a write succeeds again."""
        if exc.errno in self._write_errors:
            return
        self._write_errors.add(exc.errno)
        log.warning("disk offload tier %s: cannot write (%s): blocks are not stored there "
                    "until a write succeeds and their prompts are recomputed; its blocks "
                    "are still loaded", self.root, UNWRITABLE[exc.errno])

    def close(self) -> None:
        """Let go of the namespace's ledger."""
        self.shared.close()


def block_path(root: Path, name: str) -> Path:
    """Where the block ``name`` of the namespace ``root`` is stored."""
    return root / name[:2] / f"{name}{SUFFIX}"


def on_disk(root: Path, name: str) -> bool:
    """Whether the namespace ``root`` has a regular file for ``name`` (one ``lstat``)."""
    try:
        return stat.S_ISREG(os.lstat(block_path(root, name)).st_mode)
    except (OSError, ValueError):
        return False


def check_disk_budget(budget_bytes: int, root: Path, names: SettingNames = FLAG_NAMES) -> None:
    """Refuse a budget larger than the whole file system holding the tier: it could never
    be used (a budget above the free space is fine: stores that meet a full disk are
    skipped)."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the directory is created later, on that file system
    total = shutil.disk_usage(existing).total
    if budget_bytes > total:
        raise ConfigError(f"{names.disk_bytes} {budget_bytes / GiB:g} exceeds the "
                          f"{format_bytes(total)} file system holding {root}")


def _entries(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:  # gone, or not a directory: nothing of the tier's in it
        return []


def _temporary(path: Path) -> Path:
    """A new temporary name beside ``path``: ``<name>.<host>.<pid>.<token>.tmp``. The host
    and pid say whose write it is (``_stale_temporary``); the token keeps two writes of one
    block apart, in one process or in two whose pids repeat on hosts of the same name."""
    return path.with_name(f"{path.name}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _stale_temporary(entry: os.DirEntry) -> bool:
    """A temporary file (``_temporary``) whose writer is gone from this host, or that is
    older than ``STALE_TMP_S``: written on another host sharing the directory (its pid
    says nothing here), or named otherwise."""
    try:
        if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
            return True
        host, pid = entry.name.rsplit(".", 4)[-4:-2]
        if host != HOST:
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, IndexError, OverflowError):  # not a pid: kept until old
        return False
    return False


def _is_real_dir(path: Path) -> bool:
    """A directory, and not a link to one."""
    return path.is_dir() and not path.is_symlink()


def _remove(path: str | Path) -> None:
    """Remove a file of the tier; something else under its name stays (``_scan`` counts it)."""
    with contextlib.suppress(OSError):
        unlink_in_namespace(path)


def _write_replacing(path: Path, data: bytes) -> None:
    """Write ``path`` (0600) through a temporary file renamed over it: a link at ``path``
    is replaced, never followed."""
    tmp = _temporary(path.with_name(f".{path.name}"))
    f = _private_file(tmp)
    try:
        with f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        _remove(tmp)
        raise


def _open_regular(path: str | Path, flags: int, mode: int = FILE_MODE):
    """``path`` opened with ``flags`` as a file object, only if it is a regular file: a link
    at ``path`` is not followed (ELOOP), and the open does not block, so a FIFO or a device
    put there is refused (ENXIO for a FIFO nobody reads, else EINVAL after ``fstat``)
    instead of waiting for a writer or a reader."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb" if (flags & os.O_ACCMODE) == os.O_RDONLY else "wb")
    except BaseException:
        os.close(fd)
        raise


def _private_file(path: Path):
    """``path`` created for writing with mode 0600 whatever the umask; anything already
    there (another writer's file, a FIFO, a link) is refused (EEXIST), never written."""
    f = _open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.fchmod(f.fileno(), FILE_MODE)  # O_CREAT's mode is narrowed by the umask
        return f
    except BaseException:
        f.close()
        raise
