"""CPU KV memory in transparent huge pages (``--kv-memory-huge-pages``).

The host's settings are read, never changed: the tests that need huge pages skip, with
the setting named, where the kernel gives none; the error a user gets there is tested
where it would be raised, and the reading of the settings on made-up folders everywhere.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_checkpoint

from kvmem.engine.config import EngineConfig
from kvmem.engine.distributed.errors import StartupError
from kvmem.engine.kv_cache_setup import plan_kv_cache
from kvmem.engine.llm import LLM
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import ConfigError
from kvmem.memory.backends import BackendError, MmapBackend, make_backend
from kvmem.memory.huge_pages import huge_page_size, huge_pages_problem
from kvmem.memory.shared_mmap import FileHoles, SharedMmapBackend
from kvmem.memory.sizing import plan_elastic
from kvmem.spec import load_spec

ANON = huge_pages_problem(shared=False)
SHMEM = huge_pages_problem(shared=True)
needs_anon = pytest.mark.skipif(ANON is not None, reason=ANON or "")
needs_shmem = pytest.mark.skipif(SHMEM is not None, reason=SHMEM or "")
HUGE = huge_page_size()


def _thp_dir(tmp_path, enabled: str, shmem: str | None):
    (tmp_path / "enabled").write_text(enabled + "\n")
    if shmem is not None:
        (tmp_path / "shmem_enabled").write_text(shmem + "\n")
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    return tmp_path


@pytest.mark.parametrize("enabled,shmem,anon_ok,shared_ok", [
    ("always [madvise] never", "always within_size [advise] never deny force", True, True),
    ("[always] madvise never", "always within_size advise [never] deny force", True, False),
    ("always madvise [never]", "[advise]", False, False),
    ("always [madvise] never", None, True, False),
])
def test_the_kernels_settings_decide(tmp_path, enabled, shmem, anon_ok, shared_ok):
    root = _thp_dir(tmp_path, enabled, shmem)
    anon, shared = (huge_pages_problem(shared=s, root=root) for s in (False, True))
    assert (anon is None) == anon_ok and (shared is None) == shared_ok
    if not anon_ok:
        assert "enabled: never" in anon and "madvise or always" in anon
    elif not shared_ok:
        assert "shmem_enabled" in shared and "advise" in shared
    assert huge_page_size(root) == 2 << 20
    assert huge_page_size(tmp_path / "missing") == 2 << 20  # no setting: the x86-64 size


def test_huge_pages_are_for_elastic_memory_on_the_cpu():
    with pytest.raises(ConfigError, match="needs kv_memory elastic"):
        EngineConfig(kv_memory_huge_pages=True)
    with pytest.raises(ConfigError, match="for KV memory on the CPU"):
        EngineConfig(kv_memory="elastic", kv_memory_huge_pages=True, device="cuda")
    with pytest.raises(BackendError, match="driver's granules"):
        make_backend("cuda:0", huge_pages=True)


@needs_anon
def test_pages_are_whole_huge_pages_and_go_back_whole():
    b = make_backend("cpu", huge_pages=True)
    assert isinstance(b, MmapBackend) and b.granularity == HUGE
    b.reserve(8 * HUGE)
    try:
        b.map(2 * HUGE, 3 * HUGE)
        t = b.tensor(2 * HUGE, 3 * HUGE)
        t.fill_(5)
        assert b.resident_bytes() == 3 * HUGE
        assert b.resident_bytes("AnonHugePages") == 3 * HUGE
        b.unmap(3 * HUGE, HUGE)
        assert b.resident_bytes() == b.resident_bytes("AnonHugePages") == 2 * HUGE
        assert int(t[HUGE:2 * HUGE].sum()) == 0
        assert bool((t[:HUGE] == 5).all()) and bool((t[2 * HUGE:] == 5).all())
        del t
    finally:
        b.close()


@needs_shmem
def test_a_memory_file_in_huge_pages_is_released_by_another_holder():
    b = make_backend("cpu", shared=True, huge_pages=True)
    assert isinstance(b, SharedMmapBackend) and b.granularity == HUGE
    b.reserve(4 * HUGE)
    holes = FileHoles(b.memory_file(), b.granularity)
    try:
        b.map(0, 4 * HUGE)
        b.tensor(0, 4 * HUGE).fill_(1)
        assert b.resident_bytes("ShmemPmdMapped") + b.resident_bytes("FilePmdMapped") > 0
        holes.unmap(HUGE, 2 * HUGE)
        assert b.resident_bytes() == 2 * HUGE
    finally:
        holes.close()
        b.close()


@pytest.mark.skipif(ANON is not None or SHMEM is None,
                    reason="this host gives memory files huge pages (or gives none at all)")
def test_memory_files_without_huge_pages_are_a_clear_error():
    with pytest.raises(ConfigError, match="shmem_enabled"):
        make_backend("cpu", shared=True, huge_pages=True)


@pytest.mark.skipif(ANON is None, reason="this host gives huge pages")
def test_a_host_without_huge_pages_is_a_clear_error():
    with pytest.raises(ConfigError, match="transparent huge pages are off"):
        make_backend("cpu", huge_pages=True)


# -- in the engine ---------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 90)), [200, 3, 77, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
OPTIONS = dict(max_model_len=128, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("huge"), "llama", num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_LEDGER_DIR", str(tmp_path / "ledger"))


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@needs_anon
def test_the_engine_in_huge_pages_gives_plain_tokens_and_pages_back_whole(tiny):
    reference = _tokens(LLM(str(tiny), kv_cache_memory_bytes="4MiB", **OPTIONS))
    llm = LLM(str(tiny), kv_memory="elastic", kv_memory_huge_pages=True,
              kv_cache_memory_bytes="40MiB", engine_name="huge", **OPTIONS)
    engine = llm.engine
    try:
        storage = engine.kv_storage
        # 4 KV tensors of 4-KiB blocks: a page is 512 blocks, one huge page in each tensor
        assert storage.geometry.page_slot_bytes == HUGE
        assert engine.elastic.sizing.page_bytes == 4 * HUGE
        # the planner's figures (`kvmem plan --kv-memory-huge-pages`) are the engine's
        config = EngineConfig(model=str(tiny), kv_memory="elastic", kv_memory_huge_pages=True,
                              kv_cache_memory_bytes="40MiB", **OPTIONS)
        spec = load_spec(str(tiny))
        planned = plan_kv_cache(spec, config, device=torch.device("cpu"), kv_dtype="float32",
                                max_model_len=engine.max_model_len)
        assert plan_elastic(planned, spec, None, granularity=HUGE) == [engine.elastic.sizing]
        assert _tokens(llm) == reference
        storage.settle()
        mapped = storage.stats().mapped_bytes
        assert storage.backend.resident_bytes("AnonHugePages") == mapped > 0
        assert engine.kv_cache_manager.reset_prefix_cache()
        assert storage.give_back(mapped) > 0  # as when another engine asks
        after = storage.stats().mapped_bytes
        assert after < mapped
        assert storage.backend.resident_bytes() == after
    finally:
        engine.shutdown()


@pytest.mark.skipif(ANON is not None or SHMEM is None,
                    reason="this host gives memory files huge pages (or gives none at all)")
def test_tensor_parallel_huge_pages_need_them_for_memory_files(tiny):
    with pytest.raises(StartupError, match="rank 0 .*--kv-memory-huge-pages: .*shmem_enabled"):
        LLM(str(tiny), kv_memory="elastic", kv_memory_huge_pages=True,
            kv_cache_memory_bytes="40MiB", tensor_parallel_size=2, **OPTIONS)


@needs_shmem
def test_tensor_parallel_engine_in_huge_pages_gives_plain_tokens(tiny):
    """Rank 1 keeps its pages in a memory file of huge pages, which rank 0 releases."""
    reference = _tokens(LLM(str(tiny), kv_cache_memory_bytes="4MiB", **OPTIONS))
    llm = LLM(str(tiny), kv_memory="elastic", kv_memory_huge_pages=True,
              kv_cache_memory_bytes="40MiB", tensor_parallel_size=2, **OPTIONS)
    try:
        assert _tokens(llm) == reference
        storage = llm.engine.elastic.storage
        assert storage.geometry.page_slot_bytes % HUGE == 0
        assert llm.engine.kv_cache_manager.reset_prefix_cache()
        assert storage.give_back(storage.stats().mapped_bytes) > 0
    finally:
        llm.engine.shutdown()
