"""The disk tier: one file per block under a directory namespaced by the tier identity.

Layout: ``<dir>/kvmem-<digest>/<name[:2]>/<name>.kvb`` with ``identity.json`` beside the
block folders saying which model and layout the digest stands for. A block file is a fixed
header (magic, format version, name length, payload length, xxh3-128 checksum of the
payload), the block's name, then the payload. Files are written to a temporary name and
renamed, so a crash leaves either a whole file or none; every load checks the header, the
name and the checksum. On start-up the namespace is scanned, so blocks written by an
earlier process with the same identity are found again (oldest first in LRU order).
A directory that disappears disables the tier with a warning.

Blocks encode users' prompts: the namespace and its folders are created 0700 and files
0600 whatever the umask, and a namespace left with wider modes is narrowed on start-up.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch
import xxhash

from kvmem.errors import ConfigError
from kvmem.tiers.config import FORMAT_VERSION, TierIdentity
from kvmem.tiers.faults import NO_FAULTS, Faults
from kvmem.tiers.policy import LRUPolicy
from kvmem.tiers.store import BlockStore, Entry, LoadError

MAGIC = b"KVMEMBLK"
_HEADER = struct.Struct("<8sIIQ16s")  # magic, version, name length, payload length, checksum
SUFFIX = ".kvb"
DIR_MODE = 0o700
FILE_MODE = 0o600


class DiskStore(BlockStore):
    name = "disk"

    def __init__(self, root: str | Path, budget_bytes: int, block_nbytes: int,
                 identity: TierIdentity, policy: LRUPolicy, faults: Faults = NO_FAULTS) -> None:
        super().__init__(budget_bytes, policy, faults)
        self.block_nbytes = block_nbytes
        self.root = identity.namespace_dir(root)
        try:
            Path(root).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)  # if it is ours
            self.root.mkdir(mode=DIR_MODE, exist_ok=True)
            self.root.chmod(DIR_MODE)  # an earlier version made it 0755
            with _private_file(self.root / "identity.json") as f:
                f.write((identity.to_json() + "\n").encode())
        except OSError as exc:
            raise ConfigError(f"--disk-offload-dir {root}: {exc.strerror}") from None
        self._scan()

    def path_of(self, name: str) -> Path:
        return self.root / name[:2] / f"{name}{SUFFIX}"

    def _scan(self) -> None:
        """Index the block files an earlier process left under this identity."""
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}*"):
            if path.suffix != SUFFIX:  # a temporary file from an interrupted write
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            name = path.name[:-len(SUFFIX)]
            if stat.st_size == self._entry_bytes(name):
                found.append((stat.st_mtime_ns, name))
            else:
                path.unlink(missing_ok=True)
        with self._lock:
            for _, name in sorted(found):
                entry = Entry(name, self._entry_bytes(name), self.path_of(name), ready=True)
                self._entries[name] = entry
                self._used += entry.nbytes
                self._policy.inserted(name)
            self._make_room(0)  # the budget may be smaller than last time

    def _entry_bytes(self, name: str) -> int:
        return _HEADER.size + len(name.encode()) + self.block_nbytes

    def _allocate(self, name: str) -> Path:
        return self.path_of(name)

    def _write(self, entry: Entry, row: torch.Tensor) -> None:
        payload = row.numpy()
        name = entry.name.encode()
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(name), payload.nbytes,
                              xxhash.xxh3_128_digest(payload))
        path: Path = entry.handle
        path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.faults.before_write()
            with _private_file(tmp) as f:
                f.write(header)
                f.write(name)
                f.write(memoryview(payload))
            os.replace(tmp, path)
            self.faults.after_write(path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _read(self, entry: Entry, out: torch.Tensor) -> None:
        data = bytearray(entry.nbytes)
        with open(entry.handle, "rb") as f:
            size = f.readinto(data)
            trailing = f.read(1)
        if size != entry.nbytes or trailing:
            raise LoadError(f"file size differs from the expected {entry.nbytes} bytes")
        magic, version, name_len, payload_len, checksum = _HEADER.unpack_from(data)
        start = _HEADER.size + name_len
        if magic != MAGIC or version != FORMAT_VERSION or payload_len != self.block_nbytes:
            raise LoadError("not a block file of this format")
        if data[_HEADER.size:start].decode(errors="replace") != entry.name:
            raise LoadError("file holds another block")
        payload = memoryview(data)[start:]
        if xxhash.xxh3_128_digest(payload) != checksum:
            raise LoadError("checksum mismatch")
        out.copy_(torch.frombuffer(data, dtype=torch.uint8, offset=start))

    def _release(self, entry: Entry) -> None:
        if self._enabled:
            Path(entry.handle).unlink(missing_ok=True)

    def _io_failed(self, exc: OSError) -> None:
        if not self.root.is_dir():
            self.disable(f"directory {self.root} is gone ({exc.strerror or exc})")


def _private_file(path: Path):
    """``path`` opened for writing, created (or truncated) with mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # O_CREAT's mode is narrowed by the umask, never widened;
        # a file that existed keeps its mode unless changed here
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
