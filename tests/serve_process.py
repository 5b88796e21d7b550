"""``kvmem serve`` in a subprocess for tests: a port it binds itself, its log lines, up once
/health is 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx

LISTENING = "kvmem: listening on "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``kvmem serve MODEL_DIR ARGS...`` on a free port; raises AssertionError with the log
    if /health does not answer 200 within ``start_s``."""

    def __init__(self, model_dir, *args: str, env: dict[str, str] | None = None,
                 start_s: float = 120) -> None:
        # --port 0: the server binds a port itself and says which; a port picked here and
        # bound later by the server could be taken meanwhile by another process
        cmd = [sys.executable, "-m", "kvmem", "serve", str(model_dir), "--port", "0", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + start_s
        self.base = self._listening_on(deadline)
        self.port = int(self.base.rsplit(":", 1)[1])
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"no /health 200 within {start_s} s:\n" + "".join(self.lines))

    def _listening_on(self, deadline: float) -> str:
        """The URL the server printed once it bound its port."""
        while time.monotonic() < deadline:
            found = next((x for x in list(self.lines) if x.startswith(LISTENING)), None)
            if found is not None:
                return found.removeprefix(LISTENING).strip()
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader's last lines
                break
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError("the server did not say where it listens:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
