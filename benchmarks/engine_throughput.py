"""Offline throughput: kvmem's engine vs transformers ``generate`` with padded batches.

32 requests with prompts of 64-512 tokens (random token ids, fixed seed) and 64 output
tokens each (ignore_eos), on the embedded SmolLM2-135M-Instruct in fp32 on one CPU
thread. Both engines are loaded once in this process and run the same prompts in
alternating rounds (transformers, kvmem, transformers, kvmem, ...), so that load from
other work on a shared machine falls on both; each run and the ratio of the totals are
reported. kvmem runs with prefix caching off: later rounds would otherwise find every
prompt cached by the first.

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


class KvmemRunner:
    def __init__(self, args) -> None:
        from kvmem.engine.llm import LLM
        from kvmem.engine.sampling_params import SamplingParams

        self.llm = LLM(None, max_model_len=1024, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=False)
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        self.rounds = 0
        engine = self.llm.engine
        engine.add_request("warm-up", list(range(100, 116)), SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()

    def __call__(self, prompts: list[list[int]]) -> tuple[float, str]:
        engine = self.llm.engine
        self.rounds += 1
        steps_before, largest_batch, done = engine.stats.steps, 0, 0
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"round{self.rounds}-{i}", prompt, self.params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert len(out.token_ids) == self.params.max_tokens
                    done += 1
            largest_batch = max(largest_batch, engine.scheduler.num_running)
        elapsed = time.perf_counter() - start
        assert done == len(prompts)
        return elapsed, (f"{engine.stats.steps - steps_before} steps, up to {largest_batch} "
                         f"requests per step, {engine.num_preemptions} preemptions so far")


class TransformersRunner:
    def __init__(self, args) -> None:
        import transformers

        from kvmem.engine.loader import resolve_model

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            resolve_model(None).path, dtype=torch.float32).eval()
        self.config = transformers.GenerationConfig(
            max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
            eos_token_id=None, pad_token_id=0)
        self.batch_size = args.hf_batch_size
        self.output_len = args.output_len
        self._generate([list(range(100, 116))])  # warm-up

    def _generate(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))  # left padding, as decoder-only generation needs
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            return self.model.generate(ids, attention_mask=mask, generation_config=self.config)

    def __call__(self, prompts: list[list[int]]) -> tuple[float, str]:
        batches = [prompts[i:i + self.batch_size]
                   for i in range(0, len(prompts), self.batch_size)]
        start = time.perf_counter()
        for batch in batches:
            out = self._generate(batch)
            assert out.shape[1] - max(map(len, batch)) == self.output_len
        elapsed = time.perf_counter() - start
        padded = sum(max(map(len, batch)) * len(batch) for batch in batches)
        return elapsed, f"{padded} prompt tokens after padding"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=8,
                   help="prompts per padded transformers batch (in arrival order)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2, help="runs of each engine, alternating")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)

    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, 49152, args.seed)
    total_out = args.num_requests * args.output_len
    print(f"{args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
          f"({sum(map(len, prompts))} in all), {args.output_len} output tokens each, "
          f"torch threads {torch.get_num_threads()}")
    runners = {"transformers": TransformersRunner(args), "kvmem": KvmemRunner(args)}
    print(f"kvmem: {runners['kvmem'].llm.engine.num_blocks} KV blocks, max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}; "
          f"transformers: padded batches of {args.hf_batch_size}")
    totals = dict.fromkeys(runners, 0.0)
    for r in range(1, args.rounds + 1):
        for name, run in runners.items():
            elapsed, detail = run(prompts)
            totals[name] += elapsed
            print(f"round {r} {name:<12} {elapsed:7.1f} s  {total_out / elapsed:6.1f} output "
                  f"tok/s  ({detail})")
    for name, t in totals.items():
        print(f"{name:<12} total {t:7.1f} s  {args.rounds * total_out / t:6.1f} output tok/s")
    print(f"ratio kvmem / transformers: {totals['transformers'] / totals['kvmem']:.2f}x")


if __name__ == "__main__":
    main()
