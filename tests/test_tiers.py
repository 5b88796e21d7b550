"""kvmem.tiers: CPU and disk stores, async transfers, failures and accounting (no model)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from collections import Counter

import pytest
import torch

from kvmem.errors import ConfigError
from kvmem.memory.storage import SlotShape, TensorKVStorage
from kvmem.tiers import Faults, OffloadConfig, OffloadManager, TierIdentity, disk_store
from kvmem.tiers.blocks import key_name
from kvmem.tiers.cpu_store import CPUStore
from kvmem.tiers.host_rows import HostRows, runs
from kvmem.tiers.policy import LRUPolicy
from kvmem.tiers.stats import PrefillMeter, block_tokens, prefill_step_tokens

NUM_SLOTS = 2
SHAPE = SlotShape(num_kv=2, block_size=4, num_heads=2, head_dim=8)
BLOCK_NBYTES = NUM_SLOTS * SHAPE.elements_per_block * 4  # float32


class FakeHolder:
    """Stands in for the block pool's hold/release and checks they balance."""

    def __init__(self) -> None:
        self.held: Counter[int] = Counter()

    def hold(self, block_ids):
        self.held.update(block_ids)

    def release(self, block_ids):
        for b in block_ids:
            assert self.held[b] > 0, f"block {b} released more often than held"
            self.held[b] -= 1
        self.held += Counter()


def make_storage(num_blocks: int = 24, seed: int = 0) -> TensorKVStorage:
    storage = TensorKVStorage(num_blocks, NUM_SLOTS, SHAPE, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for s in range(NUM_SLOTS):
        storage.slot_tensor(s).copy_(torch.randn(storage.slot_tensor(s).shape, generator=gen))
    return storage


def block(storage: TensorKVStorage, b: int) -> list[torch.Tensor]:
    return [storage.slot_tensor(s)[b].clone() for s in range(NUM_SLOTS)]


def same_block(storage, b: int, expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(storage.slot_tensor(s)[b], expected[s]) for s in range(NUM_SLOTS))


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in ids]


@pytest.fixture
def manager_factory(tmp_path):
    made = []

    def make(cpu_blocks: int = 8, disk_blocks: int = 0, storage=None, *, layout="tp1",
             faults: Faults | None = None, policy: str = "lru", max_inflight: int = 4096,
             disk_dir=None, prefill=None, staging_blocks: int = 64):
        storage = storage if storage is not None else make_storage()
        config = OffloadConfig(
            cpu_bytes=cpu_blocks * BLOCK_NBYTES,
            disk_dir=str(disk_dir or tmp_path / "tier") if disk_blocks else None,
            disk_bytes=disk_blocks * (BLOCK_NBYTES + 200), policy=policy,
            max_inflight_store_blocks=max_inflight, staging_bytes=staging_blocks * BLOCK_NBYTES)
        holder = FakeHolder()
        mgr = OffloadManager(config, storage, NUM_SLOTS, holder, model="tiny", layout=layout,
                             faults=faults or Faults(), prefill=prefill)
        made.append(mgr)
        return mgr, storage, holder

    yield make
    for mgr in made:
        mgr.shutdown()


def roundtrip(mgr, storage, src_ids, key_list, dst_ids):
    """Load ``key_list`` into ``dst_ids`` and wait for it."""
    handle = mgr.load("r", key_list, dst_ids)
    assert handle.done.wait(60)
    assert handle in mgr.poll()
    return handle


# -- the basic cycle ---------------------------------------------------------------------

def test_offer_store_lookup_load_roundtrip(manager_factory):
    mgr, storage, holder = manager_factory(cpu_blocks=8)
    originals = [block(storage, b) for b in (1, 2, 3)]
    assert mgr.offer([1, 2, 3], keys(10, 11, 12)) == 3
    mgr.drain()
    assert not holder.held and mgr.held_blocks == 0
    assert mgr.lookup(keys(10, 11, 12, 13)) == 3
    handle = roundtrip(mgr, storage, [1, 2, 3], keys(10, 11, 12), [7, 8, 9])
    assert handle.ok and handle.num_loaded == 3 and handle.error is None
    for dst, original in zip((7, 8, 9), originals, strict=True):
        assert same_block(storage, dst, original)
    cpu = mgr.stats()["cpu"]
    assert cpu.hits == 3 and cpu.misses == 1
    assert cpu.bytes_stored == 3 * BLOCK_NBYTES and cpu.bytes_loaded == 3 * BLOCK_NBYTES
    assert cpu.used_bytes == 3 * BLOCK_NBYTES


def test_source_blocks_are_held_until_the_copy_completes(manager_factory):
    mgr, storage, holder = manager_factory(faults=Faults(store_delay_s=0.3))
    mgr.offer([4, 5], keys(1, 2))
    assert holder.held == Counter({4: 1, 5: 1}) and mgr.held_blocks == 2
    mgr.poll()  # the copy has not run yet: holds stay
    assert holder.held == Counter({4: 1, 5: 1})
    mgr.drain()
    assert not holder.held and mgr.held_blocks == 0


def test_lookup_stops_at_first_gap(manager_factory):
    mgr, storage, _ = manager_factory()
    mgr.offer([1, 3], keys(10, 12))
    mgr.drain()
    assert mgr.lookup(keys(10, 11, 12)) == 1
    assert mgr.lookup(keys(11, 12)) == 0


def test_blocks_already_stored_are_not_copied_again(manager_factory):
    mgr, storage, holder = manager_factory()
    assert mgr.offer([1, 2], keys(10, 11)) == 2
    assert mgr.offer([1, 2], keys(10, 11)) == 0  # still in flight
    mgr.drain()
    assert mgr.offer([1, 2], keys(10, 11)) == 0  # stored
    assert mgr.stats()["cpu"].stored_blocks == 2


