"""``kvmem generate "prompt"``: one completion from the engine, printed as it is produced."""

from __future__ import annotations

import argparse
import sys


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")


def sampling_params(args: argparse.Namespace):
    from kvmem.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, stop=args.stop,
                          ignore_eos=args.ignore_eos, seed=args.sample_seed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: "
                   "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    from kvmem.engine.config import add_engine_arguments

    add_engine_arguments(p, model_positional=False)
    add_sampling_arguments(p, max_tokens=64)


def stream_text(engine, request_id: str, prompt, params, out=sys.stdout) -> str:
    """Run one request to completion on ``engine``, writing text as it arrives."""
    engine.add_request(request_id, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error:
                from kvmem.errors import KvmemError

                raise KvmemError(output.error)
            out.write(output.outputs[0].delta_text)
            out.flush()
            text = output.text
    return text


def run(args: argparse.Namespace) -> int:
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine

    params = sampling_params(args)
    engine = LLMEngine(EngineConfig.from_args(args))
    try:
        prompt = args.prompt
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        stream_text(engine, "generate-0", prompt, params)
        print()
    finally:
        engine.shutdown()  # writes queued offload stores, stops worker ranks
    return 0
