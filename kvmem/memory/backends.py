"""Page backends: reserve one virtual range, then map and unmap physical pages inside it.

- ``MmapBackend`` (CPU): an anonymous ``MAP_NORESERVE`` mapping; a page is committed by
  populating it and released with ``madvise(MADV_DONTNEED)``, so resident memory follows
  the mapped pages. ``huge_pages``: pages are whole transparent huge pages
  (``kvmem.memory.huge_pages``), which the kernel releases many times faster.
- ``SharedMmapBackend`` (CPU, ``kvmem.memory.shared_mmap``): the same over a memory file,
  whose pages another process can release;
- ``FakeBackend``: records every operation and rejects a double map or a stray unmap;
  for unit and stress tests.
- ``CudaVmmBackend`` (``kvmem.memory.cuda_vmm``): the CUDA driver's virtual memory API,
  imported only when a CUDA device is asked for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Protocol

from kvmem.errors import KvmemError
from kvmem.memory.huge_pages import check_huge_pages, huge_page_size

if TYPE_CHECKING:
    import torch


class BackendError(KvmemError):
    """A page could not be reserved, mapped or unmapped."""


class PageBackend(Protocol):
    granularity: int

    def reserve(self, nbytes: int) -> None: ...
    def map(self, offset: int, length: int) -> None: ...
    def unmap(self, offset: int, length: int) -> None: ...
    def tensor(self, offset: int, length: int) -> torch.Tensor: ...  # uint8 view of the range
    def close(self) -> None: ...


_PROT_NONE, _PROT_READ, _PROT_WRITE = 0x0, 0x1, 0x2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 4, 14, 23
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc(*, holding_gil: bool = False) -> ctypes.CDLL:
    """libc's memory calls; ``holding_gil``: called without releasing the GIL, for calls
    of microseconds made many at a time (a give-back's unmaps): each release lets any
    runnable thread take the GIL for up to the switch interval (5 ms) before the caller
    gets it back, which a few dozen unmaps in a row turn into hundreds of milliseconds."""
    kind = ctypes.PyDLL if holding_gil else ctypes.CDLL
    libc = kind(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class MmapBackend:
    """CPU pages over an anonymous, unreserved mapping; ``huge_pages``: in units of the
    kernel's huge page, the range aligned to it and advised ``MADV_HUGEPAGE``."""

    unmaps_ranges = True  # one unmap may cover pages mapped separately

    def __init__(self, *, huge_pages: bool = False) -> None:
        self.huge_pages = huge_pages
        self.granularity = huge_page_size() if huge_pages else mmap.PAGESIZE
        self._libc = _libc()
        self._unmap_libc = _libc(holding_gil=True)
        self._addr: int | None = None
        self._size = 0
        self._mapping = (0, 0)  # the whole mapping: guards and alignment slack included
        self._populate = True  # MADV_POPULATE_WRITE needs Linux 5.14; fall back to touching

    def reserve(self, nbytes: int) -> None:
        # An inaccessible page on each side: a stray access faults, and the range stays a
        # mapping of its own (the kernel merges neighbouring anonymous mappings otherwise,
        # e.g. with malloc's arenas, and /proc would report them together).
        guard, align = mmap.PAGESIZE, self.granularity
        total = nbytes + 2 * guard + align - mmap.PAGESIZE  # room to align the start
        base = self._libc.mmap(None, total, _PROT_NONE,
                               _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        addr = -(-(base + guard) // align) * align if base not in (None, _MAP_FAILED) else 0
        if not addr or self._libc.mprotect(addr, nbytes, _PROT_READ | _PROT_WRITE) != 0:
            err = ctypes.get_errno()
            if base not in (None, _MAP_FAILED):
                self._libc.munmap(base, total)
            raise BackendError(f"cannot reserve {nbytes} bytes of address space: "
                               f"{os.strerror(err)}")
        self._addr, self._size, self._mapping = addr, nbytes, (base, total)
        self._advise_huge_pages()

    def _advise_huge_pages(self) -> None:
        if self.huge_pages and self._libc.madvise(self._addr, self._size, _MADV_HUGEPAGE) != 0:
            err = ctypes.get_errno()
            self.close()
            raise BackendError(f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}")

    def _check(self, offset: int, length: int) -> int:
        if self._addr is None or offset < 0 or offset + length > self._size:
            raise BackendError(f"range {offset}+{length} is outside the reservation")
        return self._addr + offset

    def map(self, offset: int, length: int) -> None:
        addr = self._check(offset, length)
        if self._populate and self._libc.madvise(addr, length, _MADV_POPULATE_WRITE) == 0:
            return
        self._populate = False
        # Writing one byte per OS page commits it (the kernel hands out a zeroed page).
        step = self.granularity
        view = (ctypes.c_uint8 * length).from_address(addr)
        for i in range(0, length, step):
            view[i] = 0

    def unmap(self, offset: int, length: int) -> None:
        addr = self._check(offset, length)
        if self._unmap_libc.madvise(addr, length, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise BackendError(f"madvise(MADV_DONTNEED) failed: {os.strerror(err)}")

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        import torch

        addr = self._check(offset, length)
        return torch.frombuffer((ctypes.c_uint8 * length).from_address(addr), dtype=torch.uint8)

    def resident_bytes(self, field: str = "Rss") -> int:
        """This process's resident memory in the reservation now: the ``Rss`` that
        ``/proc/self/smaps`` reports for its mapping (pages only read, which the kernel
        backs with its shared zero page, do not count); ``field``: another of its
        figures, such as ``AnonHugePages`` or ``FilePmdMapped`` (huge pages)."""
        if self._addr is None:
            return 0
        lo, hi, total, inside = self._addr, self._addr + self._size, 0, False
        key = f"{field}:"
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: start-end perms ...
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = lo <= start and end <= hi
                elif inside and head == key:
                    total += int(line.split()[1]) * 1024
        return total

    def close(self) -> None:
        # Tensors over the range must be dropped first; callers own that ordering.
        if self._addr is not None:
            self._libc.munmap(*self._mapping)
            self._addr = None


class DoubleMapError(BackendError):
    """A fake page was mapped twice or unmapped while not mapped."""


class FakeBackend:
    """Bookkeeping only: records operations, checks them, optionally sleeps to widen races."""

    def __init__(self, granularity: int = 4096, *, max_delay: float = 0.0, seed: int = 0) -> None:
        self.granularity = granularity
        self.max_delay = max_delay
        self.mapped: set[int] = set()  # offsets
        self.log: list[tuple[str, int]] = []  # ("map" | "unmap", offset), in order
        self.map_calls = 0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._size = 0

    def reserve(self, nbytes: int) -> None:
        self._size = nbytes

    def _delay(self) -> None:
        if self.max_delay:
            with self._lock:
                d = self._rng.uniform(0, self.max_delay)
            time.sleep(d)

    def map(self, offset: int, length: int) -> None:
        with self._lock:
            if offset in self.mapped:
                raise DoubleMapError(f"offset {offset} mapped twice")
            self.mapped.add(offset)
            self.log.append(("map", offset))
            self.map_calls += 1
        self._delay()

    def unmap(self, offset: int, length: int) -> None:
        self._delay()
        with self._lock:
            if offset not in self.mapped:
                raise DoubleMapError(f"offset {offset} unmapped while not mapped")
            self.mapped.discard(offset)
            self.log.append(("unmap", offset))

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        import torch

        return torch.zeros(length, dtype=torch.uint8)

    def close(self) -> None:
        pass


def make_backend(device: str, *, shared: bool = False, huge_pages: bool = False) -> PageBackend:
    """The backend for a device string; CUDA's is imported only here, when asked for.
    ``shared``: on the CPU, pages in a memory file another process can release
    (``kvmem.memory.shared_mmap``); ``huge_pages``: on the CPU, whole transparent huge
    pages (a ``ConfigError`` when the host's kernel gives none)."""
    kind = str(device).split(":")[0]
    if huge_pages and kind != "cpu":
        raise BackendError(f"huge pages are for CPU KV memory; {device}'s pages are the "
                           "driver's granules already")
    if huge_pages:
        check_huge_pages(shared=shared)
    if kind == "cpu":
        if shared:
            from kvmem.memory.shared_mmap import SharedMmapBackend

            return SharedMmapBackend(huge_pages=huge_pages)
        return MmapBackend(huge_pages=huge_pages)
    if kind == "cuda":
        from kvmem.memory.cuda_vmm import CudaVmmBackend

        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        return CudaVmmBackend(index)
    raise BackendError(f"no elastic memory backend for device {device!r} (use cpu or cuda)")
