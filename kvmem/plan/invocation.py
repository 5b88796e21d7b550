"""A plan as ``kvmem plan``'s flags ask for it: the flags, what they mean, and the plan.

``add_arguments`` defines the flags; ``build`` turns parsed flags into a ``PlanRun``: the
plan (``kvmem.plan.plan``, the function the engine sizes itself with), the command for an
engine, what the offload tiers (``kvmem.tiers``) hold with ``--cpu-offload-gib`` /
``--disk-offload-gib``, and the elastic sizing with ``--kv-memory elastic``. The command
line (``kvmem.cli.plan``) prints it; the page (``kvmem.ui``) shows it. Weight offload
(vLLM's ``--cpu-offload-gb``) is ``--weight-offload-gib``. Imports no torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvmem.errors import ConfigError
from kvmem.integrations.vllm.elastic.config import HUGE_ENV as VLLM_HUGE_ENV
from kvmem.integrations.vllm.elastic.config import LIMIT_ENV as VLLM_LIMIT_ENV
from kvmem.integrations.vllm.elastic.config import MODE_ENV as VLLM_MODE_ENV
from kvmem.memory.sizing import VllmElasticSizing
from kvmem.plan.flags import EngineCommand
from kvmem.plan.types import Plan

_EPILOG = """\
examples:
  kvmem plan Qwen/Qwen3-32B --pp 2 --layer-partition 56,8 --kv-cache-dtype fp8 \\
      --kv-cache-memory-bytes 5GiB --max-model-len 40960 --kv-budget proportional
  kvmem plan qwen3-14b --pp 2 --gpu V100-16GB,V100-32GB --kv-budget optimal --engine vllm
  kvmem plan ./my-model-dir --tp 2 --gpu H100 --json
  kvmem plan --from-vllm-log vllm-startup.log        (the logged model from the catalog)
  vllm serve ... 2>&1 | kvmem plan --from-vllm-log - ./my-model-dir

