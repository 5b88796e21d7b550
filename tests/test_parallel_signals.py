"""Stopping a served tp 2 engine the way terminals, systemd and ``timeout`` do: a signal
sent to the server's whole process group is a clean shutdown (exit 0, no rank reported
dead, no process left), and a worker whose driver is killed exits by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from serve_process import LISTENING
from tiny_models import make_tiny_checkpoint

TINY = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("signals"), "llama", **TINY)


class GroupServer:
    """``kvmem serve -tp 2`` as the leader of its own process group (a new session)."""

    def __init__(self, model_dir, start_s: float = 120) -> None:
        cmd = [sys.executable, "-m", "kvmem", "serve", str(model_dir), "--port", "0",
               "--max-model-len", "128", "--kv-cache-memory-bytes", "1MiB", "-tp", "2",
               "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline and self.proc.poll() is None and not self._base():
            time.sleep(0.05)
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self._base()}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.kill()
        raise AssertionError("no /health 200:\n" + "".join(self.lines))

    def _base(self) -> str | None:
        """The URL the server printed once it bound its port (``--port 0``)."""
        line = next((x for x in list(self.lines) if x.startswith(LISTENING)), None)
        return line.removeprefix(LISTENING).strip() if line else None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def worker(self) -> psutil.Process:
        line = next(x for x in self.lines if "tp rank 1): worker pid" in x)
        return psutil.Process(int(line.split()[-1]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _all_gone(procs: list[psutil.Process], within_s: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_is_a_clean_shutdown(model_dir, sig):
    server = GroupServer(model_dir)
    try:
        children = server.descendants()
        assert server.worker() in children
        os.killpg(server.proc.pid, sig)
        assert server.proc.wait(timeout=30) == 0, "".join(server.lines)
        log = "".join(server.lines)
        assert "died" not in log and "error" not in log.lower()
        assert _all_gone(children, within_s=10)
    finally:
        server.kill()


def test_a_worker_exits_by_itself_when_its_driver_is_killed(model_dir):
    server = GroupServer(model_dir)
    try:
        worker = server.worker()
        server.proc.send_signal(signal.SIGKILL)  # the driver only: no shutdown message
        server.proc.wait(timeout=10)
        assert _all_gone([worker], within_s=5)
    finally:
        server.kill()
