"""Measured memory profile of one device: what the weights, activations, runtime and CUDA
graphs really take, and the KV budget that is left.

>>> profile = profile_memory(EngineConfig(model=None, max_num_batched_tokens=512))
>>> profile.suggested_kv_bytes_fit, profile.suggested_kv_bytes_whole
>>> profile.save("profile.json")  # `kvmem plan MODEL --profile profile.json` reads it

On a GPU the figures come from the CUDA caching allocator and the driver
(``torch.cuda.memory_stats`` / ``mem_get_info``); CUDA-graph memory is the device memory
that capturing the decode batch sizes takes. On CPU they come from the process's own
accounting: resident memory after start-up, parameter bytes, and the resident high-water
mark (``VmHWM``) over the dummy forward and the sampler; no CUDA graphs are captured.

The suggestions follow the arithmetic of vLLM's start-up report:

    requested = ceil(total x gpu_memory_utilization)
    non_kv    = weights + peak activation + non-torch + CUDA graphs
    fit       = requested - non_kv - headroom
    whole     = free at start - non_kv - headroom

``whole`` starts from the memory free when the process started, not the device total: what
other processes (and this process's CUDA context) held then is not the engine's to use.
``headroom`` (150 MiB) absorbs what a profiling step cannot see (allocator fragmentation,
kernels' workspaces). ``fit`` is the one definition of a profiled device's KV budget: the
engine sizing its KV cache from a measured profile and ``kvmem plan --profile`` get the
same value, because ``to_rank_profile`` hands the planner the headroom with non-torch.
This module imports torch only inside the measuring functions, so
``kvmem plan --profile`` can read a saved profile without it.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from math import ceil
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.units import GiB, MiB

PROFILE_HEADROOM_BYTES = 150 * MiB
PROFILE_FORMAT = "kvmem-memory-profile/1"


@dataclass
class MemoryProfile:
    """Every measured figure of one device (bytes), and the KV budgets they leave."""

    model: str
    device: str  # "cpu", "cuda:0"
    total_bytes: int  # device memory (on CPU: the machine's RAM)
    free_bytes_at_start: int  # free when the engine started (on CPU: available RAM)
    gpu_memory_utilization: float
    weights_bytes: int
    forward_peak_bytes: int  # dummy forward of max_num_batched_tokens tokens
    sampler_peak_bytes: int  # logits and sampling of max_num_seqs rows
    non_torch_bytes: int  # on GPU: CUDA context growth, communicators; on CPU: runtime RSS
    cuda_graph_bytes: int  # 0 when none were captured
    cuda_graph_sizes: list[int] = field(default_factory=list)  # decode batch sizes captured
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 0
    block_size: int = 16
    dtype: str = "float32"  # model and KV dtype the engine uses
    checkpoint: str | None = None  # the checkpoint directory (a `kvmem plan` MODEL)
    headroom_bytes: int = PROFILE_HEADROOM_BYTES
    weights_resident_bytes: int | None = None  # CPU: resident-memory growth while loading
    notes: list[str] = field(default_factory=list)

    # -------------------------------------------------------------- the report arithmetic
    @property
    def activation_bytes(self) -> int:
        """Peak activation: the larger of the forward and the sampler peaks."""
        return max(self.forward_peak_bytes, self.sampler_peak_bytes)

    @property
    def requested_bytes(self) -> int:
        """What gpu_memory_utilization grants (the planner's per-rank budget)."""
        return ceil(self.total_bytes * self.gpu_memory_utilization)

    @property
    def non_kv_bytes(self) -> int:
        return (self.weights_bytes + self.activation_bytes + self.non_torch_bytes
                + self.cuda_graph_bytes)

    @property
    def suggested_kv_bytes_fit(self) -> int:
        """kv_cache_memory_bytes that keeps the engine within gpu_memory_utilization."""
        return max(0, self.requested_bytes - self.non_kv_bytes - self.headroom_bytes)

    @property
    def suggested_kv_bytes_whole(self) -> int:
        """kv_cache_memory_bytes that uses all the memory free at start."""
        return max(0, self.free_bytes_at_start - self.non_kv_bytes - self.headroom_bytes)

    @property
    def graphs_captured(self) -> bool:
        return bool(self.cuda_graph_sizes)

    def with_utilization(self, gpu_memory_utilization: float) -> MemoryProfile:
        """The same measurements judged against another utilisation."""
        _check_utilization(gpu_memory_utilization)
        return MemoryProfile(**{**self._fields(), "gpu_memory_utilization":
                                gpu_memory_utilization})

    def to_rank_profile(self):
        """The planner's view (kvmem.plan.RankProfile): measured figures replace estimates.

        The headroom travels as part of the non-torch figure (the planner has no headroom
        of its own), so the planner's KV capacity of this device, and hence the budget of
        an engine sized from this profile and of ``kvmem plan --profile``, is exactly
        ``suggested_kv_bytes_fit``.
        """
        from kvmem.plan import RankProfile

        return RankProfile(weights_bytes=self.weights_bytes,
                           activation_bytes=self.activation_bytes,
                           non_torch_bytes=self.non_torch_bytes + self.headroom_bytes,
                           cuda_graph_bytes=self.cuda_graph_bytes, total_bytes=self.total_bytes)

    def summary(self) -> str:
        """The one-paragraph report, in the words of vLLM's start-up log."""
        g = _gib
        graphs = (f"CUDA graphs {g(self.cuda_graph_bytes)} GiB"
                  f" ({len(self.cuda_graph_sizes)} batch sizes)" if self.graphs_captured
                  else "CUDA graphs not captured"
                  + (" (CPU)" if self.device == "cpu" else " (eager)"))
        where = "the whole machine" if self.device == "cpu" else "the whole GPU"
        return (f"{self.model} on {self.device}: free {g(self.free_bytes_at_start)} of "
                f"{g(self.total_bytes)} GiB; utilisation {self.gpu_memory_utilization:g} requests "
                f"{g(self.requested_bytes)} GiB; weights {g(self.weights_bytes)} GiB, peak "
                f"activation {g(self.activation_bytes)} GiB, non-torch "
                f"{g(self.non_torch_bytes)} GiB, {graphs}; headroom "
                f"{g(self.headroom_bytes)} GiB; suggested KV budget "
                f"{self.suggested_kv_bytes_fit:,} bytes to fit the request, or "
                f"{self.suggested_kv_bytes_whole:,} bytes to use {where}."
                + self._overcommit_warning())

    def _overcommit_warning(self) -> str:
        """Other processes (or, on CPU, the rest of the system) hold memory: the utilisation
        then requests more than was free, and the fit value would not fit."""
        if self.suggested_kv_bytes_fit <= self.suggested_kv_bytes_whole:
            return ""
        return (f" Warning: utilisation {self.gpu_memory_utilization:g} requests "
                f"{_gib(self.requested_bytes)} GiB but only {_gib(self.free_bytes_at_start)} GiB "
                "was free at start, so the fit value would not fit: use the whole value or a "
                "lower --gpu-memory-utilization.")

    # -------------------------------------------------------------- JSON
    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PROFILE_FORMAT, **asdict(self)}
        out["derived"] = {
            "activation_bytes": self.activation_bytes, "requested_bytes": self.requested_bytes,
            "non_kv_bytes": self.non_kv_bytes,
            "suggested_kv_bytes_fit": self.suggested_kv_bytes_fit,
            "suggested_kv_bytes_whole": self.suggested_kv_bytes_whole,
        }
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> MemoryProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ConfigError(f"{source}: not a kvmem memory profile (written by "
                              "`kvmem profile --output FILE.json`)")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        try:
            profile = cls(**values)
        except TypeError as e:
            raise ConfigError(f"{source}: incomplete memory profile ({e})") from None
        for name in ("total_bytes", "free_bytes_at_start", "weights_bytes", "forward_peak_bytes",
                     "sampler_peak_bytes", "non_torch_bytes", "cuda_graph_bytes",
                     "headroom_bytes"):
            value = getattr(profile, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{source}: {name} must be a non-negative integer, "
                                  f"got {value!r}")
        if profile.total_bytes == 0:
            raise ConfigError(f"{source}: total_bytes must be positive")
        _check_utilization(profile.gpu_memory_utilization, source)
        return profile

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MemoryProfile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"profile {path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"profile {path}: cannot read it as JSON ({e})") from None
        return cls.from_dict(data, f"profile {path}")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _check_utilization(value: Any, source: str = "gpu_memory_utilization") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{source}: gpu_memory_utilization must be in (0, 1], got {value!r}")


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