MODEL is a catalog name (see `kvmem models`), a config.json, or a model directory (with
*.safetensors files there, weights are read exactly from their headers).
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _EPILOG
    p.set_defaults(check_disk_dir=True)  # --disk-offload-dir is on this machine
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="catalog name, config.json or model directory (with --from-vllm-log: "
                        "the logged model's, when kvmem's catalog lacks it)")
    p.add_argument("--from-vllm-log", metavar="FILE",
                   help="a vLLM start-up log (- for standard input): what vLLM logged beside "
                        "kvmem's plan of that deployment, per rank, and what would do better")
    g = p.add_argument_group("layout")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_positive_int, default=1,
                   metavar="N", help="tensor-parallel size (default 1)")
    g.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=_positive_int,
                   default=1, metavar="N", help="pipeline-parallel size (default 1)")
    g.add_argument("--layer-partition", metavar="N,N,...",
                   help="layers per pipeline stage, e.g. 56,8 (default: even split as vLLM)")
    g.add_argument("--gpu", action="append", metavar="NAME",
                   help="GPU of each rank by name (repeat or comma list, one per rank or one "
                        "for all), e.g. H100, A100-40GB, L40S, V100-16GB")
    g.add_argument("--gpu-memory", metavar="GiB",
                   help="total GPU memory in GiB (one, or a comma list per rank)")
    g.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: a deployment on vLLM's CPU build, with its defaults (block size "
                        "128, 16 for MLA; max_num_batched_tokens 2,048 and max_num_seqs 128 "
                        "per rank, as `vllm serve` picks; no CUDA graphs); needs "
                        "--kv-cache-memory-bytes (default gpu)")
    e = p.add_argument_group("engine settings")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of total GPU memory the engine may use (default 0.9)")
    e.add_argument("--kv-cache-memory-bytes", metavar="SIZE",
                   help="most KV bytes any GPU may get, e.g. 5GiB, 512MiB or plain bytes; "
                        "skips estimates")
    e.add_argument("--kv-budget", default="uniform",
                   choices=("uniform", "proportional", "optimal"),
                   help="uniform: same budget on every rank (as vLLM); proportional: the "
                        "stated budget (else the GPUs' pooled memory) split over the pipeline "
                        "stages by their KV bytes; optimal: best partition and budgets within "
                        "each GPU's memory and the stated budget (default uniform)")
    e.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="auto (model dtype), bf16, fp16, fp32, fp8, fp8_e4m3, fp8_e5m2")
    e.add_argument("--block-size", type=int, metavar="N",
                   help="tokens per KV block (default 16; 128 with --device cpu)")
    e.add_argument("--max-model-len", type=int, metavar="N",
                   help="longest request in tokens (default: the model's context length)")
    e.add_argument("--max-num-seqs", type=int, metavar="N",
                   help="most requests running at once (default: vLLM's for the GPU, 1024 "
                        "from 70 GiB except A100s, else 256; in vLLM at most "
                        "--max-num-batched-tokens, as vLLM lowers its default)")
    e.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="tokens per scheduler step (default: vLLM's for the GPU, 16384 from "
                        "160 GiB, 8192 from 70 GiB except A100s, else 2048)")
    e.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs")
    e.add_argument("--reserve-cuda-graphs", action="store_true",
                   help="subtract the CUDA-graph estimate from the KV budget, as vLLM >= 0.21 "
                        "does (default: graphs use the utilisation's headroom)")
    e.add_argument("--weight-offload-gib", type=float, default=0.0, metavar="GiB",
                   help="weight GiB per GPU kept in CPU memory (vLLM's --cpu-offload-gb; "
                        "default 0)")
    e.add_argument("--vllm-version", metavar="X.Y",
                   help="size the KV cache by this vLLM release's rules (0.9 to 0.33: its "
                        "groups, per-request charges, fit check and logged figures); "
                        "default 0.33, or kvmem's own engine with --engine kvmem")
    e.add_argument("--max-concurrent-batches", type=_positive_int, metavar="N",
                   help="vLLM >= 0.26: batches in flight that sliding-window and chunked "
                        "charges count (default: vLLM's, 2 with async scheduling on GPUs at "
                        "pp 1, else pp)")
    e.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="vLLM: charge sliding-window and chunked layers as full attention, "
                        "as vLLM's flag of that name does")
    e.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefix caching off; a Mamba or Gated DeltaNet layer then holds "
                        "one state page per request, not two or three (vLLM's "
                        "mamba_cache_mode none, not align; kvmem's engine: one, not two)")
    for name, what in (("--mamba-cache-dtype", "linear-attention conv state"),
                       ("--mamba-ssm-cache-dtype", "linear-attention temporal (SSM) state")):
        e.add_argument(name, choices=("auto", "float32", "bfloat16", "float16"),
                       default="auto", help=f"vLLM: the {what}'s dtype (default auto: the "
                                            "model's, or its family's)")
    e.add_argument("--use-replayssm", action="store_true",
                   help="vLLM's ReplaySSM Mamba2 decode (0.32 and 0.33, Nemotron-H): each "
                        "Mamba2 state keeps a ring of its last inputs")
    e.add_argument("--replayssm-buffer-len", type=int, default=16, metavar="N",
                   help="vLLM: the ReplaySSM ring's length (default 16)")
    e.add_argument("--mamba-backend", choices=("triton", "flashinfer"), default="triton",
                   help="vLLM's Mamba backend (default triton); FlashInfer's ReplaySSM ring "
                        "holds one verify window more")
    e.add_argument("--attention-backend", metavar="NAME",
                   help="vLLM's attention backend on a GPU (0.32 and later; e.g. FLASHMLA, "
                        "CUTLASS_MLA, FLASHINFER): its kernels decide the block size; "
                        "default: the one vLLM picks for the GPU (--gpu)")
    e.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's speculative decoding config, e.g. '{\"method\": \"mtp\", "
                        "\"num_speculative_tokens\": 2}' or an EAGLE draft's \"model\": the "
                        "draft's KV layers join the plan's")
    e.add_argument("--profile", metavar="FILE.json",
                   help="measured memory from `kvmem profile --output`: its weights, activation, "
                        "non-torch, CUDA-graph and total memory replace the estimates")
    k = p.add_argument_group("KV offload tiers (kvmem serve)")
    k.add_argument("--cpu-offload-gib", type=float, default=0.0, metavar="GiB",
                   help="host memory for KV blocks leaving the GPU pool (default 0)")
    k.add_argument("--disk-offload-dir", metavar="DIR",
                   help="directory for KV blocks on disk (with --disk-offload-gib)")
    k.add_argument("--disk-offload-gib", type=float, default=0.0, metavar="GiB",
                   help="disk budget for KV blocks (default 0)")
    k.add_argument("--offload-policy", default="lru", choices=("lru", "seen-twice"),
                   help="tier admission policy (default lru)")
    m = p.add_argument_group("KV memory")
    m.add_argument("--kv-memory", default="plain", choices=("plain", "elastic"),
                   help="elastic: also show the virtual reservation and the memory limit")
    m.add_argument("--kv-memory-limit", metavar="SIZE",
                   help="elastic: most KV memory mapped at once (default: the KV budget)")
    m.add_argument("--kv-memory-huge-pages", action="store_true",
                   help="elastic on the CPU: pages of whole transparent huge pages")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    o.add_argument("--engine", choices=("vllm", "sglang", "kvmem"),
                   help="also print the exact command and environment for this engine")
    o.add_argument("--plot", metavar="FILE.png",
                   help="save each rank's memory as a stacked bar chart (needs matplotlib)")
    o.add_argument("--check", action="store_true",
                   help="exit 2 with the per-rank message when max_model_len does not fit")


