"""The ``kvmem`` command. Each subcommand lives in its own module, imported only when used,
so ``kvmem plan`` never pays for torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvmem.errors import KvmemError

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvmem.cli.plan", "plan per-rank KV-cache memory for a deployment (no GPU needed)"),
    "models": ("kvmem.cli.models", "list the bundled model catalog"),
    "ui": ("kvmem.cli.ui", "the planner as a web page and a JSON API (no GPU needed)"),
    "generate": ("kvmem.cli.generate", "generate text from a prompt with the kvmem engine"),
    "chat": ("kvmem.cli.chat", "interactive chat with the kvmem engine"),
    "serve": ("kvmem.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "profile": ("kvmem.cli.profile", "measure a model's memory profile and suggest a KV budget"),
    "top": ("kvmem.cli.top", "show engines sharing elastic KV memory on this machine"),
    "limit": ("kvmem.cli.limit", "change an engine's elastic KV memory limit while it runs"),
    "vllm-check": ("kvmem.cli.vllm_check",
                   "which parts of kvmem's vLLM integration work with the installed vLLM"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"kvmem: error: {message}\n")


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    parser = _Parser(prog="kvmem", description="KV-cache memory for LLM serving.")
    from kvmem import __version__

    parser.add_argument("--version", action="version", version=f"kvmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (mod_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen command's module is imported
            module = importlib.import_module(mod_name)
            module.add_arguments(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        if module is None:
            parser.print_help()
            return 2
        return int(module.run(args) or 0)
    except KvmemError as e:
        print(f"kvmem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
