"""CPU KV pages in a memory file: mapped by one process, released by another."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvmem.memory.backends import BackendError, make_backend
from kvmem.memory.shared_mmap import FileHoles, MemoryFile, SharedMmapBackend

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
    holes = FileHoles(backend.memory_file(), PAGE)
    try:
        holes.map(0, 32 * PAGE)  # bookkeeping only: the owner maps
        holes.unmap(0, 16 * PAGE)
        assert backend.resident_bytes() == 16 * PAGE
        with pytest.raises(BackendError, match="outside the KV memory file"):
            holes.unmap(60 * PAGE, 8 * PAGE)
    finally:
        holes.close()


_OWNER = textwrap.dedent("""
    import dataclasses, sys
    from kvmem.memory.shared_mmap import SharedMmapBackend
    b = SharedMmapBackend()
    b.reserve(64 * 4096)
    b.map(0, 64 * 4096)
    b.tensor(0, 64 * 4096).fill_(3)
    print(*dataclasses.astuple(b.memory_file()), b.resident_bytes(), flush=True)
    sys.stdin.readline()  # asleep while the other process releases its pages
    t = b.tensor(0, 64 * 4096)
    print(b.resident_bytes(), int(t[:32 * 4096].sum()), int(t[32 * 4096:].sum()), flush=True)
""")


def test_a_process_releases_pages_of_a_process_that_takes_no_step() -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        *file, resident = map(int, owner.stdout.readline().split())
        assert resident == 64 * PAGE
        holes = FileHoles(MemoryFile(*file), PAGE)
        holes.unmap(0, 32 * PAGE)
        holes.close()
        out, _ = owner.communicate("go\n", timeout=60)
        after, released_sum, kept_sum = map(int, out.split())
    finally:
        owner.kill()
    assert after == 32 * PAGE
    assert released_sum == 0 and kept_sum == 3 * 32 * PAGE


def test_a_file_that_is_not_the_kv_file_is_refused(backend) -> None:
    named = backend.memory_file()
    with pytest.raises(BackendError, match="not the KV memory file"):
        FileHoles(dataclasses.replace(named, size=32 * PAGE), PAGE)
    with pytest.raises(BackendError, match="not the one that named"):
        FileHoles(dataclasses.replace(named, pid=2**22 + 7), PAGE)
    with pytest.raises(BackendError, match="cannot open process"):
        FileHoles(dataclasses.replace(named, fd=10**6), PAGE)


def _punched_bytes(fd: int) -> bytes:
    return os.pread(fd, 8 * PAGE, 0)


@pytest.fixture
def other_files(tmp_path):
    """Files of the right size that are not the KV memory file, each filled with 7s: one
    on disk held read-only, one on tmpfs, another program's memory file, and a kvmem
    memory file other than the one named."""
    on_disk = tmp_path / "precious"
    on_disk.write_bytes(b"\7" * 64 * PAGE)
    tmpfs = f"/dev/shm/kvmem-test-{os.getpid()}"
    with open(tmpfs, "wb") as f:
        f.write(b"\7" * 64 * PAGE)
    fds = [os.open(on_disk, os.O_RDONLY), os.open(tmpfs, os.O_RDWR)]
    os.unlink(tmpfs)  # no name on disk either
    for name in ("other-program", "kvmem-kv"):
        fd = os.memfd_create(name)
        os.write(fd, b"\7" * 64 * PAGE)
        fds.append(fd)
    yield fds
    for fd in fds:
        os.close(fd)


def test_a_stale_or_forged_name_punches_nothing(backend, other_files) -> None:
    """The scheduler punched holes in any same-user file of the right size that a
    handshake named: a file on disk, a tmpfs file, another program's memory file."""
    named = backend.memory_file()
    *others, kvmem_file = other_files
    for fd in others:
        st = os.fstat(fd)
        for forged in (dataclasses.replace(named, fd=fd),
                       dataclasses.replace(named, fd=fd, dev=st.st_dev, ino=st.st_ino)):
            with pytest.raises(BackendError, match="not a kvmem memory file"):
                FileHoles(forged, PAGE)
    with pytest.raises(BackendError, match="another memory file than the one named"):
        FileHoles(dataclasses.replace(named, fd=kvmem_file), PAGE)
    for fd in other_files:
        assert _punched_bytes(fd) == b"\7" * 8 * PAGE


def test_a_name_from_a_process_whose_pid_was_reused_is_refused(backend) -> None:
    named = backend.memory_file()
    with pytest.raises(BackendError, match="another process has its pid"):
        FileHoles(dataclasses.replace(named, start_time=named.start_time - 1), PAGE)


