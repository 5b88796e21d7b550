"""Executor: runs each scheduled step on every rank and returns rank 0's runner output.

Alone, it calls the runner. With other ranks (``Workers``: the parallel driver, see
``kvmem.engine.distributed.driver``) it first broadcasts the same ``SchedulerOutput`` to
them, then runs rank 0's part; a failed exchange becomes the workers' one error.
"""

from __future__ import annotations

from typing import Protocol

from kvmem.engine.model_runner import ModelRunner
from kvmem.engine.step import ModelRunnerOutput, SchedulerOutput


class Workers(Protocol):
    """The other ranks of a parallel engine, as rank 0 drives them."""

    error: Exception | None  # set once the engine stopped on a failure

    def broadcast(self, out: SchedulerOutput) -> None: ...

    def step_failed(self, exc: BaseException) -> Exception: ...

    def shutdown(self) -> None: ...


class Executor:
    def __init__(self, runner: ModelRunner, workers: Workers | None = None) -> None:
        self.runner = runner
        self.workers = workers

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        workers = self.workers
        if workers is None:
            return self.runner.execute_model(out)
        if workers.error is not None:
            raise workers.error
        try:
            workers.broadcast(out)
            return self.runner.execute_model(out)
        except Exception as e:
            raise workers.step_failed(e) from e

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
