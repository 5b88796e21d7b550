"""Host time of a decode step at batch 256: what the engine spends around the model.

A model of one layer and 32 hidden units makes the forward nearly free, so the step's time
is the engine's own Python and small-tensor work (scheduling, inputs, sampling, outputs):
on a GPU that part is not hidden behind the model. Prompts of 100-1024 token ids, outputs
drawn at temperature 0.6 (nano-vllm's workload); the decode steps after every prefill are
timed, with cProfile's cumulative time of each phase.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_overhead.py [--steps 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PHASES = {"schedule": "scheduler.py", "prepare_inputs": "model_runner.py",
          "model forward": "decoder.py", "sample": "sampler.py",
          "outputs (detokenize, stop checks)": "output_processor.py"}
FUNCTIONS = {"schedule": "schedule", "prepare_inputs": "prepare_inputs",
             "model forward": "forward", "sample": "__call__",
             "outputs (detokenize, stop checks)": "process"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    from tiny_models import make_tiny_checkpoint

    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.engine.sampling_params import SamplingParams

    model = make_tiny_checkpoint(Path(tempfile.mkdtemp()), "llama", hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=4096)
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_memory_bytes=1 << 30,
                                    max_num_seqs=args.batch, max_model_len=2048))
    rng = random.Random(0)
    for i in range(args.batch):
        prompt = [rng.randrange(10, 250) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 50,
                                                           temperature=0.6, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    step = (time.perf_counter() - start) / args.steps
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (..., cumulative, callers)
    print(f"decode step at batch {len(engine.scheduler.running)}: {step * 1e3:.1f} ms "
          f"(under cProfile)")
    for phase, file in PHASES.items():
        cumulative = sum(v[3] for (f, _, name), v in stats.items()
                         if f.endswith(file) and name == FUNCTIONS[phase])
        print(f"  {phase:36s} {cumulative / args.steps * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