def test_keys_of_different_groups_are_distinct():
    h = (7).to_bytes(16, "little")
    assert key_name((0, h)) != key_name((1, h))
    assert key_name(h) == h.hex()
    with pytest.raises(TypeError):
        key_name(-1)


# -- budgets and eviction ----------------------------------------------------------------

def test_cpu_tier_evicts_lru_and_accounts_exactly(manager_factory):
    mgr, storage, _ = manager_factory(cpu_blocks=3)
    for b in range(1, 6):
        mgr.offer([b], keys(b))
        mgr.drain()
    cpu = mgr.stats()["cpu"]
    assert cpu.evictions == 2 and cpu.stored_blocks == 5
    assert cpu.used_bytes == 3 * BLOCK_NBYTES == cpu.capacity_bytes
    assert [mgr.lookup(keys(b)) for b in range(1, 6)] == [0, 0, 1, 1, 1]


def test_lookup_hit_refreshes_lru_order(manager_factory):
    mgr, storage, _ = manager_factory(cpu_blocks=2)
    mgr.offer([1, 2], keys(1, 2))
    mgr.drain()
    roundtrip(mgr, storage, [1], keys(1), [9])  # key 1 is now the most recent
    mgr.offer([3], keys(3))
    mgr.drain()
    assert mgr.lookup(keys(1)) == 1 and mgr.lookup(keys(2)) == 0


def test_pinned_entries_are_never_evicted_and_full_tier_skips():
    store = CPUStore(2 * BLOCK_NBYTES, BLOCK_NBYTES, LRUPolicy())
    row = torch.zeros(BLOCK_NBYTES, dtype=torch.uint8)
    assert store.put("a", row) and store.put("b", row)
    pins = [store.pin("a"), store.pin("b")]
    assert not store.put("c", row)
    assert store.stats.skipped_stores == 1 and store.contains("a") and store.contains("b")
    store.unpin(pins[0])
    assert store.put("c", row)  # "a" is unpinned now and the least recent: evicted
    assert not store.contains("a") and store.contains("b")
    assert store.used_bytes == 2 * BLOCK_NBYTES


def test_seen_twice_policy_admits_on_second_offer(manager_factory):
    mgr, storage, _ = manager_factory(policy="seen-twice")
    mgr.offer([1], keys(1))
    mgr.drain()
    assert mgr.lookup(keys(1)) == 0 and mgr.stats()["cpu"].not_admitted == 1
    mgr.offer([1], keys(1))
    mgr.drain()
    assert mgr.lookup(keys(1)) == 1


def test_too_many_inflight_blocks_skips_stores(manager_factory):
    mgr, storage, holder = manager_factory(faults=Faults(store_delay_s=0.2), max_inflight=2)
    assert mgr.offer([1, 2, 3, 4, 5], keys(1, 2, 3, 4, 5)) == 2
    assert sum(holder.held.values()) == 2
    assert mgr.stats()["cpu"].skipped_stores == 3
    mgr.drain()
    assert not holder.held


def test_entry_evicted_between_lookup_and_load_shortens_the_load(manager_factory):
    mgr, storage, _ = manager_factory(cpu_blocks=2)
    mgr.offer([1, 2], keys(1, 2))
    mgr.drain()
    assert mgr.lookup(keys(1, 2)) == 2
    mgr.offer([3, 4], keys(3, 4))  # evicts both before the load
    mgr.drain()
    before = block(storage, 9)
    handle = roundtrip(mgr, storage, [], keys(1, 2), [9, 10])
    assert handle.num_loaded == 0 and not handle.ok and handle.error
    assert same_block(storage, 9, before)
    cpu = mgr.stats()["cpu"]
    assert cpu.failed_load_causes == {"missing": 1} and cpu.loaded_blocks == 0
    # the evicted blocks were never loaded: wasted; the two that took their place not yet
    assert cpu.wasted_blocks == 2 and cpu.unused_blocks == 2


# -- the disk tier -----------------------------------------------------------------------

def test_disk_tier_stores_files_with_exact_accounting(manager_factory):
    mgr, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=4)
    mgr.offer([1, 2, 3], keys(1, 2, 3))
    mgr.drain()
    files = sorted(mgr.disk.root.glob("*/*.kvb"))
    assert len(files) == 3
    disk = mgr.stats()["disk"]
    assert disk.used_bytes == sum(f.stat().st_size for f in files)
    assert (mgr.disk.root / "identity.json").is_file()
    # CPU keeps one block; the other two come from disk, all three load correctly.
    assert mgr.lookup(keys(1, 2, 3)) == 3
    stats = mgr.stats()
    assert stats["cpu"].hits == 1 and stats["disk"].hits == 2 and stats["cpu"].misses == 2
    expected = [block(storage, b) for b in (1, 2, 3)]
    handle = roundtrip(mgr, storage, [], keys(1, 2, 3), [11, 12, 13])
    assert handle.ok
    for dst, e in zip((11, 12, 13), expected, strict=True):
        assert same_block(storage, dst, e)


@pytest.fixture
def permissive_umask():
    old = os.umask(0)  # every file and directory would be world-readable and writable
    try:
        yield
    finally:
        os.umask(old)


