"""An explicit KV budget against estimated non-KV memory (the engine skips profiling):
refused only where the weights and the KV cache alone cannot fit, else a warning.

On an H100, `kvmem profile` of gemma-3-4b-it measured 9.98 GiB of non-KV memory and
suggested 65.24 GiB of KV at 0.95; the engine given those bytes refused them, because the
planner's vLLM-calibrated estimates put the non-KV memory at 17.7 GiB.
"""

from __future__ import annotations

import logging

import pytest

from kvmem.engine.rank_builder import check_rank_fit
from kvmem.plan import EngineSettings, FitError, Layout, plan
from kvmem.spec import load_spec
from kvmem.units import GiB

H100 = int(79.18 * GiB)


def gemma_plan(kv_gib: float):
    return plan(load_spec("google/gemma-3-4b-it"), Layout(gpu_memory_bytes=H100),
                EngineSettings(kv_cache_memory_bytes=int(kv_gib * GiB), max_model_len=8192,
                               max_num_seqs=256), suggest=False)


def test_the_profiles_suggestion_is_over_the_estimates():
    r = gemma_plan(65.24).ranks[0]
    assert r.over_committed and not r.fits  # the estimates alone would refuse it


def test_an_explicit_budget_past_the_estimates_warns_and_starts(caplog):
    p = gemma_plan(65.24)
    with pytest.raises(FitError, match="exceeds"):
        check_rank_fit(p, 0)  # measured (or not explicit): the plan's own verdict
    with caplog.at_level(logging.WARNING, logger="kvmem.engine"):
        check_rank_fit(p, 0, estimated=True)
    assert "explicit KV budget of 65.24 GiB leaves" in caplog.text
    assert "rank 0 (pp stage 0, tp rank 0)" in caplog.text


def test_weights_and_kv_past_the_device_are_refused_even_so():
    p = gemma_plan(74.0)  # 74 GiB of KV + the weights > 79.18 GiB
    with pytest.raises(FitError, match="exceeds"):
        check_rank_fit(p, 0, estimated=True)


def test_a_budget_too_small_for_max_model_len_is_refused_even_so():
    p = plan(load_spec("google/gemma-3-4b-it"), Layout(gpu_memory_bytes=H100),
             EngineSettings(kv_cache_memory_bytes=GiB // 64, max_model_len=131072),
             suggest=False)
    with pytest.raises(FitError):
        check_rank_fit(p, 0, estimated=True)
