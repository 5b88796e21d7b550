"""``kvmem chat``: an interactive conversation with the engine (Ctrl-D or /exit to leave)."""

from __future__ import annotations

import argparse
import sys

from kvmem.cli.generate import add_sampling_arguments, sampling_params, stream_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvmem.engine.config import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p, max_tokens=256)


def run(args: argparse.Namespace) -> int:
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine

    params = sampling_params(args)
    engine = LLMEngine(EngineConfig.from_args(args))
    try:
        tokenizer = engine.tokenizer
        messages = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"kvmem chat with {engine.model_name} (/reset clears the history, /exit leaves)")
        turn = 0
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() in ("/exit", "/quit"):
                break
            user = line.strip()
            if not user:
                continue
            if user == "/reset":
                messages = messages[:1] if args.system else []
                continue
            messages.append({"role": "user", "content": user})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
            reply = stream_text(engine, f"chat-{turn}", prompt_ids, params)
            print(flush=True)
            messages.append({"role": "assistant", "content": reply})
            turn += 1
    finally:
        engine.shutdown()  # writes queued offload stores, stops worker ranks
    return 0
