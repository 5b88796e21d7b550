"""EngineConfig: every engine option in one place, shared by ``LLM``, the CLI and the server.

Each option (sizing, parallelism, offload tiers, elastic memory) is a field here and a flag
in ``add_engine_arguments``, so every entry point takes the same options with the same checks.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from kvmem.engine.sampling_params import SEED_MAX, SEED_MIN
from kvmem.errors import ConfigError
from kvmem.plan.partition import parse_partition
from kvmem.tiers.config import POLICIES as OFFLOAD_POLICIES
from kvmem.units import GiB, parse_size

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_BUDGET_POLICIES = ("uniform", "proportional", "optimal")  # as in kvmem.plan
KV_MEMORY_BACKENDS = ("plain", "elastic")
LOAD_FORMATS = ("auto", "dummy")  # as kvmem.engine.loader reads them
DISTRIBUTED_BACKENDS = ("auto", "nccl", "gloo")  # as kvmem.engine.distributed.config


@dataclass
class EngineConfig:
    """Options of one engine. ``model=None`` is the embedded SmolLM2 checkpoint."""

    model: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"  # "dummy": random weights, the checkpoint needs no weight files
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    # KV sizing: an explicit byte budget wins; else the GPU budget comes from profiling at
    # gpu_memory_utilization, and the CPU budget from cpu_kv_memory_bytes (default below).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_memory_bytes: int | None = None
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (GPU only)
    seed: int = 0
    # parallelism (kvmem.engine.distributed): per-rank KV budgets come from kvmem.plan's
    # kv_budget policy; kv_cache_memory_bytes is then each rank's share
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    layer_partition: list[int] | None = None  # layers per pipeline stage, e.g. [3, 1]
    kv_budget: str = "uniform"  # uniform | proportional | optimal
    distributed_timeout_s: float = 60.0  # bound of every wait between ranks in a step
    # process groups of a step's tensors: auto is NCCL on CUDA and gloo on CPU; gloo on
    # CUDA (host-staged) lets several ranks share one GPU, which NCCL refuses
    distributed_backend: str = "auto"
    # CPU and disk tiers for KV blocks leaving the pool (kvmem.tiers); 0 GiB turns a tier off
    cpu_offload_gib: float = 0.0
    disk_offload_dir: str | None = None
    disk_offload_gib: float = 0.0
    offload_policy: str = "lru"  # lru | seen-twice (admit a block on its second offer)
    offload_min_load_tokens: int = 0  # tier hits sparing fewer tokens are recomputed
    # where KV bytes live (kvmem.memory): plain preallocated tensors, or elastic pages mapped
    # on demand under a limit shared with other engines on the device (ledger)
    kv_memory: str = "plain"  # plain | elastic
    kv_memory_limit_bytes: int | None = None  # elastic ceiling: default the planned budget
    kv_memory_floor_bytes: int | None = None  # elastic floor: reserved for this engine
    # elastic on the CPU: pages of whole transparent huge pages (kvmem.memory.huge_pages)
    kv_memory_huge_pages: bool = False
    engine_name: str | None = None  # the engine's name in the ledger (default: model-pid)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ConfigError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], "
                              f"got {self.seed!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"unknown load format {self.load_format!r} "
                              f"(choose from {', '.join(LOAD_FORMATS)})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ConfigError(f"unknown device {self.device!r} (choose from {', '.join(DEVICES)})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_size(self.kv_cache_memory_bytes,
                                                    "kv_cache_memory_bytes")
        if self.cpu_kv_memory_bytes is not None:
            self.cpu_kv_memory_bytes = parse_size(self.cpu_kv_memory_bytes, "cpu_kv_memory_bytes")
        self._check_parallel()
        self._check_kv_memory()
        self.offload_config()  # one-line ConfigError for bad offload settings

    def _check_kv_memory(self) -> None:
        if self.kv_memory not in KV_MEMORY_BACKENDS:
            raise ConfigError(f"unknown kv_memory {self.kv_memory!r} "
                              f"(choose from {', '.join(KV_MEMORY_BACKENDS)})")
        for field_name in ("kv_memory_limit_bytes", "kv_memory_floor_bytes"):
            value = getattr(self, field_name)
            if value is None:
                continue
            if self.kv_memory != "elastic":
                raise ConfigError(f"{field_name} needs kv_memory elastic")
            setattr(self, field_name, parse_size(value, field_name))
        if self.kv_memory_huge_pages:
            if self.kv_memory != "elastic":
                raise ConfigError("kv_memory_huge_pages needs kv_memory elastic")
            if self.device.startswith("cuda"):
                raise ConfigError("kv_memory_huge_pages is for KV memory on the CPU; a GPU's "
                                  "pages are the driver's 2 MiB granules already")
        floor, ceiling = self.kv_memory_floor_bytes, self.kv_memory_limit_bytes
        if floor is not None and ceiling is not None and floor > ceiling:
            raise ConfigError(f"kv_memory_floor_bytes {floor} is above kv_memory_limit_bytes "
                              f"{ceiling}")
        if self.engine_name is not None:
            from kvmem.memory.ledger import check_engine_name

            check_engine_name(self.engine_name)

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_budget not in KV_BUDGET_POLICIES:
            raise ConfigError(f"unknown kv_budget {self.kv_budget!r} "
                              f"(choose from {', '.join(KV_BUDGET_POLICIES)})")
        if self.layer_partition is not None:
            parts = self.layer_partition
            if isinstance(parts, str):
                parts = parse_partition(parts, "layer_partition")
            self.layer_partition = list(parts)
            if len(parts) != self.pipeline_parallel_size:
                raise ConfigError(f"layer_partition {parts} has {len(parts)} stages but "
                                  f"pipeline_parallel_size is {self.pipeline_parallel_size}")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ConfigError(f"unknown distributed_backend {self.distributed_backend!r} "
                              f"(choose from {', '.join(DISTRIBUTED_BACKENDS)})")
        if self.distributed_backend == "nccl" and self.device == "cpu":
            raise ConfigError("distributed_backend nccl needs a CUDA device (use gloo on cpu)")
        if not self.distributed_timeout_s > 0:
            raise ConfigError("distributed_timeout_s must be positive, "
                              f"got {self.distributed_timeout_s}")

    def offload_config(self):
        """The offload tiers' settings (a ``kvmem.tiers.OffloadConfig``; not ``.enabled``:
        no tiers)."""
        from kvmem.tiers.config import OffloadConfig

        return OffloadConfig.from_gib(self.cpu_offload_gib, self.disk_offload_dir,
                                      self.disk_offload_gib, self.offload_policy,
                                      min_load_tokens=self.offload_min_load_tokens)

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def model_name(self) -> str:
        """The name clients use in API requests."""
        return self.served_model_name or self.model or "smollm2"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of the CLI's flags; its errors name the flags the user typed
        (``--kv-memory-limit``), not the fields (``kv_memory_limit_bytes``)."""
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in vars(args).items() if k in names})
        except ConfigError as exc:
            raise ConfigError(with_flag_names(str(exc))) from None


