"""Heartbeats of torchrun ranks through a rendezvous store (``kvmem.engine.distributed
.heartbeat``), in one process: a store, a worker's heartbeat and rank 0's watch."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from kvmem.engine.distributed.config import ParallelConfig
from kvmem.engine.distributed.heartbeat import HEARTBEAT_S, Heartbeat, PeerWatch


def store_and_layout() -> tuple[dist.TCPStore, ParallelConfig, ParallelConfig]:
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                          timeout=timedelta(seconds=10), wait_for_workers=False)
    layout = dict(tensor_parallel_size=2, world_size=2, master_port=store.port,
                  launcher="torchrun")
    return store, ParallelConfig(rank=0, **layout), ParallelConfig(rank=1, **layout)


def test_a_beating_rank_is_never_silent_and_a_stopped_one_is_named():
    store, driver, worker = store_and_layout()
    heartbeat = Heartbeat(worker, on_lost=lambda reason: None).start()
    watch = PeerWatch(driver)
    assert watch.where[1].endswith(")") and "(pid " in watch.where[1]
    assert watch.wait_silent(2.5) is None  # it moved: returns after about one beat
    heartbeat.stop()
    time.sleep(HEARTBEAT_S)  # a beat in flight lands
    watch.poll()
    found = watch.wait_silent(1.5)
    assert found is not None and found[0] == 1 and found[1] >= 1.5


def test_a_worker_finds_the_store_gone():
    store, _, worker = store_and_layout()
    lost: list[str] = []
    done = threading.Event()
    Heartbeat(worker, on_lost=lambda reason: (lost.append(reason), done.set())).start()
    del store  # the node hosting the store is gone: its connections close
    assert done.wait(3 * HEARTBEAT_S + 2)
    assert len(lost) == 1 and lost[0]
