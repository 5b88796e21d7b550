"""``kvmem profile [MODEL]``: measure a model's memory on this device and suggest KV budgets.

Loads the weights, runs a dummy forward of max_num_batched_tokens tokens and the sampler
over max_num_seqs rows, captures the decode CUDA graphs (GPU, unless --enforce-eager), and
prints what each part takes and two kv_cache_memory_bytes values: one that fits the
requested gpu_memory_utilization and one that uses all the memory free at start.
``--output FILE.json`` saves the profile for ``kvmem plan MODEL --profile FILE.json``; the
path is checked before the model loads. With ``-tp N -pp M`` every rank is started and
measured (its stage's layers, its tensor-parallel slice; gloo on CPU, NCCL on GPUs), and
the report and the file hold one profile per rank. An explicit KV budget, elastic KV
memory and the offload tiers are refused with a one-line error (``check_profilable``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

_EPILOG = """\
examples:
  kvmem profile                                   # the embedded SmolLM2 on this device
  kvmem profile ./Qwen3-8B --gpu-memory-utilization 0.95 --output qwen3.json
  kvmem profile ./Qwen3-8B -tp 2 -pp 2 --output qwen3-tp2-pp2.json   # every rank
  kvmem plan ./Qwen3-8B --profile qwen3.json      # plan with the measured figures
  kvmem serve ./Qwen3-8B --kv-cache-memory-bytes 151519866880
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvmem.engine.config import add_engine_arguments

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _EPILOG
    add_engine_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--output", "-o", metavar="FILE.json",
                   help="write the profile as JSON (input of `kvmem plan --profile`)")
    o.add_argument("--json", action="store_true", help="print the profile as one JSON object")


def report_table(profile):
    """The profile as a rich table: each figure in bytes and GiB, then the two budgets."""
    from rich import box
    from rich.table import Table

    from kvmem.units import GiB

    shard = ""
    if profile.tensor_parallel_size * profile.pipeline_parallel_size > 1:
        shard = (f", rank {profile.rank} (layers {profile.layers[0]}-{profile.layers[-1]} of "
                 f"tp {profile.tensor_parallel_size} x pp {profile.pipeline_parallel_size})")
    table = Table(title=f"{profile.model} on {profile.device}{shard}: memory profile",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, justify in (("", "left"), ("bytes", "right"), ("GiB", "right"), ("", "left")):
        table.add_column(col, justify=justify, no_wrap=justify == "right")

    def row(name: str, n: int, note: str = "") -> None:
        table.add_row(name, f"{n:,}", f"{n / GiB:.2f}", note)

    on_cpu = profile.device == "cpu"
    row("total", profile.total_bytes, "the machine's RAM" if on_cpu else "")
    row("free at start", profile.free_bytes_at_start, "available RAM" if on_cpu else "")
    row(f"requested ({profile.gpu_memory_utilization:g})", profile.requested_bytes,
        "ceil(total x gpu_memory_utilization)")
    weights_note = "parameter bytes"
    if profile.weights_resident_bytes is not None:
        weights_note += f"; resident growth {profile.weights_resident_bytes / GiB:.2f} GiB"
    row("- weights", profile.weights_bytes, weights_note)
    row("- peak activation", profile.activation_bytes,
        f"forward of {profile.max_num_batched_tokens:,} tokens "
        f"{profile.forward_peak_bytes / GiB:.2f} GiB, sampler of {profile.max_num_seqs:,} "
        f"rows {profile.sampler_peak_bytes / GiB:.2f} GiB")
    row("- non-torch", profile.non_torch_bytes,
        "process memory before the weights" if on_cpu else "CUDA context growth, workspaces, "
        "communicators")
    if profile.graphs_captured:
        row("- CUDA graphs", profile.cuda_graph_bytes,
            f"{len(profile.cuda_graph_sizes)} decode batch sizes, "
            f"1..{profile.cuda_graph_sizes[-1]}")
    else:
        table.add_row("- CUDA graphs", "0", "0.00",
                      "not captured (CPU)" if on_cpu else "not captured (eager)")
    row("- headroom", profile.headroom_bytes, "fragmentation and workspaces not seen")
    table.add_section()
    row("KV budget: fit", profile.suggested_kv_bytes_fit, "requested - all of the above")
    row("KV budget: whole", profile.suggested_kv_bytes_whole,
        "free at start - all of the above")
    return table


def check_output(path: str) -> None:
    """Refuse an --output the profile could not be written to, before profiling."""
    from kvmem.errors import ConfigError

    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ConfigError(f"--output {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise ConfigError(f"--output {path}: directory {parent} does not exist")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(parent, os.W_OK)
    if not writable:
        raise ConfigError(f"--output {path}: not writable")


def _save(profiles, path: str) -> None:
    from kvmem.engine.memory_profile import save_profiles
    from kvmem.errors import KvmemError

    try:
        save_profiles(profiles, path)
    except OSError as e:  # e.g. the disk filled up while profiling
        raise KvmemError(f"--output {path}: cannot write the profile ({e.strerror})") from None


def run(args: argparse.Namespace) -> int:
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.memory_profile import profiles_to_dict
    from kvmem.engine.profile_ranks import check_profilable, profile_ranks

    config = EngineConfig.from_args(args)
    check_profilable(config)
    if args.output:
        check_output(args.output)
    profiles = profile_ranks(config)
    if args.output:
        _save(profiles, args.output)
    if args.json:
        print(json.dumps(profiles_to_dict(profiles), indent=1))
        return 0
    from rich.console import Console

    console = Console(width=None if Console().is_terminal else 120)
    for profile in profiles:
        console.print(report_table(profile))
        console.print(profile.summary(), highlight=False, soft_wrap=True)
        for note in profile.notes:
            console.print(f"note: {note}", highlight=False)
    flag = "--kv-cache-memory-bytes"
    if len(profiles) == 1:
        console.print(f"\nserve within the request: {flag} {profiles[0].suggested_kv_bytes_fit}\n"
                      f"use all free memory:      {flag} {profiles[0].suggested_kv_bytes_whole}",
                      highlight=False)
    else:  # an explicit budget is each rank's: the smallest one fits every rank
        fit = min(p.suggested_kv_bytes_fit for p in profiles)
        console.print(f"\nserve within the request on every rank: {flag} {fit}", highlight=False)
    first = profiles[0]
    if args.output:
        layout = (f" --tp {first.tensor_parallel_size} --pp {first.pipeline_parallel_size}"
                  if len(profiles) > 1 else "")
        console.print(f"profile saved to {args.output}; plan with it: kvmem plan "
                      f"{first.checkpoint or 'MODEL'}{layout} --profile {args.output} "
                      f"--kv-cache-dtype {first.dtype}", highlight=False, soft_wrap=True)
    return 0
