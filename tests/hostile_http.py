"""A server on 127.0.0.1 that answers however a test wants, down to the byte (trickled,
endless, not HTTP at all), and a bound on how long a call under test may take."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

Answer = Callable[[socket.socket, bytes], None]  # (connection, request head) -> None


class RawServer:
    """Each connection's request head is read, then ``answer(conn, head)`` writes what it
    likes; ``paths[path]`` picks the answer by path, ``default`` otherwise. ``requests``
    lists the paths asked for."""

    def __init__(self) -> None:
        self.paths: dict[str, Answer] = {}
        self.default: Answer = lambda conn, head: conn.sendall(b"HTTP/1.1 404 Not Found\r\n"
                                                                b"Content-Length: 0\r\n\r\n")
        self.requests: list[str] = []
        self.stopped = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            path = head.split(b" ", 2)[1].decode("latin-1") if head.count(b" ") >= 2 else ""
            self.requests.append(path)
            with contextlib.suppress(OSError):  # the client went away
                self.paths.get(path, self.default)(conn, head)

    def trickle(self, data: bytes, every_s: float = 0.2) -> Answer:
        """An answer that sends ``data`` a byte every ``every_s``, then goes on sending
        ``#`` at that pace until the client leaves: each read gets a byte long before a
        per-read timeout could fire."""
        def answer(conn: socket.socket, head: bytes) -> None:
            for i in range(len(data)):
                conn.sendall(data[i:i + 1])
                if self.stopped.wait(every_s):
                    return
            while not self.stopped.wait(every_s):
                conn.sendall(b"#")
        return answer

    def close(self) -> None:
        self.stopped.set()
        self._sock.close()


def reply(status: str, body: bytes = b"", **headers: str) -> Answer:
    """An answer of ``status`` with ``headers`` (``Content_Type``: ``Content-Type``) and
    ``body``, its length given."""
    lines = [f"HTTP/1.1 {status}", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
             f"Content-Length: {len(body)}"]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    return lambda conn, head: conn.sendall(data)


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result (or its exception), failing the test if it takes more than
    ``seconds``: a hang shows as a failure, never as a test that does not end."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds:g} s"
    if "error" in done:
        raise done["error"]
    return done["result"]
