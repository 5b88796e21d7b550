"""Errors of a parallel engine; each is one line that names the rank concerned."""

from __future__ import annotations

from kvmem.errors import KvmemError


class ParallelError(KvmemError):
    """A parallel engine cannot go on: a rank failed, died or stopped answering."""


class WorkerDiedError(ParallelError):
    """A worker process exited while the engine was running."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class StartupError(ParallelError):
    """A rank failed while the engine was starting (before it served anything)."""
