"""Elastic KV memory for vLLM, the parts that run without vLLM: its settings, the byte
layout of block ranges, granule mapping over a real reservation, and the worker's
allocation and per-step mapping (``tests/test_vllm_elastic_pool.py`` drives them with
vLLM's own block pool and KV allocation)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.elastic.config import (
    CONNECTOR,
    ElasticSettings,
    elastic_from_env,
    settings_from_extra,
    with_elastic,
)
from kvmem.integrations.vllm.elastic.layout import GranuleMap, KVLayout, TensorPlacement
from kvmem.integrations.vllm.elastic.worker import ElasticMapError, ElasticWorker
from kvmem.memory.backends import MmapBackend

PAGE = 4096


# ---------------------------------------------------------------------- settings
def test_off_unless_asked() -> None:
    assert elastic_from_env("m", {}) is None
    assert elastic_from_env("m", {"KVMEM_VLLM_KV_MEMORY": " "}) is None


def test_settings_from_the_environment() -> None:
    s = elastic_from_env("/models/tiny/", {
        "KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_MEMORY_LIMIT": "512MiB",
        "KVMEM_LEDGER_DIR": "/tmp/l", "KVMEM_VLLM_KV_MEMORY_FAULTS":
        '{"map_error_rank": 1, "map_error_block": 7}'})
    assert s is not None and s.limit_bytes == 512 << 20 and s.ledger_dir == "/tmp/l"
    assert s.engine_name.startswith("vllm-tiny-")
    assert (s.map_error_rank, s.map_error_block) == (1, 7)
    named = elastic_from_env("m", {"KVMEM_VLLM_KV_MEMORY": "elastic",
                                   "KVMEM_VLLM_ENGINE_NAME": "chat"})
    assert named == ElasticSettings(engine_name="chat")
    assert settings_from_extra(s.to_extra()) == s
    for word, huge in (("1", True), ("on", True), ("0", None), ("", None)):
        h = elastic_from_env("m", {"KVMEM_VLLM_KV_MEMORY": "elastic",
                                   "KVMEM_VLLM_KV_MEMORY_HUGE_PAGES": word})
        assert h is not None and h.huge_pages is huge
        assert settings_from_extra(h.to_extra()) == h


@pytest.mark.parametrize(("device", "problem", "message"), [
    ("cuda", None, "HUGE_PAGES=1 is for vLLM's CPU build; cuda's pages are the driver's"),
    ("cpu", "shmem_enabled: never", "KVMEM_VLLM_KV_MEMORY_HUGE_PAGES=1: shmem_enabled: never"),
])
def test_huge_pages_are_checked_before_vllm_starts(monkeypatch, device, problem, message):
    from types import SimpleNamespace

    from kvmem.integrations.vllm.elastic import config
    from kvmem.memory import huge_pages

    monkeypatch.setattr(huge_pages, "huge_pages_problem", lambda shared: problem)
    vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type=device))
    with pytest.raises(ConfigError, match=message):
        config.check_deployment(vllm_config, ElasticSettings(engine_name="e", huge_pages=True))


@pytest.mark.parametrize(("env", "message"), [
    ({"KVMEM_VLLM_KV_MEMORY": "Elastic"}, "KVMEM_VLLM_KV_MEMORY='Elastic': the only value is"),
    ({"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_MEMORY_LIMIT": "lots"},
     "KVMEM_VLLM_KV_MEMORY_LIMIT: cannot read 'lots' as a size"),
    ({"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_MEMORY_LIMIT": "-1GiB"},
     "KVMEM_VLLM_KV_MEMORY_LIMIT: cannot read"),
    ({"KVMEM_VLLM_KV_MEMORY_LIMIT": "1GiB"}, "KVMEM_VLLM_KV_MEMORY_LIMIT is set but"),
    ({"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_MEMORY_FAULTS": '{"map": 1}'},
     "expected a JSON object"),
    ({"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_MEMORY_FAULTS": "[1"},
     "expected a JSON object"),
    ({"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_MEMORY_HUGE_PAGES": "maybe"},
     "KVMEM_VLLM_KV_MEMORY_HUGE_PAGES='maybe': expected 1 or 0"),
    ({"KVMEM_VLLM_KV_MEMORY_HUGE_PAGES": "1"}, "KVMEM_VLLM_KV_MEMORY_HUGE_PAGES is set but"),
])
def test_bad_settings_are_one_line(env, message) -> None:
    with pytest.raises(ConfigError) as err:
        elastic_from_env("m", env)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "'engine_name'] must be a non-empty string"),
    ({"engine_name": "e", "limit": 1}, "unknown key 'limit'"),
    ({"engine_name": "e", "limit_bytes": "x"}, "cannot read 'x' as a size"),
    ({"engine_name": "e", "map_error_block": -2}, "must be a non-negative integer"),
    ({"engine_name": "e", "huge_pages": "yes"}, r"\['huge_pages'\] must be true or false"),
])
def test_bad_extra_config_is_one_line(extra, message) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_from_extra(extra)


def test_connector_alone_or_beside_the_users() -> None:
    s = ElasticSettings(engine_name="e", limit_bytes=1 << 30)
    alone = with_elastic(None, s)
    assert alone["kv_connector"] == CONNECTOR and alone["kv_role"] == "kv_both"
    assert alone["kv_connector_extra_config"] == {"engine_name": "e", "limit_bytes": 1 << 30}
    tiers = {"kv_connector": "KvmemConnector", "kv_connector_module_path":
             "kvmem.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy":
             "recompute", "kv_connector_extra_config": {"cpu_offload_gib": 1}}
    multi = with_elastic(tiers, s)
    assert multi["kv_connector"] == "MultiConnector"
    assert multi["kv_load_failure_policy"] == "recompute" and multi["kv_role"] == "kv_both"
    assert multi["kv_connector_extra_config"]["connectors"] == [alone, tiers]
    again = with_elastic({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"connectors": [tiers]}}, s)
    assert again["kv_connector_extra_config"]["connectors"] == [alone, tiers]
    with pytest.raises(ConfigError, match="added by KVMEM_VLLM_KV_MEMORY=elastic"):
        with_elastic(alone, s)


# ---------------------------------------------------------------------- layout
def test_spans_of_layer_and_block_outermost_layouts() -> None:
    # vLLM CPU's LBHNC: each layer holds its blocks in a row
    layers = KVLayout([TensorPlacement(0, 10 * 512, 512, 3)], num_blocks=10, size=3 * 10 * 512)
    assert layers.block_bytes == 3 * 512
    assert layers.spans(2, 4) == [(1024, 2048), (6144, 7168), (11264, 12288)]
    # block-outermost: a block holds every layer; consecutive blocks form one span
    blocks = KVLayout([TensorPlacement(0, 512, 3 * 512, 3)], num_blocks=10, size=3 * 10 * 512)
    assert blocks.spans(2, 4) == [(3072, 6144)]
    # two cache groups overlaying the same bytes count once
    overlay = KVLayout([TensorPlacement(0, 5120, 512, 1), TensorPlacement(0, 5120, 512, 1)],
                       num_blocks=10, size=5120)
    assert overlay.spans(0, 10) == [(0, 5120)]
    with pytest.raises(Exception, match="outside the KV cache"):
        layers.spans(9, 11)


def test_granules_shared_by_two_block_ranges_stay_mapped_while_either_is() -> None:
    backend = MmapBackend()
    backend.reserve(16 * PAGE)
    granules = GranuleMap(backend, 16 * PAGE)
    block = 6144  # one and a half OS pages: blocks 0 and 1 share the second page
    tensor = backend.tensor(0, 16 * PAGE)
    assert granules.map([(0, block)]) == 2 * PAGE
    assert granules.map([(block, 2 * block)]) == PAGE  # the shared page is mapped already
    tensor[: 2 * block] = 7
    assert backend.resident_bytes() == 3 * PAGE
    assert granules.unmap([(0, block)]) == PAGE  # the shared page stays for block 1
    assert int(tensor[block]) == 7 and backend.resident_bytes() == 2 * PAGE
    assert granules.unmap([(block, 2 * block)]) == 2 * PAGE
    assert backend.resident_bytes() == 0 and granules.mapped_bytes == 0
    with pytest.raises(Exception, match="not all mapped"):
        granules.unmap([(0, block)])
    backend.close()


# ---------------------------------------------------------------------- worker
def make_worker(**settings) -> ElasticWorker:
    # 2 layers of 64 blocks, 8 KiB per layer and block (two OS pages)
    layout = KVLayout([TensorPlacement(0, 64 * 8192, 8192, 2)], num_blocks=64,
                      size=2 * 64 * 8192)
    return ElasticWorker(layout=layout, settings=ElasticSettings(engine_name="e", **settings),
                         rank=1, tensor_parallel_size=2, pipeline_parallel_size=1,
                         has_peers=False)


def test_worker_places_the_kv_buffer_over_its_reservation() -> None:
    worker = make_worker()
    with worker.allocation_context():
        other = torch.zeros(16, dtype=torch.int8)  # passes through
        buf = torch.zeros(worker.layout.size, dtype=torch.int8)
    assert other.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert buf is worker.buffer and buf.numel() == worker.layout.size
    # only the null block (2 layers x 8 KiB) is in memory
    assert worker.backend.resident_bytes() == 2 * 8192 == worker.granules.mapped_bytes
    worker.apply(1, ((True, 1, 4),))
    view = buf.view(2, 64, 8192)
    view[:, 1:4] = 1
    assert worker.backend.resident_bytes() == 4 * 2 * 8192
    worker.apply(2, ((False, 2, 3), (True, 9, 10)))
    assert worker.stats()["mapped_blocks"] == 4
    # blocks 0, 1, 3 and 9 (mapped, not written)
    assert worker.backend.resident_bytes() == 4 * 2 * 8192
    # block 2's bytes are gone (reading a released page of the memory file commits a
    # fresh one, which is why only blocks in a block table are ever read)
    assert int(view[:, 1:4].sum()) == 2 * 2 * 8192
    # on the CPU the reservation is a memory file the scheduler can release pages in
    file = worker.shared_file()
    assert file is not None and file.fd == worker.backend.fd and file.rank == worker.rank
    assert file.layout().spans(2, 3) == worker.layout.spans(2, 3)


@pytest.mark.parametrize(("seq", "ops", "message"), [
    (2, (), "expected page map message 1, got 2"),
    (1, ((True, 0, 2),), "cannot map KV blocks 0..1: some are mapped already"),
    (1, ((False, 5, 6),), "cannot unmap KV blocks 5..5: some are not mapped"),
])
def test_worker_refuses_a_page_map_it_cannot_follow(seq, ops, message) -> None:
    worker = make_worker()
    with worker.allocation_context():
        torch.zeros(worker.layout.size, dtype=torch.int8)
    with pytest.raises(ElasticMapError) as err:
        worker.apply(seq, ops)
    assert message in str(err.value) and "rank 1 of 2 (pp stage 0, tp rank 1)" in str(err.value)
    assert "\n" not in str(err.value)


def test_injected_map_failure_names_the_rank_and_blocks() -> None:
    worker = make_worker(map_error_rank=1, map_error_block=8)
    with worker.allocation_context():
        torch.zeros(worker.layout.size, dtype=torch.int8)
    worker.apply(1, ((True, 1, 8),))
    with pytest.raises(ElasticMapError, match=r"rank 1 of 2 .*cannot map KV blocks 8..9: "
                                              "injected map failure; stopping the engine"):
        worker.apply(2, ((True, 8, 10),))


def test_an_allocation_it_cannot_take_is_one_line() -> None:
    worker = make_worker()
    with (pytest.raises(ConfigError, match="vLLM allocated its KV cache without a torch.zeros"),
          worker.allocation_context()):
        torch.zeros(worker.layout.size, dtype=torch.float32)


def test_elastic_settings_travel_as_json() -> None:
    s = ElasticSettings(engine_name="e", limit_bytes=5, ledger_dir="/d", map_error_rank=0)
    assert settings_from_extra(json.loads(json.dumps(s.to_extra()))) == s
    assert "vllm" not in sys.modules


def test_every_elastic_hook_and_queue_method_is_checked_and_implemented() -> None:
    from pathlib import Path

    from kvmem.integrations.vllm import compat
    from kvmem.integrations.vllm.elastic.pool import ElasticBlockQueue

    checked = {n.path.rsplit(".", 1)[1] for n in compat.ELASTIC_NEEDS if n.exact}
    assert set(compat.ELASTIC_HOOKS) <= checked
    text = (Path(compat.__file__).parent / "elastic" / "connector.py").read_text()
    for hook in compat.ELASTIC_HOOKS:
        assert f"    def {hook}(self" in text, hook
    assert all(hasattr(ElasticBlockQueue, m) for m in compat.QUEUE_METHODS)


def test_a_reservation_that_fails_names_the_rank() -> None:
    from kvmem.memory.backends import BackendError

    class NoAddressSpace(MmapBackend):
        def reserve(self, nbytes: int) -> None:
            raise BackendError(f"cannot reserve {nbytes} bytes of address space: Cannot "
                               "allocate memory")

    worker = make_worker()
    worker.backend = NoAddressSpace()
    with pytest.raises(ElasticMapError) as err, worker.allocation_context():
        torch.zeros(worker.layout.size, dtype=torch.int8)
    assert str(err.value) == (
        "kvmem: rank 1 of 2 (pp stage 0, tp rank 1): cannot reserve 1048576 bytes of KV "
        "memory and map its null block: cannot reserve 1048576 bytes of address space: "
        "Cannot allocate memory")
