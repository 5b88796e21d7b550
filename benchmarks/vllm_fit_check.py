"""MISSION problem 1's shape in vLLM's CPU build, with and without kvmem's plugin.

pp 2 (15 + 15 layers of the embedded model), 200 MiB of KV per rank, max_model_len 8,192:
the whole model needs 360 MiB of KV for one request, each stage 180 MiB. Starts vLLM twice
(alone, then with ``KVMEM_VLLM_KV_BUDGET=uniform``), with ``--offload`` also with vLLM's KV
offloading (``kv_offloading_size=1``), and prints each start's KV sizing and error lines.
Run from the repo root with the main venv (it starts vLLM in its own venv)::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_fit_check.py --offload
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import vllm_cpu  # noqa: E402

SHOWN = ("KV cache size", "kvmem:", "KVMEM_RESULT", "Error:", "Exception:", "needed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offload", action="store_true", help="kv_offloading_size=1 (GiB)")
    parser.add_argument("--kv-bytes", type=int, default=200 << 20)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()
    engine = {"pipeline_parallel_size": 2, "kv_cache_memory_bytes": args.kv_bytes,
              "max_model_len": args.max_model_len}
    if args.offload:
        engine["kv_offloading_size"] = 1.0
    for name, env in (("vLLM alone", {}), ("with KVMEM_VLLM_KV_BUDGET=uniform",
                                           {"KVMEM_VLLM_KV_BUDGET": "uniform"})):
        cfg = {"model": str(vllm_cpu.model_dir()), "engine": {**vllm_cpu.FAST_ENGINE, **engine},
               "prompts": ["The capital of France is"], "max_tokens": 8}
        run = vllm_cpu.run_script(vllm_cpu.LLM_SCRIPT, json.dumps(cfg), env=env, timeout=900)
        print(f"== {name}: exit {run.returncode}")
        seen = set()
        for line in run.output.splitlines():
            text = line.split("] ", 1)[-1]
            if any(k in line for k in SHOWN) and text not in seen:
                seen.add(text)
                print("  " + text[:300])


if __name__ == "__main__":
    main()
