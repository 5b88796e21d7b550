"""``kvmem serve`` in a subprocess for tests: a free port, its log lines, up once /health is 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``kvmem serve MODEL_DIR ARGS...`` on a free port; raises AssertionError with the log
    if /health does not answer 200 within ``start_s``."""

    def __init__(self, model_dir, *args: str, env: dict[str, str] | None = None,
                 start_s: float = 120) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "kvmem", "serve", str(model_dir), "--port", str(self.port),
               *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"no /health 200 within {start_s} s:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
