"""Measuring one rank's memory: what the weights, activations, runtime and CUDA graphs of
its model shard really take (``kvmem.engine.memory_profile.MemoryProfile``).

On a GPU the figures come from the CUDA caching allocator and the driver
(``torch.cuda.memory_stats`` / ``mem_get_info``); CUDA-graph memory is the device memory
that capturing the decode batch sizes takes. On CPU they come from the process's own
accounting: resident memory after start-up, parameter bytes, and the resident high-water
mark (``VmHWM``) over the dummy forward and the sampler; no CUDA graphs are captured.

Every rank of an engine is measured the same way, by ``kvmem.engine.rank_builder`` while
it starts (its shard: its stage's layers, its tensor-parallel slice);
``kvmem.engine.profile_ranks`` starts the ranks of a layout only to measure them. This
module imports torch only inside the measuring functions.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmem.engine.memory_profile import (  # noqa: F401 (re-exported)
    PROFILE_FORMAT,
    PROFILE_HEADROOM_BYTES,
    MemoryProfile,
)
from kvmem.errors import ConfigError


# ================================================================== measuring
class DeviceMeter:
    """Reads one device's memory. ``start()`` snapshots it before the model is loaded."""

    def __init__(self, device) -> None:
        self.device = device
        self.total_bytes = 0
        self.free_bytes_at_start = 0

    def start(self) -> None:
        raise NotImplementedError

    def weights_resident(self) -> int | None:
        return None

    def peak(self, fn: Callable[[], object]) -> int:
        """Memory ``fn`` needs at its peak above what was in use before it ran."""
        raise NotImplementedError

    def non_torch(self) -> int:
        raise NotImplementedError

    def growth(self, fn: Callable[[], object]) -> int:
        """Memory ``fn`` leaves allocated (CUDA-graph pools and executables)."""
        raise NotImplementedError


class CPUMeter(DeviceMeter):
    """Resident memory of this process, from /proc and psutil."""

    def start(self) -> None:
        import psutil

        memory = psutil.virtual_memory()
        self.total_bytes, self.free_bytes_at_start = memory.total, memory.available
        _release_free_heap()
        self.baseline_rss = _rss()
        self.loaded_rss: int | None = None

    def weights_resident(self) -> int | None:
        _release_free_heap()
        self.loaded_rss = _rss()
        return max(0, self.loaded_rss - self.baseline_rss)

    def peak(self, fn: Callable[[], object]) -> int:
        _release_free_heap()
        before = _rss()
        if _reset_high_water_mark():
            fn()
            top = _high_water_mark()
        else:  # /proc/self/clear_refs not writable: sample the resident size instead
            with _RSSSampler() as sampler:
                fn()
            top = sampler.peak
        return max(0, top - before)

    def non_torch(self) -> int:
        """The process's resident memory before any weights: interpreter, libraries,
        tokenizer (the CPU counterpart of a CUDA context)."""
        return self.baseline_rss

    def growth(self, fn: Callable[[], object]) -> int:
        raise ConfigError("CUDA graphs are captured on CUDA devices only")


class CUDAMeter(DeviceMeter):
    """The CUDA caching allocator's statistics and the driver's free/total memory."""

    def start(self) -> None:
        import torch

        torch.cuda.init()
        torch.cuda.synchronize(self.device)
        self.free_bytes_at_start, self.total_bytes = torch.cuda.mem_get_info(self.device)
        # device memory already in use outside torch: other processes and our CUDA context
        self.used_outside_torch_at_start = (self.total_bytes - self.free_bytes_at_start
                                            - torch.cuda.memory_reserved(self.device))

    def peak(self, fn: Callable[[], object]) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)

    def non_torch(self) -> int:
        """Device memory outside torch's allocator that appeared since start (cuBLAS and
        attention workspaces, communicator buffers)."""
        import torch

        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside = total - free - torch.cuda.memory_reserved(self.device)
        return max(0, outside - self.used_outside_torch_at_start)

    def growth(self, fn: Callable[[], object]) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        fn()
        torch.cuda.synchronize(self.device)
        # warm-up runs left cached blocks in the ordinary pool; graph pools stay mapped
        torch.cuda.empty_cache()
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])


def meter_for(device) -> DeviceMeter:
    return CUDAMeter(device) if device.type == "cuda" else CPUMeter(device)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _release_free_heap() -> None:
    """Return freed heap pages to the OS so that resident memory shows what is live."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: resident figures include freed heap
        pass


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current resident size (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _high_water_mark() > 0


def _high_water_mark() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _RSSSampler:
    """Polls the resident size on a thread while a block runs; ``peak`` is the largest seen."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> _RSSSampler:
        self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


# ================================================================== the profile run
@dataclass
class LoadedModel:
    """What profiling needs of an engine that has loaded its weights."""

    model: Any  # torch.nn.Module
    spec: Any  # kvmem.spec.ModelSpec
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    max_model_len: int
    name: str
    checkpoint: str | None = None
    rank_plan: Any = None  # kvmem.plan.RankPlan of a shard; None: the whole model
    rank: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


