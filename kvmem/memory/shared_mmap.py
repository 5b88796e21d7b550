"""CPU KV pages that another process can release: a memory file mapped shared.

``SharedMmapBackend`` is ``MmapBackend`` over a memory file (``memfd_create``) instead of
anonymous memory. A page is committed by populating the mapping and released by punching
a hole in the file (``fallocate(FALLOC_FL_PUNCH_HOLE)``), which frees it for every process
that maps the file or holds it open. So a process holding the file (``FileHoles``, opened
through ``/proc/PID/fd/FD`` of the process that mapped it) releases pages without that
process running: vLLM's scheduler gives back an idle engine's KV memory this way, with no
step of its workers.

The file's pages are shared memory (``Shmem`` in ``/proc/meminfo``), charged to the
process that first writes them; the file lives while any process maps or holds it.

The owner names its file as a ``MemoryFile`` (process, start time, descriptor, device
and inode). ``FileHoles`` punches only in that file: the descriptor must still be a
memory file of kvmem's name with no name on disk, of that device and inode, in the
process that started then. A stale or forged name (a process gone and its pid reused, a
file on disk, another program's memory file) is refused before anything is punched.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import astuple, dataclass

from kvmem.memory.backends import _MAP_FAILED, _PROT_READ, _PROT_WRITE, BackendError, MmapBackend
from kvmem.memory.ledger_table import process_start_time

FILE_NAME = "kvmem-kv"  # memfd_create's name: /proc/PID/fd/FD reads "/memfd:kvmem-kv (deleted)"

_MAP_SHARED, _MAP_FIXED = 0x01, 0x10
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@functools.cache
def _fallocate():
    libc = ctypes.PyDLL(None, use_errno=True)  # the GIL kept: see backends._libc
    fallocate = libc.fallocate64
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fallocate


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes of the file at ``offset``; the file keeps its size."""
    if _fallocate()(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise BackendError(f"fallocate(PUNCH_HOLE) of {length} bytes at {offset} failed: "
                           f"{os.strerror(err)}")


@dataclass(frozen=True)
class MemoryFile:
    """A process's KV memory file, as another process can find and check it."""

    pid: int
    start_time: int  # the process's, in clock ticks after boot (a reused pid differs)
    fd: int
    size: int
    dev: int
    ino: int

    def check(self) -> None:
        """Refuse a name that cannot be a file's (a forged or garbled one)."""
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in astuple(self)) or self.pid == 0 or self.size == 0:
            raise BackendError(f"{self} does not name a KV memory file")


class SharedMmapBackend(MmapBackend):
    """CPU pages over a memory file mapped shared (see the module docstring)."""

    def __init__(self, name: str = FILE_NAME, *, huge_pages: bool = False) -> None:
        super().__init__(huge_pages=huge_pages)
        self.name = name
        self.fd: int | None = None

    def reserve(self, nbytes: int) -> None:
        try:
            fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"cannot create a memory file for the KV cache: {exc}") from None
        try:
            os.ftruncate(fd, nbytes)  # sparse: no page is allocated until written
            super().reserve(nbytes)  # the address range, with its guard pages
            addr = self._libc.mmap(self._addr, nbytes, _PROT_READ | _PROT_WRITE,
                                   _MAP_SHARED | _MAP_FIXED, fd, 0)
            if addr in (None, _MAP_FAILED) or addr != self._addr:
                err = ctypes.get_errno()
                super().close()
                raise BackendError(f"cannot map the KV memory file: {os.strerror(err)}")
            self._advise_huge_pages()  # the file's mapping replaced the advised range
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def unmap(self, offset: int, length: int) -> None:
        self._check(offset, length)
        punch_hole(self.fd, offset, length)  # type: ignore[arg-type]

    def memory_file(self) -> MemoryFile:
        """This file, named for another process to release pages in."""
        st = os.fstat(self.fd)  # type: ignore[arg-type]
        pid = os.getpid()
        return MemoryFile(pid, process_start_time(pid) or 0, self.fd, st.st_size,  # type: ignore[arg-type]
                          st.st_dev, st.st_ino)

    def close(self) -> None:
        super().close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class FileHoles:
    """Another process's ``SharedMmapBackend`` file, opened to release its pages: a page
    backend whose ``unmap`` punches a hole and whose ``map`` does nothing (the owner maps).
    Refused (``BackendError``) unless it is the file ``file`` names (module docstring)."""

    def __init__(self, file: MemoryFile, granularity: int, name: str = FILE_NAME) -> None:
        file.check()
        if not isinstance(granularity, int) or granularity <= 0 or file.size % granularity:
            raise BackendError(f"granules of {granularity!r} bytes do not divide a KV memory "
                               f"file of {file.size} bytes")
        path = f"/proc/{file.pid}/fd/{file.fd}"
        self._check_process(file)
        try:
            link = os.readlink(path)
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"cannot open process {file.pid}'s KV memory file: {exc}"
                               ) from None
        st = os.fstat(self.fd)
        problem = None
        if link != f"/memfd:{name} (deleted)" or st.st_nlink != 0:
            problem = f"is {link!r}, not a kvmem memory file"
        elif (st.st_dev, st.st_ino) != (file.dev, file.ino):
            problem = "is another memory file than the one named"
        elif st.st_size != file.size:
            problem = f"holds {st.st_size} bytes, not the KV memory file of {file.size} bytes"
        try:
            if problem:
                raise BackendError(f"{path} {problem}")
            self._check_process(file)  # still that process: its pid was not reused meanwhile
        except BackendError:
            os.close(self.fd)
            raise
        self.granularity = granularity
        self.size = file.size

    @staticmethod
    def _check_process(file: MemoryFile) -> None:
        if process_start_time(file.pid) != file.start_time:
            raise BackendError(f"process {file.pid} is not the one that named the KV memory "
                               "file (it ended, or another process has its pid)")

    def reserve(self, nbytes: int) -> None:
        pass

    def map(self, offset: int, length: int) -> None:
        pass

    def unmap(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size:
            raise BackendError(f"range {offset}+{length} is outside the KV memory file")
        punch_hole(self.fd, offset, length)

    def tensor(self, offset: int, length: int):
        raise BackendError("a released-only KV memory file has no tensors here")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None  # type: ignore[assignment]
