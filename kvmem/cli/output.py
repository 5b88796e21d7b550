"""Standard output for commands that print reports: a reader that goes away early (``kvmem
top --json | head``) ends the command quietly, with the status of a process SIGPIPE
ended (``PIPE_CLOSED``), and characters the output's encoding lacks
(``PYTHONIOENCODING=ascii``, a C locale) are replaced by ``?``, never raised on; output
that cannot be written (``> /dev/full``) is one error line::

    with guarded_stdout() as written:
        print(report)
    if written.closed_early:
        return PIPE_CLOSED
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from kvmem.errors import KvmemError

PIPE_CLOSED = 128 + 13  # as a shell reports a process SIGPIPE ended


@dataclass
class Written:
    closed_early: bool = False  # the reader closed the pipe before the end


@contextlib.contextmanager
def guarded_stdout() -> Iterator[Written]:
    """What is printed within goes out as described above; ``closed_early`` says
    whether the reader went away."""
    written = Written()
    stream = sys.stdout
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        with contextlib.suppress(io.UnsupportedOperation, ValueError):
            reconfigure(errors="replace")
    try:
        yield written
        stream.flush()
    except BrokenPipeError:
        written.closed_early = True
        _drop_buffered(stream)
    except OSError as exc:  # a full disk, a device gone
        _drop_buffered(stream)
        raise KvmemError(f"cannot write the output: {exc.strerror or exc}") from None


def _drop_buffered(stream: TextIO) -> None:
    """What is still buffered would fail again when Python flushes it at exit."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
