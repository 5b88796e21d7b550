"""CUDA pages through the driver's virtual memory management API (``cuda-bindings``).

``reserve`` takes a virtual address range with ``cuMemAddressReserve``; ``map`` creates
one physical allocation per region (``cuMemCreate``), maps it (``cuMemMap``) and grants
read/write access (``cuMemSetAccess``); ``unmap`` undoes both (``cuMemUnmap``,
``cuMemRelease``). Region sizes are multiples of ``cuMemGetAllocationGranularity``.

Imported only when an elastic cache is built for a CUDA device, so importing kvmem never
needs a driver.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kvmem.memory.backends import BackendError

if TYPE_CHECKING:
    import torch


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise BackendError("the CUDA elastic backend needs the cuda-bindings package "
                           "(pip install 'kvmem[gpu]')") from e
    return driver


def _check(driver: Any, result: tuple, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise BackendError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


class _DeviceArray:
    """Minimal ``__cuda_array_interface__`` so torch can view driver memory as a tensor."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


class CudaVmmBackend:
    def __init__(self, device_index: int = 0) -> None:
        d = self._d = _driver()
        try:
            init = d.cuInit(0)
        except Exception as e:  # the bindings raise when no driver library can be loaded
            raise BackendError(f"no CUDA driver for the elastic KV backend: {e}") from e
        _check(d, init, "cuInit")
        self.device_index = device_index
        dev = _check(d, d.cuDeviceGet(device_index), "cuDeviceGet")
        # Work in the primary context, the one torch uses.
        ctx = _check(d, d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(d, d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._ctx = ctx
        self._dev = dev
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.granularity = int(_check(d, d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity"))
        self._base: int | None = None
        self._size = 0
        self._handles: dict[int, tuple[Any, int]] = {}  # offset -> (allocation handle, length)
        self._lock = threading.Lock()

    def _bind(self) -> None:
        # Driver calls come from several threads; each needs the context current.
        _check(self._d, self._d.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def reserve(self, nbytes: int) -> None:
        if nbytes % self.granularity:
            raise BackendError(f"reservation {nbytes} is not a multiple of {self.granularity}")
        ptr = _check(self._d, self._d.cuMemAddressReserve(nbytes, self.granularity, 0, 0),
                     "cuMemAddressReserve")
        self._base, self._size = int(ptr), nbytes

    def _addr(self, offset: int, length: int) -> int:
        if self._base is None or offset < 0 or offset + length > self._size:
            raise BackendError(f"range {offset}+{length} is outside the reservation")
        if offset % self.granularity or length % self.granularity:
            raise BackendError(f"range {offset}+{length} is not granularity aligned")
        return self._base + offset

    def map(self, offset: int, length: int) -> None:
        d = self._d
        addr = self._addr(offset, length)
        self._bind()
        handle = _check(d, d.cuMemCreate(length, self._prop, 0), "cuMemCreate")
        try:
            _check(d, d.cuMemMap(addr, length, 0, handle, 0), "cuMemMap")
        except BackendError:
            d.cuMemRelease(handle)
            raise
        try:
            _check(d, d.cuMemSetAccess(addr, length, [self._access], 1), "cuMemSetAccess")
        except BackendError:
            d.cuMemUnmap(addr, length)
            d.cuMemRelease(handle)
            raise
        with self._lock:
            self._handles[offset] = (handle, length)

    def unmap(self, offset: int, length: int) -> None:
        d = self._d
        addr = self._addr(offset, length)
        with self._lock:
            handle, _ = self._handles.pop(offset, (None, 0))
        if handle is None:
            raise BackendError(f"offset {offset} is not mapped")
        self._bind()
        _check(d, d.cuMemUnmap(addr, length), "cuMemUnmap")
        _check(d, d.cuMemRelease(handle), "cuMemRelease")

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        """A uint8 tensor over the range; its first page must be mapped (torch probes it)."""
        import torch

        addr = self._addr(offset, length)
        with torch.cuda.device(self.device_index):
            return torch.as_tensor(_DeviceArray(addr, length), device=f"cuda:{self.device_index}")

    def close(self) -> None:
        if self._base is None:
            return
        self._bind()
        for offset, (_, length) in list(self._handles.items()):
            self.unmap(offset, length)
        _check(self._d, self._d.cuMemAddressFree(self._base, self._size), "cuMemAddressFree")
        self._base = None
