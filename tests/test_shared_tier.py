"""One disk tier shared by several instances of a model: blocks one instance wrote are found
by the others, the budget holds for the namespace as a whole, concurrent writers of one
block never give a damaged read, and a full or read-only directory skips stores with one
logged line (no model: managers and disk stores over random blocks)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import subprocess
import time

import pytest
import test_tiers
import torch
from test_tiers import (
    BLOCK_NBYTES,
    block,
    keys,
    make_storage,
    roundtrip,
    same_block,
)

from kvmem.tiers import TierIdentity
from kvmem.tiers import disk_store as disk_store_module
from kvmem.tiers.blocks import key_name
from kvmem.tiers.disk_store import DiskStore
from kvmem.tiers.policy import make_policy
from kvmem.tiers.shared_dir import LEDGER, block_files
from kvmem.tiers.store import LoadError

manager_factory = pytest.fixture(test_tiers.manager_factory.__wrapped__)

FULL = "cannot write (the file system is full)"
READ_ONLY = "cannot write (the file system is read-only)"


def ledger_bytes(disk: DiskStore) -> int:
    return int.from_bytes((disk.root / LEDGER).read_bytes()[:8], "little")


def files_bytes(disk: DiskStore) -> int:
    return sum(e.stat().st_size for _, e in block_files(disk.root, ".kvb"))


def test_a_block_another_instance_wrote_is_found_by_name_and_loads_intact(manager_factory,
                                                                          tmp_path):
    """B started before A wrote: its start-up scan saw nothing, yet its first lookup finds
    A's blocks on disk and loads A's bytes; an instance of another rank never does."""
    shared = tmp_path / "shared"
    a, storage_a, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared)
    b, storage_b, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared,
                                      storage=make_storage(seed=1))
    other, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared,
                                  layout="tp2-rank1")
    expected = [block(storage_a, i) for i in (1, 2, 3)]
    a.offer([1, 2, 3], keys(1, 2, 3))
    a.drain()
    assert b.lookup(keys(1, 2, 3)) == 3 and b.stats()["disk"].hits == 3
    assert roundtrip(b, storage_b, [], keys(1, 2, 3), [7, 8, 9]).ok
    assert all(same_block(storage_b, d, e) for d, e in zip((7, 8, 9), expected, strict=True))
    assert other.lookup(keys(1, 2, 3)) == 0
    # B does not write again what A wrote
    b.offer([1, 2, 3], keys(1, 2, 3))
    b.drain()
    assert b.stats()["disk"].bytes_stored == 0 and ledger_bytes(b.disk) == files_bytes(b.disk)


def test_instances_sharing_a_namespace_stay_within_its_budget_together(manager_factory,
                                                                       tmp_path):
    """Each instance's budget is the namespace's: two instances writing 6 blocks each into
    a 6-block namespace leave at most 6 files, the oldest removed, the ledger exact; an
    instance that loads a block another removed recomputes it."""
    shared = tmp_path / "shared"
    a, _, _ = manager_factory(cpu_blocks=1, disk_blocks=6, disk_dir=shared)
    b, _, _ = manager_factory(cpu_blocks=1, disk_blocks=6, disk_dir=shared,
                              storage=make_storage(seed=1))
    a.offer(list(range(1, 7)), keys(*range(1, 7)))
    a.drain()
    b.offer(list(range(1, 7)), keys(*range(11, 17)))
    b.drain()
    names = {name for name, _ in block_files(a.disk.root, ".kvb")}
    assert len(names) <= 6 and files_bytes(a.disk) <= a.disk.capacity_bytes
    assert ledger_bytes(a.disk) == files_bytes(a.disk)
    assert {key_name(k) for k in keys(*range(11, 17))} <= names  # the newest stayed
    assert b.stats()["disk"].evictions > 0
    # A's index still names its first block; its file is gone: the load stops there
    assert a.lookup(keys(2)) == 1  # (block 1 is in A's one-block CPU tier)
    handle = a.load("r", keys(2), [20])
    assert handle.done.wait(30) and handle.num_loaded == 0
    assert a.stats()["disk"].failed_load_causes == {"missing": 1}


def _hammer(root: str, identity: TierIdentity, block_nbytes: int, budget: int, writer: int,
            rounds: int, names: list[str], out) -> None:
    """A process writing blocks that every other writer writes too (each with its own
    bytes: a mix of two writers would be seen) and reading them back."""
    torch.set_num_threads(1)
    disk = DiskStore(root, budget, block_nbytes, identity, make_policy("lru", 64))
    row = torch.full((block_nbytes,), writer, dtype=torch.uint8)
    back = torch.empty(block_nbytes, dtype=torch.uint8)
    bad, reads = [], 0
    for i in range(rounds):
        name = names[i % len(names)]
        disk.put(name, row)
        entry = disk.pin(names[(i * 7) % len(names)])
        if entry is None:
            continue
        try:
            disk.read(entry, back)
            reads += 1
            if len(set(back.tolist())) != 1:
                bad.append("mixed bytes")
        except LoadError as exc:
            if exc.cause != "missing":  # removed by another writer's budget: a miss
                bad.append(f"{exc.cause}: {exc}")
        finally:
            disk.unpin(entry)
    out.put((writer, reads, bad, disk.stats.failed_load_causes))


def test_concurrent_writers_of_the_same_blocks_never_give_a_damaged_read(tmp_path):
    """Four processes write and read the same few blocks under a budget smaller than them
    (so files are removed while others read), and an instance starts meanwhile: every read
    is one writer's whole block or a miss, and the ledger ends exact and within budget."""
    identity = TierIdentity("tiny", "tp1", "uint8", 4, (BLOCK_NBYTES,), 1)
    names = [key_name(k) for k in keys(*range(1, 7))]
    probe = DiskStore(tmp_path / "probe", 1 << 20, BLOCK_NBYTES, identity, make_policy("lru", 1))
    budget = 4 * probe._entry_bytes(names[0])
    root = tmp_path / "shared"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(root), identity, BLOCK_NBYTES, budget,
                                               w, 150, names, out)) for w in range(1, 5)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    late = DiskStore(root, budget, BLOCK_NBYTES, identity, make_policy("lru", 64))
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert [bad for _, _, bad, _ in results] == [[]] * 4
    assert sum(reads for _, reads, _, _ in results) > 100
    late.shared.recount()
    assert not list(late.root.glob("*/*.tmp"))
    assert files_bytes(late) <= budget and ledger_bytes(late) == files_bytes(late)