def with_flag_names(message: str) -> str:
    """``message`` with every EngineConfig field that has a flag named as that flag."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    flags = {a.dest: next(o for o in a.option_strings if o.startswith("--"))
             for a in parser._actions if a.option_strings}
    field = re.compile(r"\b(" + "|".join(sorted(flags, key=len, reverse=True)) + r")\b")
    return field.sub(lambda m: flags[m[1]], message)


def default_cpu_kv_memory_bytes() -> int:
    """1 GiB, or a quarter of the available RAM when that is smaller."""
    try:
        import psutil

        available = psutil.virtual_memory().available
    except ImportError:  # pragma: no cover - psutil is an engine dependency
        return GiB
    return max(64 << 20, min(GiB, available // 4))


def add_engine_arguments(p: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """The engine flags every ``kvmem`` engine command accepts."""
    d = EngineConfig()
    if model_positional:
        p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="checkpoint directory, .gguf file or 'smollm2' (default: embedded "
                            "SmolLM2-135M-Instruct)")
    g = p.add_argument_group("engine")
    g.add_argument("--served-model-name", default=None, help="model name used in the API")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    g.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS,
                   help="dummy: random weights from config.json alone (sizing, profiling "
                        "and speed runs without the weights)")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--attention-backend", default=d.attention_backend,
                   choices=("auto", "reference", "triton"))
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's limit)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (prefill chunks and decodes)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching, help="reuse KV of shared prompt prefixes")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype)
    g.add_argument("--kv-cache-memory-bytes", default=None, metavar="SIZE",
                   help="explicit KV budget per device, e.g. 2GiB (skips profiling)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of GPU memory the engine may use (weights + activations + KV)")
    g.add_argument("--cpu-kv-memory", dest="cpu_kv_memory_bytes", default=None, metavar="SIZE",
                   help="KV budget on CPU (default: 1GiB or a quarter of free RAM)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="capture no CUDA graphs for decode steps (GPU; saves their memory)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of unseeded requests' sampling")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                     help="ranks that split every layer (heads, MLP, vocabulary)")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int,
                     default=d.pipeline_parallel_size, help="pipeline stages (layer ranges)")
    par.add_argument("--layer-partition", default=None, metavar="N,N,...",
                     help="layers per pipeline stage, e.g. 20,10 (default: the KV budget "
                          "policy's partition, even unless --kv-budget optimal)")
    par.add_argument("--kv-budget", default=d.kv_budget, choices=KV_BUDGET_POLICIES,
                     help="how ranks' KV budgets are set (kvmem plan's policies)")
    par.add_argument("--distributed-timeout", dest="distributed_timeout_s", type=float,
                     default=d.distributed_timeout_s, metavar="SECONDS",
                     help="longest wait between ranks during a step")
    par.add_argument("--distributed-backend", default=d.distributed_backend,
                     choices=DISTRIBUTED_BACKENDS,
                     help="process groups of a step's tensors: auto is nccl on CUDA, gloo on "
                          "CPU; gloo on CUDA copies through host memory and lets several "
                          "ranks share one GPU (ranks beyond the GPU count wrap around)")
    mem = p.add_argument_group("KV memory")
    mem.add_argument("--kv-memory", default=d.kv_memory, choices=KV_MEMORY_BACKENDS,
                     help="plain: preallocated KV tensors; elastic: pages mapped on demand "
                          "under a limit shared with other engines on the device")
    mem.add_argument("--kv-memory-limit", "--kv-memory-max", dest="kv_memory_limit_bytes",
                     default=None, metavar="SIZE",
                     help="elastic: this engine's ceiling, the most KV memory it maps at "
                          "once, e.g. 4GiB, on rank 0's GPU, or on the CPU every rank's "
                          "together (default: the planned KV budget)")
    mem.add_argument("--kv-memory-min", dest="kv_memory_floor_bytes", default=None,
                     metavar="SIZE", help="elastic: this engine's floor, reserved for it "
                                          "whatever other engines on the device do")
    mem.add_argument("--kv-memory-huge-pages", action="store_true",
                     help="elastic on the CPU: map KV pages as whole transparent huge pages, "
                          "which the kernel gives back to other engines over ten times "
                          "faster; each page is then at least 2 MiB in every KV tensor")
    mem.add_argument("--engine-name", default=None,
                     help="this engine's name in `kvmem top` / `kvmem limit` "
                          "(default: served model name + pid)")
    off = p.add_argument_group("KV offloading (CPU and disk tiers)")
    off.add_argument("--cpu-offload-gib", type=float, default=d.cpu_offload_gib, metavar="GiB",
                     help="host memory for KV blocks leaving the pool (default 0: off)")
    off.add_argument("--disk-offload-dir", default=None, metavar="DIR",
                     help="directory for KV blocks on disk (needs --disk-offload-gib)")
    off.add_argument("--disk-offload-gib", type=float, default=d.disk_offload_gib,
                     metavar="GiB", help="disk budget for KV blocks (default 0: off)")
    off.add_argument("--offload-policy", default=d.offload_policy,
                     choices=OFFLOAD_POLICIES,
                     help="tier admission: lru stores every block; seen-twice stores a block "
                          "on its second offer (default lru)")
    off.add_argument("--offload-min-load-tokens", type=int, default=d.offload_min_load_tokens,
                     metavar="N", help="recompute a prompt's prefix instead of loading it "
                     "from a tier when the load would spare fewer than N tokens: the "
                     "break-even length where a prefill is faster than the copy, e.g. on a "
                     "fast GPU (default 0: every tier hit loads)")
