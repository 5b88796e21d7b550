"""Per-decode-step cost of tensor and pipeline parallelism on CPU (gloo), against tp 1.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/parallel_overhead.py [--steps 64]

The same tiny random-weight Llama (4 layers, hidden 256, 8 heads, 4 KV heads) runs a
batch of decoding requests as one process (the comparison run), as tp 2, as pp 2 and as
tp 2 x pp 2. Only steps in which every request decodes one token are timed; the median
step time and its ratio to tp 1 are printed. Each extra rank is a process, so on a small
machine the ranks share cores: the figures show communication and coordination cost,
not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = [("tp 1 (one process)", 1, 1), ("tp 2", 2, 1), ("pp 2", 1, 2), ("tp 2 x pp 2", 2, 2)]


def decode_step_times(model_dir: Path, tp: int, pp: int, batch: int, steps: int) -> list[float]:
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=32 << 20,
                                    max_model_len=512, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, enable_prefix_caching=False))
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [10 + i, 20, 30, 40, 50, 60, 70, 80], params)
        times = []
        while engine.has_unfinished_requests() and len(times) < steps:
            decoding = all(r.num_computed_tokens > 0 for r in engine.requests.values())
            start = time.perf_counter()
            engine.step()
            if decoding:
                times.append(time.perf_counter() - start)
        return times
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp), "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
        results = {}
        for name, tp, pp in LAYOUTS:
            results[name] = statistics.median(decode_step_times(model_dir, tp, pp, args.batch,
                                                                args.steps))
    base = results[LAYOUTS[0][0]]
    print(f"decode step, batch {args.batch}, median of {args.steps} steps")
    for name, seconds in results.items():
        print(f"  {name:<20} {seconds * 1e3:7.2f} ms   x{seconds / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
