"""MemoryProfile: the measured memory of one rank's device (weights, activations, runtime,
CUDA graphs) and the KV budget that is left, as a report, JSON and the planner's input.

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

A parallel engine's profile is one MemoryProfile per rank (``rank``, ``layers``, the
tensor x pipeline layout); ``save_profiles`` / ``load_profiles`` read and write one file
for all of them. This module does not import torch: ``kvmem plan --profile`` reads it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from math import ceil
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError
from kvmem.files import read_bounded
from kvmem.units import GiB, MiB

PROFILE_HEADROOM_BYTES = 150 * MiB
PROFILE_FORMAT = "kvmem-memory-profile/1"
RANK_PROFILES_FORMAT = "kvmem-memory-profiles/1"  # one MemoryProfile per rank


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
    # the rank measured: its layers (first, last; empty: the whole model) in its layout
    rank: int = 0
    layers: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

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
        return cls.from_dict(_read_json(path), f"profile {path}")


def _read_json(path: str | Path) -> Any:
    if not Path(path).exists():
        raise ConfigError(f"profile {path}: no such file")
    raw = read_bounded(path, "profile")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"profile {path}: cannot read it as JSON ({e})") from None


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _check_utilization(value: Any, source: str = "gpu_memory_utilization") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{source}: gpu_memory_utilization must be in (0, 1], got {value!r}")


def profiles_to_dict(profiles: list[MemoryProfile]) -> dict[str, Any]:
    """One rank's profile as is; several ranks' as one document, in rank order."""
    if len(profiles) == 1:
        return profiles[0].to_dict()
    first = profiles[0]
    return {"format": RANK_PROFILES_FORMAT, "tensor_parallel_size": first.tensor_parallel_size,
            "pipeline_parallel_size": first.pipeline_parallel_size,
            "ranks": [p.to_dict() for p in profiles]}


def save_profiles(profiles: list[MemoryProfile], path: str | Path) -> None:
    Path(path).write_text(json.dumps(profiles_to_dict(profiles), indent=1) + "\n")


def load_profiles(path: str | Path) -> list[MemoryProfile]:
    """Every rank's profile from a file ``kvmem profile --output`` wrote (one or many)."""
    source = f"profile {path}"
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != RANK_PROFILES_FORMAT:
        return [MemoryProfile.from_dict(data, source)]
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ConfigError(f"{source}: no ranks")
    profiles = [MemoryProfile.from_dict(r, f"{source} rank {i}") for i, r in enumerate(ranks)]
    world = profiles[0].tensor_parallel_size * profiles[0].pipeline_parallel_size
    if [p.rank for p in profiles] != list(range(world)):
        raise ConfigError(f"{source}: expected ranks 0..{world - 1} of tp "
                          f"{profiles[0].tensor_parallel_size} x pp "
                          f"{profiles[0].pipeline_parallel_size}, got "
                          f"{[p.rank for p in profiles]}")
    return profiles