def check_profilable(config) -> None:
    """Refuse, with one line naming what to do instead, the settings a profile of one
    process cannot measure or that it would silently ignore."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ConfigError(
            f"kvmem profile measures one process holding the whole model; it cannot profile "
            f"the ranks of -tp {config.tensor_parallel_size} -pp "
            f"{config.pipeline_parallel_size} (its figures would be wrong for a rank): size "
            f"the ranks with `kvmem plan`'s estimates or an explicit --kv-cache-memory-bytes")
    if config.kv_cache_memory_bytes is not None:
        raise ConfigError("kvmem profile measures what is left for the KV cache; "
                          "--kv-cache-memory-bytes would only be ignored: drop it")
    if config.kv_memory != "plain":
        raise ConfigError(f"kvmem profile does not measure --kv-memory {config.kv_memory}: "
                          f"profile without it and pass the suggested budget to the engine "
                          f"that uses it")
    if config.cpu_offload_gib or config.disk_offload_dir or config.disk_offload_gib:
        raise ConfigError("kvmem profile does not measure the KV offload tiers (host memory "
                          "and disk, not device memory): profile without --cpu-offload-gib "
                          "and --disk-offload-*")


def profile_memory(config) -> MemoryProfile:
    """Load ``config``'s model and measure its memory on the engine's device (see module doc).

    Raises ConfigError for settings a one-process profile cannot measure (``check_profilable``).
    """
    check_profilable(config)
    from kvmem.engine.llm_engine import LLMEngine, resolve_device, resolve_dtype
    from kvmem.engine.loader import resolve_model
    from kvmem.engine.models import build_model
    from kvmem.spec import spec_from_config

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    files = resolve_model(config.model)
    files.tokenizer  # noqa: B018 (part of the runtime a server holds, so measured at start)
    spec = spec_from_config(files.config, files.name)
    max_model_len = LLMEngine.max_model_len_for(spec, config)
    meter = meter_for(device)
    meter.start()
    model = build_model(files.config, dtype=dtype, device=device,
                        attention_backend=config.attention_backend)
    model.load_weights(files.weights())
    loaded = LoadedModel(model, spec, device, dtype, max_model_len,
                         config.served_model_name or files.name, str(files.path))
    return measure_loaded(loaded, config, meter)


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
    from kvmem.engine.sampler import Sampler
    from kvmem.engine.sampling_params import SamplingParams

    model, spec, device = loaded.model, loaded.spec, loaded.device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights_resident = meter.weights_resident()
    scratch = scratch_kv_caches(spec, config.block_size, loaded.dtype, device)
    runner = ModelRunner(model, scratch, None, num_kv_groups=len(spec.kv_groups()),
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

    sampler_peak = meter.peak(sample)
    non_torch = meter.non_torch()
    notes = []
    graph_bytes, sizes = 0, []
    if device.type == "cuda" and cuda_graphs_enabled(config, model):
        from kvmem.engine.cuda_graphs import CUDAGraphRunner, capture_sizes

        sizes = capture_sizes(config.max_num_seqs)
        graphs = CUDAGraphRunner(model, scratch, num_kv_groups=len(spec.kv_groups()),
                                 block_size=config.block_size,
                                 max_model_len=loaded.max_model_len, batch_sizes=sizes,
                                 device=device)
        graph_bytes = meter.growth(graphs.capture)
        graphs.release()
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
        weights_resident_bytes=weights_resident, notes=notes)


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


def scratch_kv_caches(spec, block_size: int, dtype, device) -> list:
    """A two-block KV cache per layer for profiling: the forward writes no KV (slot -1) and
    reads only the null block, so its size does not change the measurement."""
    import torch

    caches = []
    for layer in spec.layers:
        heads = layer.num_kv_heads or 1
        head_dim = layer.head_dim or 1
        caches.append(torch.zeros((2, 2, block_size, heads, head_dim), dtype=dtype,
                                  device=device))
    return caches
