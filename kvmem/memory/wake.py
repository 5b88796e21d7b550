"""Waking an engine the moment another engine on its device asks it for memory.

Every engine with a ledger entry listens on an abstract unix datagram socket
(``WakeListener``) whose name follows from the ledger file, the engine's name and its
process (``address``: no field of the file names it, so no content of the file can steer
a send anywhere but to another engine's wake-up socket). An engine short of memory
writes its ask into the ledger, then sends one empty datagram to each engine it asked
(``wake``); the listener's thread calls the engine back at once, and the engine reads
its ask from the ledger as it always does. A datagram carries nothing else, and any
local process can send one (abstract sockets have no permissions): a wake-up is only a
hint to look at the ledger. The listener drains every datagram queued by the time it
calls back, and calls back at most once per ``MIN_GAP_S``, so a flood costs the engine
no more than that many looks at the ledger (and the kernel's bounded queue).

A send never waits: a full queue already holds a wake-up, and a peer that is gone (no
socket bound: ``ECONNREFUSED``) is left to the ledger, which reaps dead engines on every
write. Where the socket cannot be bound (another process holds the name, no abstract
sockets), or with ``KVMEM_MEMORY_WAKE=0``, engines find their asks at their next look
at the ledger instead (every 50 ms), as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("kvmem.memory")
MIN_GAP_S = 0.005  # the least time between two call-backs of one listener


def enabled() -> bool:
    """Whether engines wake each other (``KVMEM_MEMORY_WAKE=0``: they only poll)."""
    return os.environ.get("KVMEM_MEMORY_WAKE", "1") != "0" and hasattr(socket, "AF_UNIX")


def address(ledger: str | Path, name: str, pid: int, start_time: int | None) -> str:
    """The abstract socket name of engine ``name`` (process ``pid`` started at
    ``start_time``) in the ledger file ``ledger``."""
    key = f"{Path(ledger).resolve()}\0{name}\0{pid}\0{start_time}".encode()
    return "\0kvmem-wake-" + hashlib.blake2b(key, digest_size=12).hexdigest()


def wake(addresses: Iterable[str]) -> int:
    """Send each address one empty datagram, never waiting; how many were delivered."""
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                       | socket.SOCK_CLOEXEC) as sock:
        for to in addresses:
            try:
                sock.sendto(b"", to)
                sent += 1
            except OSError:  # gone (reaped by the ledger), or a wake-up already queued
                pass
    return sent


def wake_engines(ledger: str | Path, entries: Iterable[Any]) -> int:
    """Wake the engines of these ledger entries (``name``, ``pid``, ``start_time``)."""
    if not enabled():
        return 0
    return wake(address(ledger, e.name, e.pid, e.start_time) for e in entries)


class WakeListener:
    """Calls ``on_wake()`` on its own thread when datagrams arrive at ``address``: once
    for all those queued by then, and at most once per ``MIN_GAP_S``."""

    def __init__(self, address: str, on_wake: Callable[[], None]) -> None:
        self.address = address
        self.on_wake = on_wake
        self.wakes = 0
        self._stopping = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(address)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name="kvmem-wake", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, address: str, on_wake: Callable[[], None]) -> WakeListener | None:
        """A listener, or None (logged) where engines cannot wake this one."""
        if not enabled():
            return None
        try:
            return cls(address, on_wake)
        except OSError as e:
            log.warning("cannot listen for KV memory wake-ups (%s); asks from other engines "
                        "are found at the next look at the ledger", e.strerror or e)
            return None

    def _run(self) -> None:
        called = -MIN_GAP_S
        while True:
            try:
                self._sock.recv(1)
            except OSError:
                return
            time.sleep(max(0.0, called + MIN_GAP_S - time.monotonic()))
            self._drain()
            if self._stopping:
                return
            self.wakes += 1
            called = time.monotonic()
            try:
                self.on_wake()
            except Exception:  # never end the listener; the engine's poll remains
                log.exception("KV memory wake-up")

    def _drain(self) -> None:
        """Discard the datagrams queued now: one call-back answers them all."""
        try:
            while True:
                self._sock.recv(1, socket.MSG_DONTWAIT)
        except OSError:  # empty (or closed: the next receive ends the thread)
            pass

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        wake([self.address])  # unblocks the receive
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._sock.close()
