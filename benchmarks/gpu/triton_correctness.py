"""Triton paged attention against the reference backend, and CUDA graphs against eager,
through kvmem's engine on the tests' tiny random models.

    python benchmarks/gpu/triton_correctness.py --device cuda --out DIR

fp32: greedy tokens of the Triton backend (eager and with decode CUDA graphs) equal the
reference backend's, for every tiny family (llama; qwen2 and mistral with sliding windows;
qwen3 with q/k norm), prompts of several blocks and a small step budget so that prefill
runs in chunks over cached context. bf16: the log-probabilities of the same token
sequence from the two backends, over prefill positions (prompt logprobs) and decode
positions, differ by at most the stated tolerance.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.gpu.report import Report  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
BF16_LOGPROB_TOLERANCE = 0.1  # nats; bf16 keeps 8 bits of mantissa


def prompts() -> list[list[int]]:
    """Lengths around block and chunk edges (block 16, step budget 64)."""
    return [[256, *range(10, 10 + n)] for n in (3, 15, 16, 40, 100, 150)]


def run(model: str, device: str, dtype: str, backend: str, eager: bool, *, max_tokens: int,
        prompt_logprobs: int | None = None, logprobs: int | None = None,
        prompt_list: list[list[int]] | None = None):
    import torch

    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    llm = LLM(model, device=device, dtype=dtype, attention_backend=backend,
              enforce_eager=eager, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=64, max_num_seqs=8)
    graphs = llm.engine.model_runner.cuda_graphs is not None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=prompt_logprobs, logprobs=logprobs)
    outs = llm.generate(prompt_list or prompts(), params)
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return outs, graphs


def fp32_tokens(report: Report, family: str, model: str, device: str) -> None:
    on_cuda = device.startswith("cuda")
    with report.check(f"fp32 {family}: triton tokens == reference tokens (eager)"):
        ref, _ = run(model, device, "float32", "reference", True, max_tokens=20)
        tri, _ = run(model, device, "float32", "triton", True, max_tokens=20)
        ref_t = [o.outputs[0].token_ids for o in ref]
        tri_t = [o.outputs[0].token_ids for o in tri]
        assert tri_t == ref_t, f"first differing prompt {_first_diff(ref_t, tri_t)}"
    if on_cuda:
        with report.check(f"fp32 {family}: CUDA graphs tokens == eager tokens"):
            graph, captured = run(model, device, "float32", "triton", False, max_tokens=20)
            assert captured, "no CUDA graphs were captured"
            assert [o.outputs[0].token_ids for o in graph] == ref_t


def bf16_logprobs(report: Report, family: str, model: str, device: str) -> None:
    with report.check(f"bf16 {family}: triton logprobs within {BF16_LOGPROB_TOLERANCE} "
                      "of reference"):
        ref, _ = run(model, device, "bfloat16", "reference", True, max_tokens=16,
                     prompt_logprobs=1, logprobs=1)
        tri, _ = run(model, device, "bfloat16", "triton", True, max_tokens=16,
                     prompt_logprobs=1, logprobs=1)
        prefill, decode, same = 0.0, 0.0, 0
        for r, t in zip(ref, tri, strict=True):
            for a, b in zip(r.prompt_logprobs[1:], t.prompt_logprobs[1:], strict=True):
                prefill = max(prefill, abs(a.logprob - b.logprob))
            ra, ta = r.outputs[0], t.outputs[0]
            for i, (a, b) in enumerate(zip(ra.logprobs, ta.logprobs, strict=True)):
                if ra.token_ids[:i + 1] != ta.token_ids[:i + 1]:
                    break  # a near tie went the other way: later positions differ in context
                decode = max(decode, abs(a.logprob - b.logprob))
            same += ra.token_ids == ta.token_ids
        report.figure(f"bf16 {family} max |dlogprob| prefill", round(prefill, 5))
        report.figure(f"bf16 {family} max |dlogprob| decode", round(decode, 5))
        report.figure(f"bf16 {family} prompts with identical greedy tokens",
                      f"{same}/{len(ref)}")
        assert max(prefill, decode) <= BF16_LOGPROB_TOLERANCE


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), -1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="llama only")
    args = p.parse_args()
    from tiny_models import make_tiny_checkpoint

    report = Report("triton_correctness", args.out, args.device)
    report.line(f"bf16 tolerance: {BF16_LOGPROB_TOLERANCE} nats on the chosen token's "
                "log-probability, prefill and decode positions.")
    tmp = Path(tempfile.mkdtemp(prefix="kvmem-tiny-"))
    for family in FAMILIES[:1] if args.quick else FAMILIES:
        model = str(make_tiny_checkpoint(tmp, family))
        fp32_tokens(report, family, model, args.device)
        bf16_logprobs(report, family, model, args.device)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
