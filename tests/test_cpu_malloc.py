"""A CPU engine process fixes glibc's malloc thresholds, unless told not to."""

import ctypes
import platform

import pytest

from kvmem.engine import cpu_malloc


class FakeLibc:
    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result
        outer = self

        class Mallopt:
            argtypes = restype = None

            def __call__(self, option: int, value: int) -> int:
                outer.calls.append((option, value))
                return outer.result

        self.mallopt = Mallopt()


@pytest.fixture(autouse=True)
def fresh():
    cpu_malloc.keep_freed_memory.cache_clear()
    yield
    cpu_malloc.keep_freed_memory.cache_clear()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="not glibc")
def test_sets_both_thresholds_once(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    monkeypatch.delenv("KVMEM_CPU_MALLOC", raising=False)
    assert cpu_malloc.keep_freed_memory() and cpu_malloc.keep_freed_memory()
    assert libc.calls == [(cpu_malloc.M_MMAP_THRESHOLD, 32 << 20),
                          (cpu_malloc.M_TRIM_THRESHOLD, 1 << 30)]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="not glibc")
def test_a_refusal_is_reported_and_the_real_call_works(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc(result=0))
    assert not cpu_malloc.keep_freed_memory()
    monkeypatch.undo()
    cpu_malloc.keep_freed_memory.cache_clear()
    assert cpu_malloc.keep_freed_memory()  # this process's own glibc takes the values


def test_opt_out_leaves_malloc_alone(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    monkeypatch.setenv("KVMEM_CPU_MALLOC", "default")
    assert not cpu_malloc.keep_freed_memory()
    assert libc.calls == []


def test_a_cpu_engine_sets_it_when_it_starts(tmp_path, monkeypatch):
    from tiny_models import make_tiny_checkpoint

    from kvmem.engine.llm import LLM

    calls = []
    monkeypatch.setattr(cpu_malloc, "keep_freed_memory", lambda: calls.append(1) or True)
    tiny = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2)
    LLM(str(tiny), kv_cache_memory_bytes="4MiB", max_model_len=128, max_num_batched_tokens=32)
    assert calls == [1]
