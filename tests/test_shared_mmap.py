"""CPU KV pages in a memory file: mapped by one process, released by another."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvmem.memory.backends import BackendError, make_backend
from kvmem.memory.shared_mmap import FileHoles, SharedMmapBackend

PAGE = 4096


@pytest.fixture
def backend():
    b = SharedMmapBackend()
    b.reserve(64 * PAGE)
    yield b
    b.close()


def test_pages_follow_map_and_unmap(backend) -> None:
    assert backend.resident_bytes() == 0
    backend.map(0, 16 * PAGE)
    t = backend.tensor(0, 16 * PAGE)
    t.fill_(7)
    assert backend.resident_bytes() == 16 * PAGE
    backend.unmap(4 * PAGE, 8 * PAGE)
    assert backend.resident_bytes() == 8 * PAGE
    assert int(t[4 * PAGE:12 * PAGE].sum()) == 0  # released: reads back as a fresh page
    assert bool((t[:4 * PAGE] == 7).all()) and bool((t[12 * PAGE:] == 7).all())
    backend.map(4 * PAGE, 8 * PAGE)
    assert backend.resident_bytes() == 16 * PAGE
    del t


def test_another_holder_of_the_file_releases_pages(backend) -> None:
    backend.map(0, 32 * PAGE)
    backend.tensor(0, 32 * PAGE).fill_(1)
    holes = FileHoles(__import__("os").getpid(), backend.fd, 64 * PAGE, PAGE)
    try:
        holes.map(0, 32 * PAGE)  # bookkeeping only: the owner maps
        holes.unmap(0, 16 * PAGE)
        assert backend.resident_bytes() == 16 * PAGE
        with pytest.raises(BackendError, match="outside the KV memory file"):
            holes.unmap(60 * PAGE, 8 * PAGE)
    finally:
        holes.close()


_OWNER = textwrap.dedent("""
    import os, sys
    from kvmem.memory.shared_mmap import SharedMmapBackend
    b = SharedMmapBackend()
    b.reserve(64 * 4096)
    b.map(0, 64 * 4096)
    b.tensor(0, 64 * 4096).fill_(3)
    print(os.getpid(), b.fd, b.resident_bytes(), flush=True)
    sys.stdin.readline()  # asleep while the other process releases its pages
    t = b.tensor(0, 64 * 4096)
    print(b.resident_bytes(), int(t[:32 * 4096].sum()), int(t[32 * 4096:].sum()), flush=True)
""")


def test_a_process_releases_pages_of_a_process_that_takes_no_step() -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid, fd, resident = map(int, owner.stdout.readline().split())
        assert resident == 64 * PAGE
        holes = FileHoles(pid, fd, 64 * PAGE, PAGE)
        holes.unmap(0, 32 * PAGE)
        holes.close()
        out, _ = owner.communicate("go\n", timeout=60)
        after, released_sum, kept_sum = map(int, out.split())
    finally:
        owner.kill()
    assert after == 32 * PAGE
    assert released_sum == 0 and kept_sum == 3 * 32 * PAGE


def test_a_file_that_is_not_the_kv_file_is_refused(backend) -> None:
    with pytest.raises(BackendError, match="not the KV memory file"):
        FileHoles(__import__("os").getpid(), backend.fd, 32 * PAGE, PAGE)
    with pytest.raises(BackendError, match="cannot open process"):
        FileHoles(2**22 + 7, 3, 64 * PAGE, PAGE)


def test_make_backend_shared_on_the_cpu_only() -> None:
    assert isinstance(make_backend("cpu", shared=True), SharedMmapBackend)
    assert not isinstance(make_backend("cpu"), SharedMmapBackend)


def test_tensor_over_the_file_is_ordinary(backend) -> None:
    backend.map(0, 64 * PAGE)
    x = backend.tensor(0, 64 * PAGE).view(torch.float32)
    x.copy_(torch.arange(x.numel(), dtype=torch.float32))
    assert float(x[-1]) == x.numel() - 1
    del x
