"""Offline throughput: kvmem's engine vs transformers ``generate`` with padded batches.

32 requests with prompts of 64-512 tokens (random token ids, fixed seed) and 64 output
tokens each (ignore_eos), on the embedded SmolLM2-135M-Instruct in fp32 on one CPU
thread. Both run in this process on the same prompts; we report output tokens/s and
the ratio.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_throughput.py
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def run_kvmem(prompts: list[list[int]], output_len: int, args) -> float:
    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    llm = LLM(None, max_model_len=1024, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2), show_progress=False)  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, show_progress=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outs)
    print(f"kvmem: {llm.engine.num_blocks} KV blocks, {llm.engine.stats.steps} steps, "
          f"{llm.engine.num_preemptions} preemptions")
    return elapsed


def run_transformers(prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    import transformers

    from kvmem.engine.loader import resolve_model

    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(None).path,
                                                              dtype=torch.float32).eval()
    config = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)

    def generate(batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))  # left padding, as decoder-only generation needs
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, generation_config=config)

    generate([prompts[0][:16]])  # warm up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        out = generate(prompts[i:i + batch_size])
        assert out.shape[1] - max(map(len, prompts[i:i + batch_size])) == output_len
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=8,
                   help="prompts per padded transformers batch (in arrival order)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)

    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, 49152, args.seed)
    total_out = args.num_requests * args.output_len
    print(f"{args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
          f"({sum(map(len, prompts))} in all), {args.output_len} output tokens each, "
          f"torch threads {torch.get_num_threads()}")
    t_kvmem = run_kvmem(prompts, args.output_len, args)
    print(f"kvmem:        {t_kvmem:7.1f} s  {total_out / t_kvmem:7.1f} output tok/s")
    t_hf = run_transformers(prompts, args.output_len, args.hf_batch_size)
    print(f"transformers: {t_hf:7.1f} s  {total_out / t_hf:7.1f} output tok/s "
          f"(padded batches of {args.hf_batch_size})")
    print(f"ratio kvmem / transformers: {t_hf / t_kvmem:.2f}x")


if __name__ == "__main__":
    main()
