"""AsyncLLMEngine: runs LLMEngine steps on a background thread for an asyncio server.

Requests are validated on the caller's thread (so bad input fails before a response
starts), then handed to the engine thread through a queue of typed commands
(``AddRequest``, ``AbortRequest``, ``AbortAll``). Outputs come back to
each request's ``asyncio.Queue`` on the event loop that asked for them. The model's
forward pass releases the GIL, so the event loop keeps serving while the engine steps.
Elastic KV memory gives back what other engines ask for on this thread too, between
steps: its memory thread only wakes the loop (``LLMEngine.wake_for_memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvmem.engine.llm_engine import EngineSnapshot, LLMEngine
from kvmem.engine.outputs import RequestOutput
from kvmem.engine.request import Request
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import KvmemError

logger = logging.getLogger("kvmem.engine")


class EngineError(KvmemError):
    """The engine could not finish a request (a failed step, or shutdown)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True)
class AddRequest:
    """Admit a validated request (made by ``make_request`` on the caller's thread)."""

    request: Request


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request whose consumer went away."""

    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """Fail every request with ``message`` (the server is draining)."""

    message: str


EngineCommand = AddRequest | AbortRequest | AbortAll


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._ready = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._thread = threading.Thread(target=self._run, name="kvmem-engine", daemon=True)
        self.snapshot: EngineSnapshot = engine.snapshot()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.wait(timeout=30)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def abort_all(self, reason: str) -> None:
        """Refuse new requests and fail every running one with EngineError(``reason``), so
        each open response ends with an error (a server's last step before it stops).
        Thread-safe; the engine thread keeps running until shutdown()."""
        self._draining.set()
        self._send(AbortAll(reason))

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._thread.is_alive() and not self._stopping.is_set() \
            and not self._draining.is_set()

    # -- requests -------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Tokenize and validate (raises InvalidRequestError / PromptTooLongError)."""
        return self.engine.make_request(request_id or uuid.uuid4().hex, prompt, params,
                                        cache_salt=cache_salt)

    async def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs of ``request`` as it advances; aborts it if the consumer stops early."""
        if self._draining.is_set():
            raise EngineError("the server is shutting down")
        if not self.is_ready:
            raise EngineError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        self._send(AddRequest(request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:  # client went away or the task was cancelled
                self._send(AbortRequest(request.request_id))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> RequestOutput:
        """The final output of one request."""
        outputs = [out async for out in self.stream(self.make_request(prompt, params, request_id))]
        return outputs[-1]

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        # elastic memory gives back here, between steps; its thread only wakes the loop
        self.engine.wake_for_memory(self._wakeup.set)
        try:
            self._loop()
        finally:
            self.engine.wake_for_memory(None)  # no loop: its memory thread gives back

    def _loop(self) -> None:
        self._ready.set()
        while not self._stopping.is_set():
            self.engine.apply_memory()
            self._apply_commands()
            if not self.engine.has_work():
                self._wakeup.wait(self._idle_poll_s)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not take the server down: fail what runs
                logger.exception("engine step failed; failing the running requests")
                outputs = self._fail_all(f"engine error: {e}")
            self.snapshot = self.engine.snapshot()
            for output in outputs:
                self._deliver(output.request_id, output)
        self._fail_all("engine error: the server is shutting down")

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddRequest) and self._draining.is_set():
                # sent just before abort_all
                self._deliver(command.request.request_id,
                              EngineError("the server is shutting down"))
            elif isinstance(command, AddRequest):
                try:
                    self.engine.add_request(command.request)
                except KvmemError as e:
                    self._deliver(command.request.request_id, e)
            elif isinstance(command, AbortRequest):
                self.engine.abort_request(command.request_id)
            else:
                self._fail_all(command.message)
        self.snapshot = self.engine.snapshot()

    def _fail_all(self, message: str) -> list[RequestOutput]:
        ids = list(self.engine.requests)
        try:
            self.engine.abort_request(ids)
        except Exception:  # pragma: no cover - the engine state is already broken
            logger.exception("could not abort requests after a failed step")
        for request_id in ids:
            self._deliver(request_id, EngineError(message))
        return []

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
