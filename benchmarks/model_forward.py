"""Decode-step latency of the paged SmolLM2 model vs transformers with its own KV cache.

Run by hand: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/model_forward.py``.
Both sides run the embedded SmolLM2-135M-Instruct in fp32 on CPU, one decode step for a
batch of B sequences that each hold ``context`` tokens; the figure is the median step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(files, batch: int, context: int, repeats: int, block_size: int = 16) -> float:
    from kvmem.engine.attention import AttentionMetadata
    from kvmem.engine.models import build_model
    from kvmem.memory.storage import SlotShape, TensorKVStorage
    from kvmem.spec import spec_from_config

    model = build_model(files.config, attention_backend="reference")
    model.load_weights(files.weights())
    spec = spec_from_config(files.config)
    per_seq = -(-(context + 1) // block_size)
    storage = TensorKVStorage(1 + batch * per_seq, spec.num_layers,
                              SlotShape(2, block_size, spec.num_kv_heads, spec.head_dim),
                              torch.float32)
    caches = [storage.slot_tensor(i) for i in range(spec.num_layers)]
    tables = [[1 + b * per_seq + j for j in range(per_seq)] for b in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context + 1] * batch, [tables], block_size)
    ids, pos = torch.randint(0, 1000, (batch,)), torch.full((batch,), context)

    def step():
        with torch.no_grad():
            model.compute_logits(model(ids, pos, meta, caches))

    return median_time(step, repeats)


def transformers_step(files, batch: int, context: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    with torch.no_grad():
        prefill = model(torch.randint(0, 1000, (batch, context)), use_cache=True)
    ids = torch.randint(0, 1000, (batch, 1))

    def step():
        cache = prefill.past_key_values
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the appended token: every step sees the same context

    return median_time(step, repeats)


def main() -> None:
    from kvmem.engine.loader import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    files = resolve_model(None)
    print(f"SmolLM2-135M fp32, CPU threads={torch.get_num_threads()}, context={args.context}")
    print("batch  kvmem ms  transformers ms  speed-up")
    for batch in args.batch:
        a = ours(files, batch, args.context, args.repeats)
        b = transformers_step(files, batch, args.context, args.repeats)
        print(f"{batch:5d}  {a * 1e3:8.1f}  {b * 1e3:15.1f}  {b / a:7.2f}x")


if __name__ == "__main__":
    main()
