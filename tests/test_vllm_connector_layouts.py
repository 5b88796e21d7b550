"""``KvmemConnector``'s worker side over every KV cache layout vLLM allocates, byte for byte.

vLLM 0.32 views each attention layer's KV as ``[B, H, N, C]`` in one shared allocation,
laid out by the resolved ``KVCacheLayout`` (layer-outer ``LBHNC``, ``LBNHC``, ``LHBNC``;
cross-layer ``BLHNC``, ``BLNHC``, ``BHLNC``), KV cache groups overlaying the same bytes, and
manager blocks possibly split into kernel blocks. For each layout and each model shape
(full attention, a hybrid of full and sliding-window groups, MLA latents in bf16, kernel
blocks of half a block), the allocation comes from vLLM's own ``get_kv_cache_config_from_groups``
and ``allocate_kv_cache`` on the CPU, and the worker side stores three blocks in its CPU
tier and loads them into three others: every byte of every layer's view must then equal
what was stored, and nothing else may change.

The same round trip runs on CUDA tensors (``cuda`` marker) through ``build_views``, a
torch-only construction of the same layouts that the vLLM script checks against vLLM's
allocation first.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from tests.kv_layouts import ORDERS, Holder, build_views, round_trip
from tests.vllm_cpu import run_script

SCRIPT = r"""
import sys
from types import SimpleNamespace as NS

import torch
from vllm.config.attention import AttentionConfig
from vllm.config.cache import CacheConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvmem.integrations.vllm.connector.layout import WorkerKVLayout
from kvmem.tiers import OffloadConfig, OffloadManager
from tests.kv_layouts import ORDERS, Holder, build_views, round_trip

B = 12  # blocks
def full(n, dtype=torch.float32):
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=dtype)

CASES = {
    "full": ([KVCacheGroupSpec(["a0", "a1", "a2"], full(3))], None),
    "hybrid": ([KVCacheGroupSpec(["f0", "f1"], full(2)),
                KVCacheGroupSpec(["s0", "s1"], SlidingWindowSpec(
                    block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32,
                    sliding_window=32)),
                KVCacheGroupSpec(["t0", "t1"], SlidingWindowSpec(
                    block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32,
                    sliding_window=32))], None),
    "mla-bf16": ([KVCacheGroupSpec(["m0", "m1"], MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=24, dtype=torch.bfloat16))], None),
    "kernel-blocks": ([KVCacheGroupSpec(["k0", "k1"], full(2))], [8]),
}
checked = []
for name, order in ORDERS.items():
    layout = KVCacheLayout[name]
    for case, (groups, kernel) in CASES.items():
        cache = CacheConfig()
        cache.kv_cache_layout = name
        config = NS(cache_config=cache, attention_config=AttentionConfig())
        spec = groups[0].kv_cache_spec
        page = spec.page_size_bytes
        try:
            kv_config = get_kv_cache_config_from_groups(
                config, groups, B * page * max(len(g.layer_names) for g in groups))
            kv = allocate_kv_cache(kv_config, torch.device("cpu"), layout, kernel)
        except (AssertionError, ValueError) as exc:  # a layout vLLM itself refuses
            print(f"vLLM refuses {name} for {case}: {str(exc).splitlines()[0]}")
            continue
        kv_config.kv_cache_layout = name
        assert kv_config.num_blocks == B, (name, case, kv_config.num_blocks)
        # the torch-only construction the CUDA test uses gives vLLM's own views
        split = 1 if kernel is None else 16 // kernel[0]
        heads, content = spec.num_kv_heads, page // (16 * spec.num_kv_heads *
                                                      spec.dtype.itemsize)
        built = build_views(order, [(g.layer_names, heads, 16, content) for g in groups], B,
                            spec.dtype, "cpu", split)
        base = next(iter(kv.values())).untyped_storage().data_ptr()
        for layer, view in kv.items():
            twin = built[layer]
            assert (view.shape, view.stride(), view.data_ptr() - base) == (
                twin.shape, twin.stride(),
                twin.data_ptr() - twin.untyped_storage().data_ptr()), (name, case, layer)
        slots = WorkerKVLayout(kv, kv_config)
        offload = OffloadManager(OffloadConfig(cpu_bytes=1 << 22), slots, slots.num_slots,
                                 Holder(), model="m", layout=slots.describe())
        round_trip(kv, slots, offload)
        offload.shutdown()
        checked.append(f"{name}/{case}")
print("LAYOUTS OK", len(checked), " ".join(checked))
"""


@pytest.mark.vllm
def test_every_layout_round_trips_byte_for_byte_on_vllms_allocation() -> None:
    out = run_script(SCRIPT, timeout=300).check().stdout
    line = next(x for x in out.splitlines() if x.startswith("LAYOUTS OK"))
    done = set(line.split()[3:])
    # every layout with plain and MLA attention; the hybrid and kernel-block cases where
    # vLLM accepts the layout for them
    for order in ORDERS:
        assert {f"{order}/full", f"{order}/mla-bf16"} <= done, (order, out)
    assert len(done) >= 18, out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_round_trips_on_cuda(order, dtype) -> None:
    """The copies on a side CUDA stream into pinned host rows, and back."""
    from kvmem.integrations.vllm.connector.layout import WorkerKVLayout
    from kvmem.tiers import OffloadConfig, OffloadManager

    class FullAttentionSpec:  # vLLM's spec classes, as the layout reads them
        block_size = 16

    class SlidingWindowSpec(FullAttentionSpec):
        sliding_window = 32

    groups = [(["f0", "f1"], 2, 16, 16), (["s0", "s1"], 2, 16, 16)]
    kv = build_views(ORDERS[order], groups, 12, dtype, "cuda")
    config = NS(num_blocks=12, kv_cache_layout=order, kv_cache_groups=[
        NS(layer_names=groups[0][0], kv_cache_spec=FullAttentionSpec()),
        NS(layer_names=groups[1][0], kv_cache_spec=SlidingWindowSpec())])
    layout = WorkerKVLayout(kv, config)
    assert [r.kind for r in layout.rules] == ["full", "sliding"]
    offload = OffloadManager(OffloadConfig(cpu_bytes=1 << 22), layout, layout.num_slots,
                             Holder(), model="m", layout=layout.describe())
    assert offload.copier.on_cuda
    round_trip(kv, layout, offload)
    offload.shutdown()