@pytest.mark.parametrize("change", [dict(size=0), dict(size=-PAGE), dict(fd=-1), dict(pid=0),
                                    dict(pid="1"), dict(ino=None), dict(start_time=True)])
def test_a_garbled_name_is_refused(backend, change) -> None:
    with pytest.raises(BackendError, match="does not name a KV memory file"):
        FileHoles(dataclasses.replace(backend.memory_file(), **change), PAGE)


@pytest.mark.parametrize("granularity", [0, -PAGE, 3, "4096", None])
def test_granules_that_do_not_divide_the_file_are_refused(backend, granularity) -> None:
    with pytest.raises(BackendError, match="do not divide"):
        FileHoles(backend.memory_file(), granularity)


def test_make_backend_shared_on_the_cpu_only() -> None:
    assert isinstance(make_backend("cpu", shared=True), SharedMmapBackend)
    assert not isinstance(make_backend("cpu"), SharedMmapBackend)


def test_tensor_over_the_file_is_ordinary(backend) -> None:
    backend.map(0, 64 * PAGE)
    x = backend.tensor(0, 64 * PAGE).view(torch.float32)
    x.copy_(torch.arange(x.numel(), dtype=torch.float32))
    assert float(x[-1]) == x.numel() - 1
    del x


# -- rank 0 releases every rank's pages ----------------------------------------------------
def test_rank_zero_releases_the_other_ranks_pages_at_once(tmp_path):
    """Rank 1 (here in the same process) keeps its pages in a memory file it names to rank
    0; when rank 0 gives pages back to another engine, they are free on rank 1 at once,
    with no step of rank 1, and only then does the ledger count them given back."""
    from kvmem.memory.elastic import ElasticKVStorage
    from kvmem.memory.ledger import Ledger
    from kvmem.memory.storage import SlotShape

    shape = SlotShape(2, 16, 2, 32)  # 8 KiB a block and slot
    ledger = Ledger.for_device("cpu", tmp_path)
    leader = ElasticKVStorage(2, shape, torch.float32, max_blocks=64, reserve_pages=0,
                              rank=0, world_size=2, start=False, budget=ledger.register("e"))
    follower = ElasticKVStorage(2, shape, torch.float32, max_blocks=64, reserve_pages=0,
                                rank=1, world_size=2, start=False)
    try:
        follower.apply_ops(leader.drain_ops())  # the null block's page
        assert leader.connect_ranks([follower.rank_file()])
        blocks = leader.free_queue().pop_n(16)
        leader.on_blocks_allocated(blocks)
        follower.apply_ops(leader.drain_ops())
        follower.slot_tensor(1)[blocks] = 7.0  # rank 1's step writes its KV
        fd = follower.backend.fd
        held = os.fstat(fd).st_blocks
        leader.on_blocks_released(blocks)
        leader.table.push_free(blocks)
        released = []
        leader.budget.release = lambda n, release=leader.budget.release: (
            released.append(os.fstat(fd).st_blocks), release(n))
        given = leader.give_back(1 << 30)
        assert given >= 16 * leader.table.block_bytes  # every page of those blocks
        assert os.fstat(fd).st_blocks < held  # free on rank 1, which took no step
        assert released and released[0] < held  # before the ledger heard of it
        assert float(follower.slot_tensor(1)[blocks].abs().sum()) == 0.0
        assert leader.ranks.released_bytes >= given
        follower.apply_ops(leader.drain_ops())  # its next step: the same decisions
        assert follower.table.mapped_pages == leader.table.mapped_pages
    finally:
        follower.close()
        leader.close()


def test_a_rank_file_that_cannot_be_opened_leaves_release_to_the_next_step(tmp_path, caplog):
    from kvmem.memory.elastic import ElasticKVStorage
    from kvmem.memory.rank_files import RankFile
    from kvmem.memory.storage import SlotShape

    leader = ElasticKVStorage(2, SlotShape(2, 16, 2, 32), torch.float32, max_blocks=64,
                              rank=0, world_size=2, start=False)
    try:
        gone = RankFile(1, MemoryFile(os.getpid(), 1, 999, 4096, 1, 1), 4096, 1, 4096, 4096)
        assert not leader.connect_ranks([gone])
        assert "the other ranks release pages given back with their next step" in caplog.text
        assert leader.table.on_unmapped is None
    finally:
        leader.close()