def test_disk_tier_is_private_whatever_the_umask(manager_factory, tmp_path, permissive_umask):
    """Blocks encode users' prompts: 0700 directories and 0600 files, also in a namespace
    that an earlier run left 0755."""
    mgr, _, _ = manager_factory(cpu_blocks=1, disk_blocks=4, disk_dir=tmp_path / "new")
    mgr.offer([1, 2, 3], keys(1, 2, 3))
    mgr.drain()
    paths = [mgr.disk.root, *mgr.disk.root.rglob("*")]
    assert len([p for p in paths if p.suffix == ".kvb"]) == 3
    wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths
             if stat.S_IMODE(p.stat().st_mode) != (0o700 if p.is_dir() else 0o600)}
    assert wrong == {}
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700  # created here, so ours
    mgr.shutdown(flush=True)

    root = mgr.disk.root
    root.chmod(0o755)
    (root / "identity.json").chmod(0o644)
    again, _, _ = manager_factory(cpu_blocks=1, disk_blocks=4, disk_dir=tmp_path / "new")
    assert again.disk.root == root and again.lookup(keys(1, 2, 3)) == 3
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "identity.json").stat().st_mode) == 0o600


def test_disk_tier_evicts_to_stay_within_budget(manager_factory):
    mgr, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=2)
    for b in (1, 2, 3, 4):
        mgr.offer([b], keys(b))
        mgr.drain()
    disk = mgr.stats()["disk"]
    assert disk.evictions == 2 and disk.used_bytes <= disk.capacity_bytes
    assert len(list(mgr.disk.root.glob("*/*.kvb"))) == 2


def _disk_only_chain(manager_factory, **kw):
    mgr, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=8, **kw)
    mgr.offer([1, 2, 3], keys(1, 2, 3))
    mgr.drain()
    mgr.offer([4], keys(4))  # pushes the chain out of the one-block CPU tier
    mgr.drain()
    assert mgr.cpu.contains(key_name(keys(4)[0])) and not mgr.cpu.contains(key_name(keys(1)[0]))
    return mgr, storage


def test_checksum_mismatch_fails_load_from_that_block(manager_factory):
    mgr, storage = _disk_only_chain(manager_factory)
    expected = block(storage, 1)
    path = mgr.disk.path_of(key_name(keys(2)[0]))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    handle = roundtrip(mgr, storage, [], keys(1, 2, 3), [11, 12, 13])
    assert handle.num_loaded == 1 and "checksum" in handle.error
    assert same_block(storage, 11, expected)
    assert mgr.stats()["disk"].failed_loads == 1
    assert mgr.stats()["disk"].failed_load_causes == {"checksum": 1}
    assert not path.exists() and mgr.lookup(keys(1, 2, 3)) == 1


def test_missing_file_fails_load(manager_factory):
    mgr, storage = _disk_only_chain(manager_factory)
    mgr.disk.path_of(key_name(keys(1)[0])).unlink()
    handle = roundtrip(mgr, storage, [], keys(1, 2), [11, 12])
    assert handle.num_loaded == 0 and handle.error
    assert mgr.stats()["disk"].failed_load_causes == {"missing": 1}


def test_injected_read_errors_fail_loads(manager_factory):
    mgr, storage, _ = manager_factory(faults=Faults(read_error_rate=1.0))
    mgr.offer([1], keys(1))
    mgr.drain()
    handle = roundtrip(mgr, storage, [], keys(1), [9])
    assert handle.num_loaded == 0 and "injected" in handle.error
    assert mgr.stats()["cpu"].failed_loads == 1
    assert mgr.stats()["cpu"].failed_load_causes == {"io": 1}


def test_corrupted_files_are_caught_by_checksum(manager_factory):
    mgr, storage = _disk_only_chain(manager_factory, faults=Faults(corrupt_rate=1.0))
    handle = roundtrip(mgr, storage, [], keys(1, 2, 3), [11, 12, 13])
    assert handle.num_loaded == 0 and "checksum" in handle.error
    assert mgr.stats()["disk"].failed_load_causes == {"checksum": 1}


def test_block_files_swapped_between_ranks_fail_their_loads(manager_factory, tmp_path):
    """Two tensor-parallel ranks' tiers in one folder name their files alike; a file
    swapped into the other rank's namespace (a copy, a restore, a sync tool) carries the
    namespace its checksum covers, so it fails the load there instead of loading the other
    rank's KV; the rank keeps the blocks before it and recomputes from there."""
    shared = tmp_path / "shared"
    ranks = [_disk_only_chain(manager_factory, layout=f"tp2-rank{r}", disk_dir=shared,
                              storage=make_storage(seed=r)) for r in (0, 1)]
    paths = [mgr.disk.path_of(key_name(keys(2)[0])) for mgr, _ in ranks]
    assert paths[0] != paths[1] and paths[0].name == paths[1].name
    swapped = [p.read_bytes() for p in reversed(paths)]
    for path, data in zip(paths, swapped, strict=True):
        path.write_bytes(data)
    for mgr, storage in ranks:
        expected = block(storage, 1)
        handle = roundtrip(mgr, storage, [], keys(1, 2, 3), [11, 12, 13])
        assert handle.num_loaded == 1 and "belongs to another tier" in handle.error
        assert same_block(storage, 11, expected)
        assert mgr.stats()["disk"].failed_loads == 1
        assert mgr.lookup(keys(1, 2, 3)) == 1  # the foreign file is dropped (and removed)
    assert not any(p.exists() for p in paths)


def test_a_fifo_in_place_of_a_block_file_fails_its_load_without_waiting(manager_factory):
    """A FIFO named like a block file (put there after the start-up scan) used to block
    the transfer thread in open() for ever, and with it every later load."""
    mgr, storage = _disk_only_chain(manager_factory)
    path = mgr.disk.path_of(key_name(keys(2)[0]))
    path.unlink()
    os.mkfifo(path)
    handle = roundtrip(mgr, storage, [], keys(1, 2, 3), [11, 12, 13])
    assert handle.num_loaded == 1 and "not a regular file" in handle.error
    assert mgr.stats()["disk"].failed_loads == 1
    assert roundtrip(mgr, storage, [], keys(1), [14]).ok  # the next load runs as usual


