"""The scheduler-side release of a vLLM worker's KV pages (``release.WorkerFiles``): it
punches only in the worker's own memory file, and any handshake it cannot trust takes
the fallback (the workers unmap at their next step) in one logged line, never raises."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvmem.integrations.vllm.elastic.layout import TensorPlacement
from kvmem.integrations.vllm.elastic.release import WorkerFile, WorkerFiles
from kvmem.memory.shared_mmap import SharedMmapBackend

PAGE = 4096
BLOCKS = 16  # one page per block


@pytest.fixture
def worker():
    backend = SharedMmapBackend()
    backend.reserve(BLOCKS * PAGE)
    backend.map(0, BLOCKS * PAGE)
    backend.tensor(0, BLOCKS * PAGE).fill_(1)
    m = backend.memory_file()
    yield backend, WorkerFile(rank=0, pid=m.pid, fd=m.fd, size=m.size, granularity=PAGE,
                              placements=(TensorPlacement(0, BLOCKS * PAGE, PAGE, 1),),
                              num_blocks=BLOCKS, kv_size=BLOCKS * PAGE,
                              start_time=m.start_time, dev=m.dev, ino=m.ino)
    backend.close()


def test_the_workers_own_file_is_released_from_the_scheduler(worker) -> None:
    backend, file = worker
    files = WorkerFiles()
    assert files.connect([file], [(1, BLOCKS)])
    assert files.apply([(False, 4, 8)])
    assert backend.resident_bytes() == (BLOCKS - 4) * PAGE
    files.close()


@pytest.mark.parametrize("change", [
    dict(granularity=0), dict(granularity=-PAGE), dict(granularity=None), dict(size=0),
    dict(num_blocks=-1), dict(placements=(TensorPlacement(0, 0, 0, 0),)), dict(pid=-5),
    dict(start_time=1), dict(ino=1), dict(fd="3"), dict(placements=None),
])
def test_a_handshake_it_cannot_trust_falls_back_in_one_line(worker, change, caplog) -> None:
    backend, file = worker
    files = WorkerFiles()
    with caplog.at_level(logging.WARNING, logger="vllm.kvmem.elastic"):
        connected = files.connect([dataclasses.replace(file, **change)], [(1, BLOCKS)])
        applied = connected and files.apply([(False, 4, 8)])
    assert not applied and not files.active
    [line] = [r.getMessage() for r in caplog.records]
    assert "reach the workers with a step instead" in line and "\n" not in line
    assert backend.resident_bytes() == BLOCKS * PAGE  # nothing punched
