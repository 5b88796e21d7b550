"""Sample groups: the n (or best_of) sequences of one request, sharing its prompt's KV.

The request itself is sample 0. When its prompt has been computed (it samples its first
token), the group forks: each other sample is a child request with the same prompt that
takes references on the parent's full prompt blocks (``KVCacheManager.fork``) and
recomputes only the block holding the last prompt token, from which it samples with its
own generator. From then on the samples are ordinary requests to the scheduler (each can
be preempted, offloaded, aborted or finish on its own; shared blocks live until the last
reference goes). A child that cannot fork (no capacity, or a sliding-window model) waits
in the queue like any request, where a prefix-cache hit may still share the prompt.

The engine reports a group as one RequestOutput with one CompletionOutput per sample.
"""

from __future__ import annotations

import dataclasses

from kvmem.engine.outputs import CompletionOutput, RequestOutput
from kvmem.engine.request import Request


class SampleGroup:
    def __init__(self, parent: Request) -> None:
        self.parent = parent
        self.size = parent.sampling_params.num_samples
        self.members: list[Request] = [parent]
        self.forked = False
        self.latest: dict[int, CompletionOutput] = {}

    @property
    def request_id(self) -> str:
        return self.parent.request_id

    @property
    def finished(self) -> bool:
        """Every sample finished (or the parent ended before it could fork)."""
        return all(m.is_finished for m in self.members) and \
            (self.forked or self.parent.is_finished)

    def make_children(self) -> list[Request]:
        """Samples 1 .. size-1: the parent's prompt and settings, seeds ``seed + i``."""
        parent = self.parent
        children = []
        for i in range(1, self.size):
            params = dataclasses.replace(parent.sampling_params, prompt_logprobs=None)
            if params.seed is not None:
                params.seed = (params.seed + i) % (1 << 64)
            child = Request(f"{parent.request_id}#{i}", parent.prompt_token_ids, params,
                            prompt=parent.prompt, cache_salt=parent.cache_salt,
                            arrival_time=parent.arrival_time,
                            eos_token_ids=parent.eos_token_ids)
            child.parent_id, child.sample_index = parent.request_id, i
            child.lora_name = parent.lora_name
            children.append(child)
        self.members.extend(children)
        self.forked = True
        return children

    def output(self, advanced: dict[int, CompletionOutput]) -> RequestOutput:
        """The group's output after a step in which the samples of ``advanced`` moved."""
        self.latest.update(advanced)
        completions = []
        for i in range(self.size if self.forked else 1):
            if i in advanced:
                completions.append(advanced[i])
            elif i in self.latest:  # unchanged this step: no delta
                last = self.latest[i]
                completions.append(dataclasses.replace(
                    last, delta_text="", delta_token_ids=[],
                    delta_logprobs=[] if last.delta_logprobs is not None else None))
            else:
                completions.append(CompletionOutput(text="", token_ids=[], index=i))
        for i, c in enumerate(completions):
            c.index = i
        finished = self.finished
        params = self.parent.sampling_params
        if finished and params.best_of is not None and params.best_of > params.n:
            completions = sorted(completions, key=lambda c: c.cumulative_logprob or 0.0,
                                 reverse=True)[:params.n]
            completions = [dataclasses.replace(c, index=i) for i, c in enumerate(completions)]
        parent = self.parent
        failed = next((m for m in self.members if m.error), None)
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, outputs=completions,
                             finished=finished, num_cached_tokens=parent.num_cached_tokens,
                             error=failed.error if failed else None,
                             failure=failed.failure if failed else None,
                             prompt_logprobs=parent.prompt_logprobs)