def test_a_fifo_at_a_temporary_name_skips_that_store(manager_factory, monkeypatch):
    """The disk writer does not wait on a FIFO where it writes a block's temporary file:
    that store is skipped and the next one lands."""
    mgr, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8)
    path = mgr.disk.path_of(key_name(keys(5)[0]))
    path.parent.mkdir(mode=0o700)
    fifo = path.with_name(f"{path.name}.fifo.tmp")
    os.mkfifo(fifo)
    temporary = disk_store._temporary
    monkeypatch.setattr(disk_store, "_temporary",
                        lambda at: fifo if at == path else temporary(at))
    mgr.offer([5], keys(5))
    mgr.drain(timeout=30)
    mgr.offer([6], keys(6))
    mgr.drain(timeout=30)
    disk = mgr.stats()["disk"]
    assert disk.skipped_stores == 1 and disk.stored_blocks == 1 and disk.enabled
    assert mgr.disk.contains(key_name(keys(6)[0])) and not path.exists()
    assert fifo.exists()  # what was at the temporary name is left alone


def test_no_file_is_removed_under_the_tier_lock(manager_factory, monkeypatch):
    """The scheduler's thread takes a tier's lock (``pin``, stats): the disk writer
    removes the file of a block it evicts after releasing the lock, so a slow file system
    never stops the step. The removal waits here until ``stats()`` has returned."""
    mgr, _, _ = manager_factory(cpu_blocks=1, disk_blocks=1)
    mgr.offer([1], keys(1))
    mgr.drain()
    removing, stats_returned, waited_in_vain = threading.Event(), threading.Event(), []
    remove = mgr.disk.shared.remove

    def slow_remove(path, nbytes):
        removing.set()
        if not stats_returned.wait(30):
            waited_in_vain.append(path)
        remove(path, nbytes)

    monkeypatch.setattr(mgr.disk.shared, "remove", slow_remove)
    mgr.offer([2], keys(2))  # evicts block 1 from the one-block disk tier
    assert removing.wait(30)
    assert mgr.stats()["disk"].evictions == 1
    stats_returned.set()
    mgr.drain()
    assert waited_in_vain == [] and mgr.disk.contains(key_name(keys(2)[0]))
    assert not mgr.disk.path_of(key_name(keys(1)[0])).exists()


def test_full_disk_skips_the_store_and_leaves_no_partial_file(manager_factory):
    mgr, storage, _ = manager_factory(cpu_blocks=4, disk_blocks=8,
                                      faults=Faults(disk_full=True))
    mgr.offer([1, 2], keys(1, 2))
    mgr.drain()
    stats = mgr.stats()
    assert stats["disk"].skipped_stores == 2 and stats["disk"].used_bytes == 0
    assert stats["disk"].enabled and stats["cpu"].stored_blocks == 2
    assert not [p for p in mgr.disk.root.rglob("*") if p.suffix == ".kvb" or ".tmp" in p.name]


def test_disappearing_directory_disables_disk_tier(manager_factory, caplog):
    mgr, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=8)
    mgr.offer([1], keys(1))
    mgr.drain()
    shutil.rmtree(mgr.disk.root.parent)
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        mgr.offer([2, 3], keys(2, 3))
        mgr.drain()
    assert not mgr.stats()["disk"].enabled
    assert "disk offload tier disabled" in caplog.text
    # disk entries are forgotten; the CPU tier's one row holds key 2, the first block of
    # the job (a job's blocks never evict one another: the leading blocks of a prefix stay)
    assert mgr.lookup(keys(1)) == 0 and mgr.lookup(keys(3)) == 0
    assert mgr.lookup(keys(2)) == 1
    mgr.offer([4], keys(4))  # still works with the CPU tier alone
    mgr.drain()
    assert mgr.lookup(keys(4)) == 1


def plant_damage(root, outside) -> list[str]:
    """Entries named like the tier's files that are not its regular files, in the disk
    tier's namespace ``root``; the links lead to ``outside``. Returns their names."""
    outside.mkdir()
    (outside / "elsewhere.kvb").write_bytes(b"not the tier's")
    (root / "zz").mkdir()
    (root / "zz" / "zzdir.kvb").mkdir()  # a directory named like a block file
    (root / "zz" / "zzdead.kvb").symlink_to(outside / "missing")  # dangling
    (root / "zz" / "zzlink.kvb").symlink_to(outside / "elsewhere.kvb")  # leads out
    (root / "zz" / "zzdir.kvb.123.tmp").mkdir()  # a directory named like a temp file
    (root / "ee").symlink_to(outside)  # a block folder that is a link
    return ["zz/zzdir.kvb", "zz/zzdead.kvb", "zz/zzlink.kvb", "zz/zzdir.kvb.123.tmp", "ee"]


def test_damaged_disk_entries_are_skipped_and_counted_never_followed(manager_factory,
                                                                     tmp_path, caplog):
    """Start-up used to stop in the scan (IsADirectoryError, FileNotFoundError). Whatever
    is not a regular file of the tier is left alone and counted; the blocks of an earlier
    process are still found, and nothing outside the tier's folder is read or written."""
    shared = tmp_path / "shared"
    first, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared)
    expected = block(storage, 1)
    first.offer([1], keys(1))
    first.shutdown(flush=True)
    damaged = plant_damage(first.disk.root, tmp_path / "outside")
    before = {p: p.read_bytes() for p in (tmp_path / "outside").iterdir()}
    with caplog.at_level(logging.WARNING, logger="kvmem.tiers"):
        second, fresh, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared,
                                           storage=make_storage(seed=1))
    disk = second.stats()["disk"]
    assert disk.skipped_files == len(damaged) and disk.enabled
    assert "skipped 5 entries that are not regular files" in caplog.text
    assert all(os.path.lexists(second.disk.root / name) for name in damaged)
    assert second.lookup(keys(1)) == 1
    assert roundtrip(second, fresh, [], keys(1), [5]).ok and same_block(fresh, 5, expected)
    # a block whose folder is a link is not written through it
    assert not second.disk.put("ee" + "0" * 30, torch.zeros(BLOCK_NBYTES, dtype=torch.uint8))
    assert {p: p.read_bytes() for p in (tmp_path / "outside").iterdir()} == before


