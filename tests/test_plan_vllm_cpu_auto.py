"""vLLM-CPU's own KV size when none is stated, and `kvmem plan --device cpu` predicting it.

Without ``kv_cache_memory_bytes`` and ``VLLM_CPU_KVCACHE_SPACE``, vllm-cpu 0.32 gives the KV
cache ceil(NUMA node memory x gpu_memory_utilization) less the worker's resident memory
after loading (``CPUWorker.determine_available_memory``). ``kvmem plan --device cpu
--gpu-memory NODE_GIB`` estimates that resident memory as the weights plus
``VLLM_CPU_PROCESS_BYTES``; the live test starts vLLM that way and compares.
"""

from __future__ import annotations

import json
import re
from math import ceil
from pathlib import Path

import psutil
import pytest

from kvmem.cli import main
from kvmem.plan.estimates import VLLM_CPU_PROCESS_BYTES
from tests import vllm_cpu

GIB = 1 << 30


def node_memory_bytes() -> int:
    """NUMA node 0's memory, which vLLM-CPU takes its share of (the host's without NUMA)."""
    try:
        text = Path("/sys/devices/system/node/node0/meminfo").read_text()
        return int(re.search(r"MemTotal:\s+(\d+) kB", text)[1]) * 1024
    except (OSError, TypeError):
        return psutil.virtual_memory().total


def cpu_plan(capsys, *flags: str) -> dict:
    model = str(vllm_cpu.model_dir())
    assert main(["plan", model, "--device", "cpu", "--max-model-len", "1024",
                 "--kv-cache-dtype", "fp32", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_without_a_stated_kv_size_the_node_memory_less_the_worker_is_planned(capsys):
    doc = cpu_plan(capsys, "--gpu-memory", "16", "--gpu-memory-utilization", "0.12")
    rank = doc["ranks"][0]
    assert rank["kv_capacity_bytes"] == ceil(16 * GIB * 0.12) - rank["weights_bytes"] \
        - VLLM_CPU_PROCESS_BYTES
    assert rank["activation_bytes"] == rank["cuda_graph_bytes"] == 0
    assert any("estimated as vLLM-CPU sizes it" in n for n in doc["notes"])
    stated = cpu_plan(capsys, "--kv-cache-memory-bytes", "1GiB")
    assert stated["ranks"][0]["kv_budget_bytes"] == GIB
    assert any("the KV size is the one stated" in n for n in stated["notes"])


def test_neither_a_kv_size_nor_the_node_memory_is_one_line(capsys):
    model = str(vllm_cpu.model_dir())
    assert main(["plan", model, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--kv-cache-memory-bytes" in err and "--gpu-memory" in err


@pytest.mark.vllm
@pytest.mark.slow
def test_kvmem_plan_predicts_vllm_cpus_own_kv_size(capsys):
    # about 3 GiB of the node, whatever its size: at a fixed 0.12, a 12.8 GiB node leaves
    # vLLM-CPU no KV cache beside its 1.5 GiB worker
    utilization = f"{min(0.9, 3 * GIB / node_memory_bytes()):.3f}"
    run = vllm_cpu.run_llm({"gpu_memory_utilization": float(utilization),
                            "max_model_len": 1024}, ["Hello"], max_tokens=2)
    auto = re.search(r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache.*?([\d.]+) GiB memory "
                     r"was consumed by non-kv usages", run.output)
    assert auto, run.output[-4000:]
    node_gib, consumed = float(auto[2]), float(auto[3]) * GIB
    tokens, _ = run.kv_cache_size()
    doc = cpu_plan(capsys, "--gpu-memory", f"{node_gib}", "--gpu-memory-utilization",
                   utilization)
    weights = doc["ranks"][0]["weights_bytes"]
    # the worker's memory beyond its weights is the constant kvmem estimates it with
    assert abs(consumed - weights - VLLM_CPU_PROCESS_BYTES) < 0.25 * GIB
    planned = doc["engine"]["kv_cache_size_tokens"]
    assert abs(planned - tokens) <= 0.1 * tokens, (planned, tokens)