def _gib_list(text: str, what: str) -> list[int]:
    from kvmem.units import gib_bytes

    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{what}: cannot read {item!r} as GiB") from None
        if not value > 0:
            raise ConfigError(f"{what} must be a positive number of GiB, got {item!r}")
        out.append(gib_bytes(value, what, text=item.strip()))
    return out


def _inputs(args: argparse.Namespace, measured=None, spec=None):
    from kvmem.plan import EngineSettings, Layout
    from kvmem.plan.partition import parse_partition
    from kvmem.plan.validate import check_layout
    from kvmem.units import gib_bytes, parse_size

    gpus = [g.strip() for item in args.gpu for g in item.split(",") if g.strip()] \
        if args.gpu else None
    memory = _gib_list(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
    if memory is not None and len(memory) == 1:
        memory = memory[0]
    if not args.weight_offload_gib >= 0:
        raise ConfigError("--weight-offload-gib must be a non-negative number of GiB, "
                          f"got {args.weight_offload_gib}")
    offload = gib_bytes(args.weight_offload_gib, "--weight-offload-gib", allow_zero=True)
    kv_bytes = (parse_size(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
                if args.kv_cache_memory_bytes is not None else None)
    partition = (parse_partition(args.layer_partition)
                 if args.layer_partition is not None else None)
    layout = Layout(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                    layer_partition=partition, gpus=gpus, gpu_memory_bytes=memory)
    check_layout(spec, layout)  # as the planner does, before anything is sized per rank
    cpu = args.device == "cpu"
    if cpu and kv_bytes is None and memory is None:
        raise ConfigError("--device cpu needs --kv-cache-memory-bytes (vLLM's CPU build takes "
                          "it, or VLLM_CPU_KVCACHE_SPACE, as given) or the NUMA node's memory "
                          "as --gpu-memory GiB (without either, vLLM-CPU takes that memory "
                          "x --gpu-memory-utilization less its worker's resident memory)")
    if cpu:
        from kvmem.plan.estimates import vllm_cpu_defaults

        block_size, *defaults = vllm_cpu_defaults(spec, layout.world_size)
    else:
        block_size, defaults = 16, _batch_defaults(layout, measured)
    version = _rules_version(args)
    batched, seqs = _batch_limits(args, spec, tuple(defaults), in_vllm=version is not None)
    settings = EngineSettings(
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
        block_size=block_size if args.block_size is None else args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=seqs, max_num_batched_tokens=batched,
        cuda_graphs=not (args.enforce_eager or cpu), reserve_cuda_graphs=args.reserve_cuda_graphs,
        cpu_offload_bytes=offload, kv_cache_dtype=args.kv_cache_dtype,
        vllm_version=version, device=args.device,
        max_concurrent_batches=args.max_concurrent_batches,
        hybrid_kv_cache_manager=False if args.disable_hybrid_kv_cache_manager else None,
        enable_prefix_caching=args.prefix_caching, mamba_cache_dtype=args.mamba_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        replayssm_buffer_len=args.replayssm_buffer_len if args.use_replayssm else None,
        mamba_backend=args.mamba_backend, attention_backend=args.attention_backend,
        gpu_arch=_gpu_arch(gpus), backend_block_size=args.block_size is None,
        speculative_config=getattr(args, "speculative_config", None))
    if args.attention_backend is not None and (version is None or cpu):
        raise ConfigError("--attention-backend is vLLM's on a GPU: plan it under vLLM's "
                          "rules (--engine vllm) without --device cpu")
    if args.use_replayssm and version is None:
        raise ConfigError("--use-replayssm is vLLM's (0.32 and later): plan it under vLLM's "
                          "rules (--vllm-version)")
    if version is not None and 1 <= batched < seqs:  # only where --max-num-seqs was given
        default = " (vLLM's default)" if args.max_num_batched_tokens is None else ""
        raise ConfigError(f"--max-num-seqs {seqs:,} is more than --max-num-batched-tokens "
                          f"{batched:,}{default}: vLLM refuses to start (max_num_batched_tokens "
                          "must be at least max_num_seqs); lower --max-num-seqs or raise "
                          "--max-num-batched-tokens")
    return layout, settings


def _gpu_arch(gpus: list[str] | None) -> int | None:
    """Rank 0's GPU's CUDA compute capability major (None: not given, or not known)."""
    from kvmem.plan.gpus import gpu_arch

    if not gpus:
        return None
    try:
        return gpu_arch(gpus[0])
    except ConfigError:
        return None  # a GPU outside the catalog, sized with --gpu-memory


def _batch_limits(args: argparse.Namespace, spec, defaults: tuple[int, int],
                  in_vllm: bool) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): those given, ``defaults`` for the rest; in
    vLLM a default fitted to the limits given as vLLM fits it (a defaulted max_num_seqs is
    lowered to the token budget; kvmem.plan.estimates.vllm_batch_limits). kvmem's engine
    takes both as they are: its scheduler serves the running requests in turn within the
    budget, so max_num_seqs may exceed it."""
    from kvmem.plan.estimates import vllm_batch_limits

    given = (args.max_num_batched_tokens, args.max_num_seqs)
    max_len = spec.max_position_embeddings if args.max_model_len is None else args.max_model_len
    if in_vllm and all(v is None or v >= 1 for v in (*given, max_len)):
        return vllm_batch_limits(*given, defaults, max_len)
    # kvmem's engine; or a limit that is not positive, which check_settings names
    return tuple(d if g is None else g for g, d in zip(given, defaults, strict=True))


def _rules_version(args: argparse.Namespace) -> str | None:
    """Whose rules size the KV cache: kvmem's engine (``--engine kvmem``), else the vLLM
    release given (default ``kvmem.plan.vllm_release.DEFAULT_VERSION``)."""
    from kvmem.plan.vllm_release import DEFAULT_VERSION, VllmRelease

    if args.engine == "kvmem":
        if args.vllm_version is not None:
            raise ConfigError("--vllm-version names vLLM's rules; --engine kvmem plans "
                              "kvmem's own engine")
        return None
    return VllmRelease.parse(args.vllm_version or DEFAULT_VERSION).name


def _batch_defaults(layout, measured) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) when not given: a profile's own, else what
    vLLM picks for rank 0's GPU (kvmem.plan.estimates.vllm_batch_defaults)."""
    from kvmem.plan.estimates import vllm_batch_defaults
    from kvmem.plan.validate import rank_memory

    if measured is not None:
        return measured.max_num_batched_tokens, measured.max_num_seqs
    memory = rank_memory(layout)[0]
    return vllm_batch_defaults(memory, layout.gpus[0] if layout.gpus else None)


def _offload_config(args: argparse.Namespace):
    from kvmem.tiers.config import OffloadConfig

    return OffloadConfig.from_gib(args.cpu_offload_gib, args.disk_offload_dir,
                                  args.disk_offload_gib, args.offload_policy,
                                  check_dir=args.check_disk_dir)


def kv_offload(plan, config) -> dict | None:
    """The ``kv_offload`` section: what each tier holds for this model and layout.

    A tier stores a block as one row holding every rank's share of it (their
    ``bytes_per_block`` summed), as the engine does; a disk block also has a header.
    """
    from kvmem.tiers.config import tier_capacity

    if not config.enabled:
        return None
    block_bytes = sum(r.bytes_per_block for r in plan.ranks)
    out: dict = {"block_bytes": block_bytes, "policy": config.policy}
    for tier in tier_capacity(config, block_bytes, plan.engine.block_size):
        out[tier.tier] = {"bytes": tier.budget_bytes, "block_bytes": tier.block_nbytes,
                          "blocks": tier.num_blocks, "tokens": tier.num_tokens}
    if config.disk_dir:
        out["disk"]["dir"] = config.disk_dir
    return out


def _offload_notes(section: dict) -> list[str]:
    from kvmem.units import format_bytes

    notes = []
    for tier in ("cpu", "disk"):
        if tier in section:
            t = section[tier]
            where = f" in {t['dir']}" if "dir" in t else ""
            notes.append(f"KV offload {tier} tier{where}: {format_bytes(t['bytes'])} holds "
                         f"{t['blocks']:,} blocks ({t['tokens']:,} tokens) of "
                         f"{format_bytes(t['block_bytes'])} each")
    if any(section[t]["blocks"] == 0 for t in ("cpu", "disk") if t in section):
        notes.append("a KV offload budget smaller than one block holds nothing; the engine "
                     "refuses a CPU budget under one block")
    return notes


def _offload_flags(config) -> list[str]:
    argv = []
    if config.cpu_bytes:
        argv += ["--cpu-offload-gib", f"{config.cpu_bytes / (1 << 30):g}"]
    if config.disk_bytes:
        argv += ["--disk-offload-dir", config.disk_dir,
                 "--disk-offload-gib", f"{config.disk_bytes / (1 << 30):g}"]
    if config.policy != "lru":
        argv += ["--offload-policy", config.policy]
    return argv


def served_model(model: str, spec) -> str:
    """The model as an engine command names it: the path the user gave (a config.json's
    directory), else the hub name of the catalog entry (never the config's label)."""
    path = Path(model).expanduser()
    if path.is_file():
        return str(Path(model).parent) if Path(model).parent != Path() else "."
    if path.is_dir():
        return model
    return spec.name


def _checkpoint_dir(model: str) -> Path | None:
    path = Path(model).expanduser()
    return path if path.is_dir() and any(path.glob("*.safetensors")) else None


def _elastic(args: argparse.Namespace, result, spec):
    """The elastic reservation and limit (kvmem.memory.sizing; no torch): in kvmem's engine
    each rank's (pages of 2 MiB granules on a GPU, of OS pages on CPU); in vLLM (``--engine
    vllm``, or ``--device cpu``, which plans vLLM's CPU build) what its scheduler side does
    with vLLM's own KV cache."""
    if args.kv_memory != "elastic":
        for flag, value in (("--kv-memory-limit", args.kv_memory_limit),
                            ("--kv-memory-huge-pages", args.kv_memory_huge_pages or None)):
            if value is not None:
                raise ConfigError(f"{flag} needs --kv-memory elastic")
        return None
    from kvmem.memory.huge_pages import huge_page_size
    from kvmem.memory.sizing import (
        CPU_GRANULARITY,
        CUDA_GRANULARITY,
        plan_elastic,
        plan_vllm_elastic,
    )
    from kvmem.units import parse_size

    if args.engine == "sglang":
        raise ConfigError("--kv-memory elastic runs in kvmem's engine and in vLLM "
                          "(KVMEM_VLLM_KV_MEMORY=elastic), not in SGLang")
    limit = (parse_size(args.kv_memory_limit, "--kv-memory-limit")
             if args.kv_memory_limit is not None else None)
    on_cpu = args.device == "cpu"
    if args.kv_memory_huge_pages and not on_cpu:
        raise ConfigError("--kv-memory-huge-pages is for KV memory on the CPU (--device cpu); "
                          "a GPU's pages are the driver's 2 MiB granules already")
    granularity = (huge_page_size() if args.kv_memory_huge_pages else CPU_GRANULARITY
                   ) if on_cpu else CUDA_GRANULARITY
    if args.engine == "vllm" or (on_cpu and args.engine is None):
        return plan_vllm_elastic(result, spec, limit, on_cpu=on_cpu, granularity=granularity)
    return plan_elastic(result, spec, limit, granularity=granularity, one_memory=on_cpu)


def _check_profile_matches(profiles, layout, settings, path: str) -> None:
    """A profile is each rank's memory in one layout under given batch limits: refuse to
    apply it to another layout or to other limits (its activation peak would be for other
    batches)."""
    first = profiles[0]
    tp, pp = first.tensor_parallel_size, first.pipeline_parallel_size
    if (tp, pp) != (layout.tensor_parallel_size, layout.pipeline_parallel_size):
        what = "one process" if tp * pp == 1 else "the ranks of"
        raise ConfigError(f"{path} measured {what} (tp {tp}, pp {pp}); it cannot stand for "
                          f"the ranks of tp {layout.tensor_parallel_size} x pp "
                          f"{layout.pipeline_parallel_size}: profile that layout "
                          f"(kvmem profile -tp {layout.tensor_parallel_size} -pp "
                          f"{layout.pipeline_parallel_size}) or plan from estimates")
    for name, planned, profiled in (
            ("--max-num-batched-tokens", settings.max_num_batched_tokens,
             first.max_num_batched_tokens),
            ("--max-num-seqs", settings.max_num_seqs, first.max_num_seqs)):
        if planned != profiled:
            raise ConfigError(f"{path} was measured with {name} {profiled} but the plan uses "
                              f"{planned}: plan with {name} {profiled} or profile again")


def _check_profile_layers(profiles, result, path: str) -> None:
    """Each rank's plan holds the layers its profile measured."""
    for profile, rank in zip(profiles, result.ranks, strict=True):
        planned = [rank.layers[0], rank.layers[-1]] if rank.layers else []
        if profile.layers and profile.layers != planned:
            raise ConfigError(f"{path} measured layers {profile.layers[0]}-"
                              f"{profile.layers[-1]} on rank {profile.rank} but the plan puts "
                              f"layers {planned[0]}-{planned[-1]} there: give the profile's "
                              f"--layer-partition")


def _elastic_fit_error(result, spec, sizings) -> str | None:
    """Why one request of max_model_len cannot run under the elastic limit, if it cannot
    (the engine refuses to start with the same figures)."""
    from kvmem.memory.sizing import useful_blocks
    from kvmem.units import format_bytes

    lead, engine = sizings[0], result.engine
    need = useful_blocks(spec.kv_groups(), max_model_len=engine.max_model_len,
                         block_size=engine.block_size,
                         max_num_batched_tokens=result.settings.max_num_batched_tokens,
                         max_num_seqs=1)
    if lead.limit_blocks >= need:
        return None
    return (f"the elastic KV memory limit {format_bytes(lead.limit_bytes)} holds "
            f"{lead.limit_blocks:,} blocks (whole pages of {lead.blocks_per_page}) but one "
            f"request of max_model_len {engine.max_model_len:,} needs {need:,} (incl. the null "
            "block); raise --kv-memory-limit or lower --max-model-len")


def elastic_lines(elastic, on_cpu: bool, huge_pages: bool = False) -> list[str]:
    """The elastic reservation and limit, in words: kvmem's engine (each rank's sizing) or
    vLLM's (a ``VllmElasticSizing``); ``huge_pages``: CPU pages of whole huge pages."""
    from kvmem.units import format_bytes

    if isinstance(elastic, VllmElasticSizing):
        s = elastic
        blocks = "block" if s.blocks_per_page == 1 else "blocks"
        pages = "huge pages" if huge_pages else "OS pages"
        granule = (f"{pages} of {format_bytes(s.granularity)} on vLLM's CPU build" if on_cpu
                   else f"{format_bytes(s.granularity)} granules on each GPU")
        where = ("every rank's KV, all in this host's memory" if on_cpu
                 else "rank 0's GPU; each GPU counts its own")
        return [f"elastic KV memory in vLLM ({VLLM_MODE_ENV}=elastic): vLLM's KV cache is the "
                f"reservation, {s.reserved_blocks:,} blocks ({format_bytes(s.reserved_bytes)}), "
                f"mapped in pages of {s.blocks_per_page} {blocks} ({format_bytes(s.page_bytes)}"
                f"; {granule})",
                f"  limit {format_bytes(s.limit_bytes)}: {s.limit_blocks:,} blocks mapped at "
                f"most ({where}); one request of max_model_len maps {s.request_pages:,} pages "
                "(incl. the null block's)"]
    lead = elastic[0]
    granules = "2 MiB granules" if not on_cpu else "huge pages" if huge_pages else "OS pages"
    counted = ("rank 0's GPU" if not on_cpu else "this host's memory, every rank's KV"
               if len(elastic) > 1 else "this host's memory")
    return [f"elastic KV memory: limit {format_bytes(lead.limit_bytes)} in {counted} "
            f"({lead.limit_blocks:,} blocks mapped at most), reservation {lead.max_blocks:,} "
            f"blocks in pages of {lead.blocks_per_page} ({granules})",
            *(f"  rank {rank}: {format_bytes(s.reserved_bytes)} virtual, "
              f"{format_bytes(s.page_bytes)} per page" for rank, s in enumerate(elastic))]


@dataclass
class PlanRun:
    """What `kvmem plan` computes for one set of flags: the plan and what is shown with it."""

    plan: Plan
    command: EngineCommand | None  # with --engine
    offload: dict | None  # the kv_offload section, with offload tiers
    elastic: list | VllmElasticSizing | None  # with --kv-memory elastic: each rank's sizing
    # in kvmem's engine, or vLLM's
    elastic_error: str | None  # why one request cannot run under the elastic limit
    huge_pages: bool = False  # elastic CPU pages of whole transparent huge pages

    def document(self) -> dict:
        """The object `kvmem plan --json` prints."""
        out = self.plan.to_dict()
        if isinstance(self.elastic, VllmElasticSizing):
            out["kv_memory"] = {"kind": "elastic", "engine": "vllm", **self.elastic.to_dict()}
        elif self.elastic is not None:
            out["kv_memory"] = {"kind": "elastic", "ranks": [s.to_dict() for s in self.elastic]}
        if self.offload is not None:
            out["kv_offload"] = self.offload
        if self.command is not None:
            out["engine_command"] = self.command.to_dict()
        return out

    def offload_notes(self) -> list[str]:
        """What the offload tiers hold, in words (notes of the table output)."""
        return _offload_notes(self.offload) if self.offload is not None else []


def build(args: argparse.Namespace, spec=None) -> PlanRun:
    """The plan ``args`` (this module's flags) describe: the one function behind `kvmem plan`
    and the `kvmem ui` page. ``spec`` is the model when the caller has read it (the page
    takes a catalog name or a pasted config.json): then no file is read for it and the
    engine command names the model ``args.model``."""
    from kvmem.plan import plan
    from kvmem.plan.flags import engine_command
    from kvmem.spec import load_spec

    local = spec is None
    if local and args.model is None:
        raise ConfigError("give MODEL (a catalog name, config.json or model directory)")
    spec = load_spec(args.model) if local else spec
    measured = None
    if args.profile:
        from kvmem.engine.memory_profile import load_profiles  # imports no torch

        measured = load_profiles(args.profile)
    layout, settings = _inputs(args, measured[0] if measured else None, spec)
    offload = _offload_config(args)
    if measured is not None:
        _check_profile_matches(measured, layout, settings, args.profile)
    result = plan(spec, layout, settings, policy=args.kv_budget,
                  profile=[p.to_rank_profile() for p in measured] if measured else None,
                  checkpoint_dir=_checkpoint_dir(args.model) if local else None)
    if measured is not None:
        _check_profile_layers(measured, result, args.profile)
        what = "every rank's" if len(measured) > 1 else "the"
        result.notes.append(f"{what} measured memory of {measured[0].model} on "
                            f"{measured[0].device} ({args.profile}) replaces the estimates on "
                            f"{'its rank' if len(measured) > 1 else 'every rank'}")
    if args.device == "cpu":
        result.notes = [n for n in result.notes if not n.startswith("GPU memory not given")]
        if result.settings.kv_cache_memory_bytes is not None:
            kv = "the KV size is the one stated"
        else:
            from kvmem.plan.estimates import VLLM_CPU_PROCESS_BYTES

            kv = ("the KV size is estimated as vLLM-CPU sizes it without a stated one: the "
                  "node's memory x gpu_memory_utilization, less the worker's weights and "
                  f"{VLLM_CPU_PROCESS_BYTES / (1 << 30):.2f} GiB of process memory "
                  "(measured on vllm-cpu 0.32.0; vLLM logs its own as 'Auto set (X/Y) GiB'); "
                  "--kv-cache-memory-bytes makes it exact")
        result.notes.append("a deployment on vLLM's CPU build: its block size and batch "
                            f"defaults, no CUDA graphs; {kv}")
    # named as the user gave it, everywhere
    result.model = served_model(args.model, spec) if local else args.model
    command = engine_command(result, args.engine, result.model) if args.engine else None
    offload_section = kv_offload(result, offload)
    if command is not None and offload_section is not None:
        if args.engine == "kvmem":
            command.argv += _offload_flags(offload)
            if layout.world_size > 1:
                command.notes.append("with tensor/pipeline parallelism the tiers live on rank "
                                     "0's host: every block's parts from all ranks are copied "
                                     "there (docs/parallel.md)")
        else:
            command.notes.append("the KV offload tiers are kvmem's; configure this engine's "
                                 "own KV offloading separately")
    elastic = _elastic(args, result, spec)
    in_vllm = isinstance(elastic, VllmElasticSizing)
    if in_vllm:
        elastic_error = elastic.fit_error(result.engine.max_model_len)
    else:
        elastic_error = (_elastic_fit_error(result, spec, elastic) if elastic is not None
                         else None)
    if elastic_error is not None:
        result.notes.append(elastic_error)
    if command is not None and args.engine == "kvmem" and elastic is not None:
        command.argv += ["--kv-memory", "elastic"]
        if args.kv_memory_limit is not None:
            command.argv += ["--kv-memory-limit", str(elastic[0].limit_bytes)]
        if args.kv_memory_huge_pages:
            command.argv += ["--kv-memory-huge-pages"]
    if command is not None and in_vllm:
        env = {VLLM_MODE_ENV: "elastic"}
        if args.kv_memory_limit is not None:
            env[VLLM_LIMIT_ENV] = str(elastic.limit_bytes)
        if args.kv_memory_huge_pages:
            env[VLLM_HUGE_ENV] = "1"
        for cmd in (command, command.plugin):
            if cmd is not None:
                cmd.env.update(env)
    return PlanRun(result, command, offload_section, elastic, elastic_error,
                   huge_pages=bool(args.kv_memory_huge_pages))