def test_a_namespace_that_is_a_link_turns_the_disk_tier_off(manager_factory, tmp_path):
    first, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=tmp_path / "d")
    root = first.disk.root
    first.shutdown()
    shutil.rmtree(root)
    (tmp_path / "outside").mkdir()
    root.symlink_to(tmp_path / "outside")
    second, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=tmp_path / "d")
    disk = second.stats()["disk"]
    assert not disk.enabled and disk.skipped_files == 1
    second.offer([1], keys(1))
    second.drain()
    assert list((tmp_path / "outside").iterdir()) == []
    assert second.lookup(keys(1)) == 1  # the CPU tier still works


def test_restart_reuses_disk_tier_only_with_the_same_identity(manager_factory, tmp_path):
    shared = tmp_path / "shared"
    first, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=8, disk_dir=shared)
    expected = [block(storage, b) for b in (1, 2)]
    first.offer([1, 2], keys(1, 2))
    first.shutdown(flush=True)

    fresh = make_storage(seed=1)
    second, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8, storage=fresh, disk_dir=shared)
    assert second.lookup(keys(1, 2)) == 2
    handle = roundtrip(second, fresh, [], keys(1, 2), [5, 6])
    assert handle.ok
    assert same_block(fresh, 5, expected[0]) and same_block(fresh, 6, expected[1])

    other, _, _ = manager_factory(cpu_blocks=1, disk_blocks=8, layout="tp2-rank0",
                                  disk_dir=shared)
    assert other.lookup(keys(1, 2)) == 0
    bigger = TensorKVStorage(8, NUM_SLOTS, SlotShape(2, 8, 2, 8), torch.float32)
    other_shape = OffloadManager(
        OffloadConfig(cpu_bytes=1 << 20, disk_dir=str(shared), disk_bytes=1 << 20), bigger,
        NUM_SLOTS, FakeHolder(), model="tiny", layout="tp1")
    try:
        assert other_shape.lookup(keys(1, 2)) == 0
    finally:
        other_shape.shutdown()


def test_identity_digest_depends_on_every_field():
    base = TierIdentity("m", "tp1", "float32", 16, (2, 16, 2, 8), 4)
    variants = [TierIdentity("m2", "tp1", "float32", 16, (2, 16, 2, 8), 4),
                TierIdentity("m", "tp2", "float32", 16, (2, 16, 2, 8), 4),
                TierIdentity("m", "tp1", "bfloat16", 16, (2, 16, 2, 8), 4),
                TierIdentity("m", "tp1", "float32", 32, (2, 32, 2, 8), 4),
                TierIdentity("m", "tp1", "float32", 16, (2, 16, 2, 8), 5)]
    digests = {v.digest() for v in variants}
    assert base.digest() == TierIdentity("m", "tp1", "float32", 16, (2, 16, 2, 8), 4).digest()
    assert base.digest() not in digests and len(digests) == len(variants)


# -- eviction snapshots and shutdown -----------------------------------------------------

def test_on_evict_snapshots_the_block_before_it_is_reused(manager_factory):
    mgr, storage, holder = manager_factory(faults=Faults(store_delay_s=0.2))
    original = block(storage, 3)
    assert mgr.on_evict([3], keys(30)[:1]) == 1
    assert not holder.held  # no hold: the copy was taken synchronously
    for s in range(NUM_SLOTS):
        storage.slot_tensor(s)[3].fill_(-1.0)  # the block is reused for new data
    mgr.drain()
    handle = roundtrip(mgr, storage, [], keys(30), [9])
    assert handle.ok and same_block(storage, 9, original)
    assert mgr.on_evict([3], keys(30)[:1]) == 0  # already stored


def test_on_evict_copies_a_batch_in_one_store_and_skips_what_is_stored(manager_factory):
    """The pool hands over every block it evicts at once (a give-back evicts hundreds):
    the ones no tier holds are copied out in one job, before any is overwritten."""
    mgr, storage, _ = manager_factory()
    assert mgr.on_evict([3], keys(30)[:1]) == 1
    mgr.drain()
    originals = [block(storage, b) for b in (3, 4, 5)]
    jobs = []
    store_now = mgr.engine.store_now
    mgr.engine.store_now = lambda job: jobs.append(job.block_ids) or store_now(job)
    assert mgr.on_evict([3, 4, 5], keys(30, 40, 50)) == 2  # 30 is stored already
    assert jobs == [[4, 5]]
    for b in (3, 4, 5):
        for s in range(NUM_SLOTS):
            storage.slot_tensor(s)[b].fill_(-1.0)
    mgr.drain()
    handle = roundtrip(mgr, storage, [], keys(30, 40, 50), [9, 10, 11])
    assert handle.ok
    assert all(same_block(storage, 9 + i, originals[i]) for i in range(3))


def test_shutdown_joins_threads_and_releases_every_hold(manager_factory):
    threads_before = set(threading.enumerate())
    mgr, storage, holder = manager_factory(cpu_blocks=4, disk_blocks=4,
                                           faults=Faults(store_delay_s=0.2))
    mgr.offer([1, 2], keys(1, 2))
    mgr.offer([3], keys(3))
    handle = mgr.load("r", keys(99), [9])
    mgr.shutdown()
    assert not holder.held and mgr.held_blocks == 0
    assert handle.done.is_set() and handle.num_loaded == 0
    assert not [t for t in threading.enumerate()
                if t.name.startswith("kvmem-") and t not in threads_before]
    assert mgr.offer([4], keys(4)) == 0


