"""LLM: the offline batch API.

>>> from kvmem.engine.llm import LLM
>>> from kvmem.engine.sampling_params import SamplingParams
>>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
>>> [out.text for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))]
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

from kvmem.engine.config import EngineConfig
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.outputs import RequestOutput
from kvmem.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs a batch of prompts through one engine with continuous batching."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, show_progress: bool | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # validate everything first so a bad prompt does not leave half a batch queued
        requests = [self.engine.make_request(f"llm-{next(self._ids)}", p, sp)
                    for p, sp in zip(prompts, params, strict=True)]
        order = {r.request_id: i for i, r in enumerate(requests)}
        for request in requests:
            self.engine.add_request(request)
        results: list[RequestOutput | None] = [None] * len(requests)
        with _progress(len(requests), show_progress) as advance:
            while self.engine.has_work():  # and the stores its requests left
                for out in self.engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        advance()
        return [r for r in results if r is not None]

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None,
             **kwargs: Any) -> RequestOutput:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)  # the template has them
        return self.generate([prompt], sampling_params, **kwargs)[0]


class _progress:
    """A rich progress bar over finished requests (shown by default only on a terminal)."""

    def __init__(self, total: int, show: bool | None) -> None:
        self.show = sys.stderr.isatty() if show is None else show
        self.total = total

    def __enter__(self):
        if not self.show:
            return lambda: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), transient=True)
        self._bar.__enter__()
        task = self._bar.add_task("requests", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self.show:
            self._bar.__exit__(*exc)
