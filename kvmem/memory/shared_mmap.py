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
"""

from __future__ import annotations

import ctypes
import functools
import os

from kvmem.memory.backends import _MAP_FAILED, _PROT_READ, _PROT_WRITE, BackendError, MmapBackend

_MAP_SHARED, _MAP_FIXED = 0x01, 0x10
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@functools.cache
def _fallocate():
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = libc.fallocate64
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fallocate


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes of the file at ``offset``; the file keeps its size."""
    if _fallocate()(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise BackendError(f"fallocate(PUNCH_HOLE) of {length} bytes at {offset} failed: "
                           f"{os.strerror(err)}")


class SharedMmapBackend(MmapBackend):
    """CPU pages over a memory file mapped shared (see the module docstring)."""

    def __init__(self, name: str = "kvmem-kv") -> None:
        super().__init__()
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
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def unmap(self, offset: int, length: int) -> None:
        self._check(offset, length)
        punch_hole(self.fd, offset, length)  # type: ignore[arg-type]

    def close(self) -> None:
        super().close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class FileHoles:
    """Another process's ``SharedMmapBackend`` file, opened to release its pages: a page
    backend whose ``unmap`` punches a hole and whose ``map`` does nothing (the owner maps)."""

    def __init__(self, pid: int, fd: int, size: int, granularity: int) -> None:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"cannot open process {pid}'s KV memory file: {exc}") from None
        actual = os.fstat(self.fd).st_size
        if actual != size:
            os.close(self.fd)
            raise BackendError(f"{path} holds {actual} bytes, not the KV memory file of "
                               f"{size} bytes")
        self.granularity = granularity
        self.size = size

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
