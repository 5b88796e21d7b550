"""Tensor-parallel startup of the elastic cache: one page map decided on rank 0, replayed on
every rank, with bounded waits that name what they waited for."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from kvmem.memory.backends import FakeBackend
from kvmem.memory.coordinator import PageMapCoordinator, RankMismatchError
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.storage import SlotShape
from kvmem.memory.wait import WaitTimeout

SHAPE = SlotShape(2, 16, 2, 32)

RANK = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from kvmem.memory.coordinator import PageMapCoordinator
    from kvmem.memory.elastic import ElasticKVStorage
    from kvmem.memory.storage import SlotShape

    rank, world_size, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = dist.FileStore(path, world_size)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    storage = ElasticKVStorage(2, SlotShape(2, 16, 4, 64), torch.float32, max_blocks=1024,
                               reserve_pages=2, rank=rank, world_size=world_size)
    coord = PageMapCoordinator(dist.PrefixStore("kv", store), rank=rank,
                               world_size=world_size, timeout=20)
    coord.startup(storage)
    # One engine step: rank 0 allocates; every rank writes the same block on its own shard.
    # Rank 0's pre-mapping thread keeps mapping spare pages in the background; an engine
    # sends those with its next step, so to compare the maps after one step, rank 0 lets
    # it finish before it drains the step's decisions.
    if rank == 0:
        queue = storage.free_queue()
        blocks = queue.pop_n(40)
        storage.on_blocks_allocated(blocks)
        storage.settle()
        coord.publish(1, storage.drain_ops())
        dist.broadcast_object_list([blocks], src=0)
    else:
        storage.apply_ops(coord.receive(1))
        got = [None]
        dist.broadcast_object_list(got, src=0)
        blocks = got[0]
    storage.slot_tensor(0)[blocks] = float(rank + 1)
    total = torch.tensor([float(storage.slot_tensor(0)[blocks].sum())])
    dist.all_reduce(total)
    mapped = sorted(p for p, s in enumerate(storage.table.state) if s.name == "MAPPED")
    maps = [None] * world_size
    dist.all_gather_object(maps, mapped)
    json.dump({"total": float(total), "maps": maps}, open(out, "w"))
    storage.close()
    dist.destroy_process_group()
""")


def test_two_ranks_over_gloo_map_the_same_pages(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(store),
                               str(tmp_path / f"out{r}.json")]) for r in range(2)]
    for p in procs:
        assert p.wait(300) == 0
    out = json.loads((tmp_path / "out0.json").read_text())
    assert out["maps"][0] == out["maps"][1] and len(out["maps"][0]) >= 10  # 40 blocks' pages
    elems = 40 * SlotShape(2, 16, 4, 64).elements_per_block
    assert out["total"] == elems * (1 + 2)  # both ranks wrote and read real memory


def _storage(rank: int, world_size: int = 2, **kw) -> ElasticKVStorage:
    return ElasticKVStorage(2, SHAPE, torch.float32, max_blocks=kw.pop("max_blocks", 64),
                            backend=FakeBackend(4096), blocks_per_page=4, rank=rank,
                            world_size=world_size, **kw)


def test_rank_that_never_arrives_fails_clearly_and_in_time(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    leader = _storage(0)
    # the configured bound ended the wait (and its message says so)
    with pytest.raises(WaitTimeout, match=r"timed out after 1 s waiting for rank 1 of 2 to "
                                          r"map the startup KV pages"):
        PageMapCoordinator(store, rank=0, world_size=2, timeout=1.0).startup(leader)
    assert leader._premap is None  # no background work started after a failed startup


def test_missing_rank_zero_fails_clearly_and_in_time(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    with pytest.raises(WaitTimeout,
                       match=r"timed out after 1 s waiting for rank 0 to publish the KV page map"):
        PageMapCoordinator(store, rank=1, world_size=2, timeout=1.0).startup(_storage(1))


def test_ranks_with_different_layouts_are_refused(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    store.set("kvmem/elastic/plan", json.dumps({"layout": [1, 2, 3], "ops": []}))
    with pytest.raises(RankMismatchError, match="rank 1 has KV layout"):
        PageMapCoordinator(store, rank=1, world_size=2, timeout=1.0).startup(_storage(1))


def test_world_size_comes_from_the_arguments_not_global_state():
    assert not dist.is_initialized()
    leader = _storage(0, world_size=2, start=True)
    assert leader._premap is None  # tensor-parallel: waits for the coordinator
    assert [op.kind for op in leader.drain_ops()] == ["map"]  # the null page, recorded
    with pytest.raises(Exception, match="rank 0 is not in a world of size 0"):
        _storage(0, world_size=0)
    leader.close()