def test_a_live_writers_temporary_file_is_kept_at_start_up(manager_factory, tmp_path):
    """Another instance starting up removes only stale temporary files: one whose writer
    is gone, or an old one, never one a live process is writing."""
    shared = tmp_path / "shared"
    first, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared)
    folder = first.disk.root / "ab"
    folder.mkdir()
    gone_pid = 2 ** 22 + 17  # above pid_max's default: no such process
    here = disk_store_module.HOST
    elsewhere = "0" * 8 if here != "0" * 8 else "1" * 8
    live = folder / f"ab{'0' * 30}.kvb.{here}.{os.getpid()}.0.tmp"
    gone = folder / f"ab{'1' * 30}.kvb.{here}.{gone_pid}.0.tmp"
    old = folder / f"ab{'2' * 30}.kvb.{here}.{os.getpid()}.0.tmp"
    # another host's writer with a pid that is gone here: only its age says it is stale
    other_host = folder / f"ab{'3' * 30}.kvb.{elsewhere}.{gone_pid}.0.tmp"
    other_old = folder / f"ab{'4' * 30}.kvb.{elsewhere}.{gone_pid}.0.tmp"
    for path in (live, gone, old, other_host, other_old):
        path.write_bytes(b"partial")
    for path in (old, other_old):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared)
    assert live.exists() and not gone.exists() and not old.exists()
    assert other_host.exists() and not other_old.exists()


