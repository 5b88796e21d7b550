"""What the GPU check scripts share: arguments, a deadline, per-check results, reports.

Every script is run as ``python benchmarks/gpu/<name>.py --device cuda --out DIR [--quick]``
and writes ``DIR/<name>.json`` (figures, and each check's pass/fail with its reason) and
``DIR/<name>.md`` (a markdown section naming the device). A check that fails records the
last lines of its traceback and the script goes on with the next one; a check that would
start after the script's deadline is recorded as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

MiB = 1 << 20


def parse_args(doc: str, budget_s: float, extra: Callable[[argparse.ArgumentParser], None]
               | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--out", required=True, help="folder for <name>.json and <name>.md")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a CPU shake-out)")
    p.add_argument("--budget-s", type=float, default=budget_s,
                   help=f"the script's own deadline (default {budget_s:g} s)")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"
    return args


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "CPU")


class Report:
    """Checks and figures of one script, written as JSON and markdown."""

    def __init__(self, name: str, title: str, args: argparse.Namespace) -> None:
        self.name, self.title, self.args = name, title, args
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []
        self.device = args.device
        try:
            self.device_name = device_name(args.device)
        except Exception as e:  # no device: every check will say so
            self.device_name = f"unavailable ({type(e).__name__}: {e})"
        self.say(f"{name} on {args.device} ({self.device_name}), budget {args.budget_s:g} s"
                 f"{', quick' if args.quick else ''}")
        self.current: str | None = None
        self.cleanups: list[Callable[[], None]] = []  # run by the watchdog before it ends
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        """Past the deadline (and a grace of 10% for cleanup), write what is known, with
        the check that hung, and end the process: the script never outlives its budget."""
        time.sleep(max(0.0, self.deadline - time.monotonic()) + 0.1 * self.args.budget_s)
        self.checks.append({"check": self.current or "(between checks)", "passed": False,
                            "reason": f"the script's deadline of {self.args.budget_s:g} s "
                                      "passed while it ran; stopped"})
        self.write()
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - the process ends anyway
                self.say(f"cleanup failed: {e}")
        os._exit(3)

    def say(self, message: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.start:6.1f}s] {message}", flush=True)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, name: str, fn: Callable[[], tuple[bool, str]], *,
              needs_s: float = 0.0) -> bool:
        """Run one check: ``fn`` returns (passed, reason), passed None where the check
        does not apply; an exception fails it."""
        entry: dict[str, Any] = {"check": name}
        if self.left_s() < needs_s:
            entry.update(passed=None, reason=f"not run: {self.left_s():.0f} s left of the "
                                             f"budget, it needs about {needs_s:.0f} s")
        else:
            self.say(f"check: {name}")
            self.current = name
            began = time.monotonic()
            try:
                passed, reason = fn()  # None: does not apply here (says why)
                entry.update(passed=None if passed is None else bool(passed), reason=reason)
            except BaseException as e:  # noqa: BLE001 - one check's failure ends only it
                if isinstance(e, KeyboardInterrupt):
                    raise
                tail = traceback.format_exc().strip().splitlines()[-6:]
                entry.update(passed=False, reason=f"{type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}", traceback=tail)
            entry["seconds"] = round(time.monotonic() - began, 2)
            self.current = None
        self.checks.append(entry)
        verdict = {True: "PASS", False: "FAIL", None: "N/A"}[entry["passed"]]
        self.say(f"{verdict} {name}: {entry['reason']}")
        return bool(entry["passed"])

    def figure(self, key: str, value: Any) -> Any:
        self.figures[key] = value
        return value

    def write(self, table: str = "") -> int:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"name": self.name, "device": self.device, "device_name": self.device_name,
               "quick": self.args.quick, "seconds": round(time.monotonic() - self.start, 1),
               "passed": all(c["passed"] is not False for c in self.checks),
               "checks": self.checks, "figures": self.figures, "notes": self.notes}
        (out / f"{self.name}.json").write_text(json.dumps(doc, indent=1, default=str))
        quick = ", quick sizes" if self.args.quick else ""
        lines = [f"### {self.title}", "",
                 f"Device: {self.device_name} (`{self.device}`){quick}; {doc['seconds']} s.",
                 "", "| check | result | reason |", "|---|---|---|"]
        for c in self.checks:
            result = {True: "pass", False: "**FAIL**", None: "n/a"}[c["passed"]]
            lines.append(f"| {c['check']} | {result} | {c['reason'].replace('|', '/')} |")
        if table:
            lines += ["", table]
        lines += [""] + [f"- {n}" for n in self.notes]
        (out / f"{self.name}.md").write_text("\n".join(lines) + "\n")
        count = {v: sum(c["passed"] is v for c in self.checks) for v in (True, False, None)}
        self.say(f"wrote {out / self.name}.json and .md: {count[True]} passed, "
                 f"{count[False]} failed, {count[None]} n/a or not run")
        return 0 if doc["passed"] else 1


def write_model(work: Path, name: str, config: dict[str, Any]) -> str:
    """A model directory for ``--load-format dummy``: config.json and a byte-level
    tokenizer.json, no weights."""
    from tiny_models import byte_level_tokenizer_json

    path = work / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    return str(path)


def tiny_llama(work: Path) -> str:
    """The tests' tiny Llama shape (4 heads, 2 KV heads of 64, 4 layers) for dummy weights."""
    return write_model(work, "tiny-llama", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 258})


def qwen3_0_6b(work: Path) -> str:
    """Qwen3-0.6B's shape from kvmem's catalog (rms_norm_eps and rope_theta of its
    config; 40,960 positions as its published config has, for 32k-token prompts)."""
    from kvmem.spec.catalog import catalog_config

    _, config = catalog_config("Qwen3-0.6B")
    return write_model(work, "qwen3-0.6b", {
        **config, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
        "bos_token_id": 256, "eos_token_id": 258})


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def run_child(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one part of a check in a process of its own (a clean device: each engine
    profiles from the same start) and return the JSON it printed on a ``RESULT`` line."""
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"{Path(argv[1]).name} {' '.join(argv[2:4])} exited "
                           f"{done.returncode}: " + " | ".join(tail))
    return json.loads(line[len("RESULT "):])


def print_result(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result, default=str), flush=True)