class GatedStores(Faults):
    """Each store waits in ``before_store`` until the test lets it go, and the transfer
    thread's order of stores and loads is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.store_waiting = threading.Event()
        self.go = threading.Event()

    def before_store(self) -> None:
        self.order.append("store")
        self.store_waiting.set()
        assert self.go.wait(60)

    def before_read(self) -> None:
        self.order.append("load")


def test_loads_go_before_queued_stores(manager_factory):
    faults = GatedStores()
    mgr, storage, _ = manager_factory(cpu_blocks=8, faults=faults)
    faults.go.set()
    mgr.offer([1], keys(1))
    mgr.drain()
    faults.go.clear()
    faults.store_waiting.clear()
    faults.order.clear()
    mgr.offer([2], keys(2))
    assert faults.store_waiting.wait(60)  # the first store is running; the second is queued
    mgr.offer([3], keys(3))
    handle = mgr.load("r", keys(1), [9])
    faults.go.set()
    assert handle.done.wait(60) and handle.ok
    mgr.drain()
    assert faults.order == ["store", "load", "store"]


# -- host rows: allocated once, handed out to one job at a time --------------------------

def test_host_rows_go_lowest_first_to_one_holder_at_a_time_and_copy_as_runs():
    rows = HostRows(8, 4)
    assert rows.take(3) == [0, 1, 2] and rows.take(2) == [3, 4]
    rows.give_back([1])
    assert rows.take(3) == [1, 5, 6] and rows.num_free == 1
    taken: list[list[int]] = []
    threads = [threading.Thread(target=lambda: taken.append(rows.take(1, timeout=10)))
               for _ in range(3)]
    for t in threads:
        t.start()
    rows.give_back([0, 2])  # two waiters get one row each, one row was still free
    for t in threads:
        t.join(10)
    assert sorted(r for got in taken for r in got) == [0, 2, 7]  # none handed out twice
    other = HostRows(4, 4)
    views = runs([(rows, 3), (rows, 4), (other, 0), (other, 1), (rows, 6), (rows, 7)])
    assert [(v.data_ptr(), len(v)) for v in views] == [
        (rows.tensor[3].data_ptr(), 2), (other.tensor[0].data_ptr(), 2),
        (rows.tensor[6].data_ptr(), 2)]


def test_cpu_tier_blocks_are_copied_straight_into_and_out_of_its_rows(manager_factory,
                                                                       monkeypatch):
    """A store gathers pool blocks into the CPU tier's own rows and a load copies those
    rows into the pool: no host row in between (the tier's row-to-row copies fail here)."""
    def no_copy(*_):
        raise AssertionError("a host-to-host copy of a CPU tier row")
    monkeypatch.setattr(CPUStore, "_write", no_copy)
    monkeypatch.setattr(CPUStore, "_read", no_copy)
    mgr, storage, holder = manager_factory(cpu_blocks=8)
    originals = [block(storage, b) for b in (1, 2, 3, 4)]
    assert mgr.offer([1, 2, 3, 4], keys(1, 2, 3, 4)) == 4
    mgr.drain()
    assert not holder.held and mgr.stats()["cpu"].stored_blocks == 4
    rows = [mgr.cpu.ref(mgr.cpu._entries[key_name(k)])[1] for k in keys(1, 2, 3, 4)]
    assert rows == [0, 1, 2, 3]  # one run: a single copy
    handle = roundtrip(mgr, storage, [], keys(3, 1, 4, 2), [9, 10, 11, 12])
    assert handle.ok
    for dst, i in zip((9, 10, 11, 12), (2, 0, 3, 1), strict=True):
        assert same_block(storage, dst, originals[i])


class GatedDisk(Faults):
    """Disk writes wait until the test lets them go (at the latest when it ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def before_write(self) -> None:
        assert self.go.wait(60)


@pytest.fixture
def gated_disk():
    faults = GatedDisk()
    yield faults
    faults.go.set()  # before the managers shut down


def wait_until(condition, timeout: float = 30.0) -> None:
    stop = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        stop.wait(0.01)
    raise AssertionError("timed out")


def test_a_disk_write_keeps_its_rows_until_written_and_a_job_waits_for_free_ones(
        manager_factory, gated_disk):
    """Staging rows (and CPU tier rows read by the disk writer) stay the job's until its
    disk write is done; a job finding none free waits for them instead of reusing a row
    still queued for the disk or dropping its blocks, and every byte reaches the disk."""
    faults = gated_disk
    mgr, storage, holder = manager_factory(cpu_blocks=0, disk_blocks=16, faults=faults,
                                           staging_blocks=2)
    originals = {b: block(storage, b) for b in range(1, 6)}
    mgr.offer([1, 2], keys(1, 2))
    mgr.offer([3, 4, 5], keys(3, 4, 5))
    wait_until(lambda: mgr.poll() is not None and not holder.held[1])
    threading.Event().wait(0.3)  # the second job waits: its blocks stay held in the pool
    mgr.poll()
    assert mgr.engine.staging.num_free == 0 and holder.held == Counter({3: 1, 4: 1, 5: 1})
    faults.go.set()
    mgr.drain()
    assert not holder.held and mgr.engine.staging.num_free == 2
    assert mgr.stats()["disk"].stored_blocks == 5 and mgr.stats()["disk"].skipped_stores == 0
    handle = roundtrip(mgr, storage, [], keys(1, 2, 3, 4, 5), [11, 12, 13, 14, 15])
    assert handle.ok
    for b in range(1, 6):
        assert same_block(storage, 10 + b, originals[b])


def test_cpu_rows_read_by_the_disk_writer_stay_pinned_until_written(manager_factory,
                                                                     gated_disk):
    faults = gated_disk
    mgr, storage, _ = manager_factory(cpu_blocks=2, disk_blocks=8, faults=faults)
    original = block(storage, 1)
    mgr.offer([1, 2], keys(1, 2))
    wait_until(lambda: mgr.cpu.contains(key_name(keys(2)[0])))
    entry = mgr.cpu._entries[key_name(keys(1)[0])]
    assert entry.pins == 1  # the disk writer reads its row next
    mgr.offer([3], keys(3))  # no CPU row can be freed: 3 goes through a staging row
    wait_until(lambda: mgr.engine.staging.num_free < mgr.engine.staging.num_rows)
    assert not mgr.cpu.contains(key_name(keys(3)[0])) and entry.pins == 1
    faults.go.set()
    mgr.drain()
    assert entry.pins == 0 and mgr.engine.staging.num_free == mgr.engine.staging.num_rows
    assert mgr.stats()["disk"].stored_blocks == 3
    mgr.cpu._forget(entry)  # 1 is read back from disk: its bytes were not overwritten
    handle = roundtrip(mgr, storage, [], keys(1), [9])
    assert handle.ok and handle.tiers == ["disk"] and same_block(storage, 9, original)


def test_a_job_skips_the_disk_when_no_staging_row_comes_back_in_time(manager_factory,
                                                                       gated_disk):
    faults = gated_disk
    mgr, storage, holder = manager_factory(cpu_blocks=0, disk_blocks=8, faults=faults,
                                           staging_blocks=1)
    mgr.engine.staging_wait_s = 0.2
    mgr.offer([1], keys(1))
    mgr.offer([2, 3], keys(2, 3))
    wait_until(lambda: mgr.poll() is not None and not holder.held)  # the second job gave up
    assert mgr.stats()["disk"].skipped_stores == 2
    faults.go.set()
    mgr.drain()
    assert mgr.lookup(keys(1)) == 1 and mgr.lookup(keys(2)) == 0


def test_loads_larger_than_the_load_rows_go_in_chunks(manager_factory, monkeypatch):
    monkeypatch.setattr("kvmem.tiers.manager.LOAD_CHUNK_BYTES", 2 * BLOCK_NBYTES)
    mgr, storage, _ = manager_factory(cpu_blocks=2, disk_blocks=8)
    originals = {b: block(storage, b) for b in range(1, 6)}
    mgr.offer([1, 2, 3, 4, 5], keys(1, 2, 3, 4, 5))  # 1, 2 in the CPU tier; all on disk
    mgr.drain()
    assert mgr.engine.load_rows.num_rows == 2
    handle = roundtrip(mgr, storage, [], keys(1, 2, 3, 4, 5), [11, 12, 13, 14, 15])
    assert handle.ok and handle.tiers == ["cpu", "cpu", "disk", "disk", "disk"]
    for b in range(1, 6):
        assert same_block(storage, 10 + b, originals[b])


def test_an_eviction_snapshot_without_a_cpu_tier_uses_a_staging_row(manager_factory,
                                                                      gated_disk):
    faults = gated_disk
    mgr, storage, _ = manager_factory(cpu_blocks=0, disk_blocks=8, faults=faults,
                                      staging_blocks=1)
    original = block(storage, 3)
    assert mgr.on_evict([3], keys(30)[:1]) == 1
    for s in range(NUM_SLOTS):
        storage.slot_tensor(s)[3].fill_(-1.0)
    assert mgr.engine.staging.num_free == 0  # held until the disk write
    assert mgr.on_evict([4], keys(40)[:1]) == 1  # no staging row free: the disk skips it
    assert mgr.stats()["disk"].skipped_stores == 1
    faults.go.set()
    mgr.drain()
    assert mgr.engine.staging.num_free == 1
    handle = roundtrip(mgr, storage, [], keys(30), [9])
    assert handle.ok and same_block(storage, 9, original)


# -- configuration -----------------------------------------------------------------------

def test_config_errors_are_one_line_kvmem_errors(tmp_path):
    with pytest.raises(ConfigError, match="--disk-offload-gib needs --disk-offload-dir"):
        OffloadConfig(disk_bytes=1 << 30)
    with pytest.raises(ConfigError, match="needs --disk-offload-gib"):
        OffloadConfig(disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="non-negative"):
        OffloadConfig.from_gib(cpu_offload_gib=-1)
    with pytest.raises(ConfigError, match="unknown offload policy"):
        OffloadConfig(cpu_bytes=1, policy="mru")
    with pytest.raises(ConfigError, match="smaller than one KV block"):
        OffloadManager(OffloadConfig(cpu_bytes=100), make_storage(), NUM_SLOTS, FakeHolder(),
                       model="m", layout="l")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--disk-offload-dir"):
        OffloadManager(OffloadConfig(disk_dir=str(blocker), disk_bytes=1 << 20), make_storage(),
                       NUM_SLOTS, FakeHolder(), model="m", layout="l")


def test_config_from_gib_and_describe():
    config = OffloadConfig.from_gib(cpu_offload_gib=4, disk_offload_dir="/d", disk_offload_gib=0.5)
    assert config.cpu_bytes == 4 << 30 and config.disk_bytes == 512 << 20
    assert config.describe() == "CPU 4.00 GiB, disk 512.00 MiB in /d (lru)"
    assert OffloadConfig().describe() == "off" and not OffloadConfig().enabled


def test_weights_digest_sees_tensor_data_with_the_same_header(tmp_path):
    """A checkpoint whose header is unchanged but one tensor holds other values (updated
    in place, or another seed of the same shapes) digests differently; a copy does not."""
    from safetensors.torch import save_file

    from kvmem.tiers.weights import weights_digest

    tensors = {f"w{i}": torch.zeros(64, 64) for i in range(4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    before = weights_digest([tmp_path / "model.safetensors"])
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "copy" / "model.safetensors")
    assert weights_digest([tmp_path / "copy" / "model.safetensors"]) == before
    tensors["w2"] += 1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert weights_digest([tmp_path / "model.safetensors"]) != before
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(3 << 20))
    assert weights_digest([gguf]) != weights_digest([tmp_path / "model.safetensors"])


# -- what each tier reports ---------------------------------------------------------------

def test_each_tier_reports_lookups_loads_time_and_prefill_saved(manager_factory):
    """Per tier: lookups (hits + misses), blocks and bytes stored and loaded with the time
    they took, the hit tokens each load restored (as the caller shares them out) valued at
    the engine's measured prefill rate, and stores never loaded. A load made before any
    prefill was measured is valued once a rate is known."""
    prefill = PrefillMeter()
    mgr, storage, _ = manager_factory(cpu_blocks=1, disk_blocks=8, prefill=prefill)
    mgr.offer([1, 2, 3], keys(1, 2, 3))
    mgr.drain()
    mgr.offer([4], keys(4))  # the CPU tier keeps only this one; 1..3 are on disk
    mgr.drain()
    assert mgr.lookup(keys(4)) == 1 and mgr.lookup(keys(1, 2, 3, 5)) == 3
    roundtrip(mgr, storage, [], keys(4), [9])
    handle = mgr.load("r", keys(1, 2, 3), [10, 11, 12], block_tokens=[4, 4, 0])
    assert handle.done.wait(10) and handle.tiers == ["disk", "disk", "disk"]
    stats = mgr.stats()
    cpu, disk = stats["cpu"], stats["disk"]
    assert (cpu.lookups, cpu.hits, cpu.misses) == (5, 1, 4)  # 1..3 and 5: misses here
    assert (disk.lookups, disk.hits, disk.misses) == (4, 3, 1)
    assert cpu.loaded_blocks == 1 and cpu.hit_tokens == SHAPE.block_size
    assert disk.loaded_blocks == 3 and disk.hit_tokens == 8  # the caller's shares
    assert disk.bytes_loaded == 3 * disk.bytes_stored // disk.stored_blocks  # file sizes
    assert disk.load_seconds > 0
    assert cpu.load_seconds > 0 and cpu.store_seconds > 0 and disk.store_seconds > 0
    # 1 took the CPU tier's row (2 and 3 found it taken by their own job), 4 evicted it
    assert cpu.stored_blocks == 2 and cpu.evictions == 1 and cpu.wasted_blocks == 1
    assert cpu.unused_blocks == 0 and disk.wasted_blocks == 0
    assert disk.stored_blocks == 4 and disk.unused_blocks == 1  # block 4 came from the CPU
    assert cpu.prefill_saved_seconds == disk.prefill_saved_seconds == 0  # no rate yet
    prefill.observe(tokens=400, seconds=2.0)  # 200 tokens/s
    prefill.observe(tokens=0, seconds=5.0)  # a step without prefill: not part of the rate
    stats = mgr.stats()
    assert stats["cpu"].prefill_saved_seconds == pytest.approx(SHAPE.block_size / 200)
    assert stats["disk"].prefill_saved_seconds == pytest.approx(8 / 200)
    assert mgr.stats()["disk"].prefill_saved_seconds == pytest.approx(8 / 200)  # once


def test_blocks_found_on_disk_at_start_up_are_not_counted_as_stores_of_this_process(
        manager_factory, tmp_path):
    """unused and wasted count only blocks this process stored: a restarted engine's disk
    blocks are neither (share of stores never loaded stays within 0..1)."""
    mgr, _, _ = manager_factory(cpu_blocks=1, disk_blocks=2, disk_dir=tmp_path / "d")
    mgr.offer([1, 2], keys(1, 2))
    mgr.drain()
    assert mgr.stats()["disk"].unused_blocks == 2
    mgr.shutdown(flush=True)
    again, _, _ = manager_factory(cpu_blocks=1, disk_blocks=2, disk_dir=tmp_path / "d")
    again.offer([3, 4], keys(3, 4))  # evicts both earlier blocks from disk
    again.drain()
    disk = again.stats()["disk"]
    assert disk.evictions == 2 and disk.wasted_blocks == 0
    assert disk.stored_blocks == 2 and disk.unused_blocks == 2


def test_prefill_step_tokens_and_block_tokens():
    assert prefill_step_tokens([1, 1, 1]) == 0  # decodes only
    assert prefill_step_tokens([1, 300, 1]) == 302
    # two full-attention groups (0, 2) share a position's 16 tokens; a window group's
    # blocks stand for none
    assert block_tokens([0, 1, 2, 0], [0, 2], 16) == [8.0, 0.0, 8.0, 8.0]


class StuckReads(Faults):
    """Every block read waits until ``go`` is set: a file system that hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.reading = threading.Event()

    def before_read(self) -> None:
        self.reading.set()
        assert self.go.wait(60)


def test_a_cancelled_load_writes_nothing_when_its_read_ends(manager_factory):
    """A caller that gave up on a load (vLLM's worker after its bound, which then has vLLM
    recompute the blocks) must not find the load's bytes landing in those blocks later,
    when they may hold another request's KV."""
    mgr, storage, _ = manager_factory(cpu_blocks=8)
    mgr.offer([1], keys(1))
    mgr.drain()
    stuck = StuckReads()
    mgr.cpu.faults = stuck
    reused = block(storage, 9)  # block 9 now holds something else
    handle = mgr.load("r", keys(1), [9])
    assert stuck.reading.wait(60)
    handle.cancel()
    stuck.go.set()
    assert handle.done.wait(60)
    assert handle.num_loaded == 0 and handle.error == "cancelled"
    assert same_block(storage, 9, reused)