def test_two_writes_of_one_block_never_share_a_temporary_file(tmp_path):
    """Writers whose pids repeat (containers sharing a volume) or threads of one process
    each write their own temporary file, created exclusively: a file already at the name
    is refused, never written through or removed."""
    path = tmp_path / f"ab{'0' * 30}.kvb"
    names = {disk_store_module._temporary(path) for _ in range(64)}
    assert len(names) == 64
    assert all(n.name.startswith(f"{path.name}.{disk_store_module.HOST}.{os.getpid()}.")
               for n in names)
    taken = next(iter(names))
    taken.write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        disk_store_module._private_file(taken)
    assert taken.read_bytes() == b"another writer's"


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (root only); unmounted after the test."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path) -> None:
    """Write ``path`` until its file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 1024)
    finally:
        os.close(fd)


def _warnings(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_full_directory_skips_stores_with_one_line_and_still_loads(manager_factory,
                                                                     small_fs, caplog):
    mgr, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=600, disk_dir=small_fs / "t")
    expected = block(storage, 1)
    mgr.offer([1], keys(1))
    mgr.drain()
    filler = small_fs / "filler"
    fill(filler)
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        for b in range(2, 8):
            mgr.offer([b], keys(b))
            mgr.drain()
    assert _warnings(caplog, FULL) == 1
    disk = mgr.stats()["disk"]
    assert disk.enabled and disk.skipped_stores >= 5 and ledger_bytes(mgr.disk) == files_bytes(
        mgr.disk)
    mgr.offer([20], keys(20))  # pushes block 1 out of the one-block CPU tier
    mgr.drain()
    assert mgr.lookup(keys(1)) == 1
    assert roundtrip(mgr, storage, [], keys(1), [9]).ok and same_block(storage, 9, expected)
    filler.unlink()
    mgr.offer([8], keys(8))
    mgr.drain()
    assert mgr.disk.contains(key_name(keys(8)[0]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        fill(filler)
        mgr.offer([10, 11], keys(10, 11))
        mgr.drain()
    assert _warnings(caplog, FULL) == 1  # full again after a write worked: said again


def test_a_read_only_directory_is_loaded_from_and_not_written(manager_factory, small_fs,
                                                              caplog):
    """A volume another instance filled, mounted read-only: the tier starts (it used to
    refuse with a ConfigError), loads its blocks and skips its stores, saying so once."""
    tier = small_fs / "t"
    writer, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=600, disk_dir=tier)
    expected = block(storage, 1)
    writer.offer([1, 2], keys(1, 2))
    writer.shutdown(flush=True)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        reader, fresh, _ = manager_factory(cpu_blocks=1, disk_blocks=600, disk_dir=tier,
                                           storage=make_storage(seed=1))
        assert reader.lookup(keys(1, 2)) == 2
        assert roundtrip(reader, fresh, [], keys(1), [9]).ok and same_block(fresh, 9, expected)
        for b in (5, 6, 7):
            reader.offer([b], keys(b))
            reader.drain()
    assert _warnings(caplog, READ_ONLY) == 1
    disk = reader.stats()["disk"]
    assert disk.enabled and disk.stored_blocks == 0 and disk.skipped_stores >= 2


def test_a_shared_disk_tier_reports_its_namespace_capacity(manager_factory, tmp_path):
    """The capacity figures of a disk tier shared by two instances are the namespace's:
    each instance counts the other's blocks too; the CPU tier's are its own."""
    shared = tmp_path / "shared"
    a, _, _ = manager_factory(cpu_blocks=2, disk_blocks=8, disk_dir=shared)
    b, _, _ = manager_factory(cpu_blocks=2, disk_blocks=8, disk_dir=shared,
                              storage=make_storage(seed=1))
    a.offer([1, 2, 3], keys(1, 2, 3))
    a.drain()
    b.offer([4, 5], keys(4, 5))
    b.drain()
    for mgr in (a, b):
        disk, cpu = mgr.stats()["disk"], mgr.stats()["cpu"]
        assert disk.used_blocks == 5 and disk.used_bytes == files_bytes(mgr.disk)
        assert disk.capacity_blocks == disk.capacity_bytes // mgr.disk.entry_nbytes >= 8
        assert cpu.capacity_blocks == 2 and cpu.used_blocks == 2


IDENTITY = TierIdentity("tiny", "tp1", "uint8", 4, (BLOCK_NBYTES,), 1)


def disk_store(root, blocks: int = 8) -> DiskStore:
    """A disk store whose budget holds ``blocks`` blocks (and half of another)."""
    entry_bytes = disk_store_module._HEADER.size + 32 + BLOCK_NBYTES  # a 32-character name
    return DiskStore(root, blocks * entry_bytes + entry_bytes // 2, BLOCK_NBYTES, IDENTITY,
                     make_policy("lru", 64))


def test_a_temporary_file_named_with_an_impossible_pid_is_kept_at_start_up(tmp_path):
    """``<name>.kvb.<host>.<pid>.<token>.tmp`` with a pid no C long holds: the start-up
    scan goes on (it raised OverflowError) and keeps the file until it is old."""
    root = disk_store(tmp_path).root
    (root / "ab").mkdir()
    forged = root / "ab" / f"ab{'0' * 30}.kvb.{disk_store_module.HOST}.{10 ** 30}.0.tmp"
    forged.write_bytes(b"x")
    disk = disk_store(tmp_path)
    assert disk._enabled and forged.exists()


@pytest.mark.parametrize("kind", ["fifo", "folder", "link"])
def test_something_else_in_place_of_the_ledger_is_left_alone_with_one_line(tmp_path, caplog,
                                                                             kind):
    """A FIFO (whose read raised ESPIPE at start-up), a folder or a link where
    ``usage.lock`` should be: the tier starts, says so once, follows nothing, and keeps to
    the budget by its own blocks."""
    root = disk_store(tmp_path).root
    ledger = root / LEDGER
    ledger.unlink()
    target = tmp_path / "target"
    target.write_bytes(b"left alone")
    {"fifo": os.mkfifo, "folder": os.mkdir, "link": lambda p: p.symlink_to(target)}[kind](ledger)
    caplog.set_level(logging.WARNING, "kvmem.tiers")
    disk = disk_store(tmp_path, blocks=2)
    assert not disk.shared.shared
    assert _warnings(caplog, "usage.lock is not a ledger") == 1
    row = torch.zeros(BLOCK_NBYTES, dtype=torch.uint8)
    for k in keys(*range(1, 6)):
        disk.put(key_name(k), row)
    assert len(list(root.glob("*/*.kvb"))) == 2
    assert target.read_bytes() == b"left alone" and os.path.lexists(ledger)


def test_a_block_folder_swapped_for_a_link_never_removes_a_file_outside(tmp_path):
    """Evicting a block whose folder was replaced by a link to another directory holding a
    file of the block's name: that file stays (the removal followed the link)."""
    disk = disk_store(tmp_path / "tier", blocks=1)
    row = torch.zeros(BLOCK_NBYTES, dtype=torch.uint8)
    first, second = (key_name(k) for k in keys(1, 2))
    assert first[:2] != second[:2]
    disk.put(first, row)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{first}.kvb").write_bytes(b"precious")
    folder = disk.root / first[:2]
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.symlink_to(outside)
    disk.put(second, row)  # the budget holds one block: the first is evicted
    assert first not in disk._entries
    assert (outside / f"{first}.kvb").read_bytes() == b"precious"