def measure_loaded(loaded: LoadedModel, config, meter: DeviceMeter) -> MemoryProfile:
    """Weights, peaks, non-torch and CUDA-graph memory of a model loaded after
    ``meter.start()``. Leaves no KV cache or graph behind."""
    profile = _measure(loaded, config, meter)
    gc.collect()  # the scratch cache and graph pool go back to the device for the KV cache
    if loaded.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return profile


def _measure(loaded: LoadedModel, config, meter: DeviceMeter) -> MemoryProfile:
    import torch

    from kvmem.engine.model_runner import ModelRunner
    from kvmem.engine.models.layers import weight_bytes
    from kvmem.engine.sampler import Sampler
    from kvmem.engine.sampling_params import SamplingParams

    model, spec, device = loaded.model, loaded.spec, loaded.device
    weights = weight_bytes(model)
    weights_resident = meter.weights_resident()
    rank_plan = loaded.rank_plan
    scratch = scratch_kv_caches(spec, config.block_size, loaded.dtype, device,
                                layers=rank_plan.layers if rank_plan else None,
                                kv_heads=rank_plan.kv_heads_on_rank if rank_plan else None)
    runner = ModelRunner(model, scratch, num_kv_groups=len(spec.kv_groups()),
                         block_size=config.block_size, device=device,
                         sampler=Sampler(config.seed))
    forward_peak = meter.peak(lambda: runner.profile_run(config.max_num_batched_tokens,
                                                         loaded.max_model_len))
    num_seqs = config.max_num_seqs
    hidden = torch.randn(num_seqs, spec.hidden_size, dtype=loaded.dtype, device=device)
    # top-k / top-p on every row: the sampler's most expensive path
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_seqs

    @torch.inference_mode()
    def sample() -> None:
        runner.sampler(model.compute_logits(hidden), params, [None] * num_seqs)

    last_stage = getattr(model, "is_last", True)  # only the last stage computes logits
    sampler_peak = meter.peak(sample) if last_stage else 0
    non_torch = meter.non_torch()
    notes = []
    graph_bytes, sizes = 0, []
    alone = loaded.tensor_parallel_size * loaded.pipeline_parallel_size == 1
    if device.type == "cuda" and alone and cuda_graphs_enabled(config, model):
        from kvmem.engine.cuda_graphs import CUDAGraphRunner, capture_sizes

        sizes = capture_sizes(config.max_num_seqs)
        graphs = CUDAGraphRunner(model, scratch, num_kv_groups=len(spec.kv_groups()),
                                 block_size=config.block_size,
                                 max_model_len=loaded.max_model_len, batch_sizes=sizes,
                                 device=device)
        graph_bytes = meter.growth(graphs.capture)
        graphs.release()
    elif device.type == "cuda" and not alone:
        notes.append("CUDA graphs are captured only by a world-size-1 engine")
    elif device.type == "cuda":
        notes.append("CUDA graphs off (--enforce-eager or an attention backend that cannot "
                     "be captured)")
    else:
        notes.append("CUDA graphs are not captured on CPU: their memory is absent, not "
                     "unmeasured")
    return MemoryProfile(
        model=loaded.name, device=str(device), total_bytes=meter.total_bytes,
        free_bytes_at_start=meter.free_bytes_at_start,
        gpu_memory_utilization=config.gpu_memory_utilization, weights_bytes=weights,
        forward_peak_bytes=forward_peak, sampler_peak_bytes=sampler_peak,
        non_torch_bytes=non_torch, cuda_graph_bytes=graph_bytes, cuda_graph_sizes=sizes,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=num_seqs,
        max_model_len=loaded.max_model_len, block_size=config.block_size,
        dtype=str(loaded.dtype).removeprefix("torch."), checkpoint=loaded.checkpoint,
        weights_resident_bytes=weights_resident, notes=notes, rank=loaded.rank,
        layers=[rank_plan.layers[0], rank_plan.layers[-1]] if rank_plan else [],
        tensor_parallel_size=loaded.tensor_parallel_size,
        pipeline_parallel_size=loaded.pipeline_parallel_size)


def cuda_graphs_enabled(config, model) -> bool:
    """Decode CUDA graphs run with the Triton backend (at the block sizes its kernels take;
    its fallback path reads the device from the host) unless the engine is eager."""
    if getattr(config, "enforce_eager", False):
        return False
    backends = {getattr(m, "backend", None) for m in model.modules()}
    names = {getattr(b, "name", None) for b in backends if b is not None}
    if names != {"triton"}:
        return False
    from kvmem.engine.attention.triton_backend import _supported_block_size

    return _supported_block_size(config.block_size)


def scratch_kv_caches(spec, block_size: int, dtype, device, *, layers=None,
                      kv_heads: int | None = None) -> list:
    """A two-block KV cache per layer (of ``layers``: a rank's, default all) for profiling:
    the forward writes no KV (slot -1) and reads only the null block, so its size does not
    change the measurement. ``kv_heads``: a tensor-parallel rank's share."""
    import torch

    caches = []
    for index in (layers if layers is not None else range(spec.num_layers)):
        layer = spec.layers[index]
        heads = kv_heads or layer.num_kv_heads or 1
        head_dim = layer.head_dim or 1
        caches.append(torch.zeros((2, 2, block_size, heads, head_dim), dtype=dtype,
                                  device=device))
    return caches
