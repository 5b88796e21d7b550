"""Sampler: next tokens from last-position logits (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmem.engine.sampling_params import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's logits sorted descending with tokens outside top-k / top-p set to -inf.

    Returns ``(sorted_logits, sorted_token_ids)``. Top-p keeps the smallest prefix whose
    probability reaches ``top_p`` (always at least the most likely token).
    """
    sorted_logits, sorted_ids = logits.sort(descending=True)
    if 0 < top_k < sorted_logits.numel():
        sorted_logits[top_k:] = float("-inf")
    if top_p < 1.0:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_logits[mass_before >= top_p] = float("-inf")
    return sorted_logits, sorted_ids


class Sampler:
    """Picks one token per row of logits.

    A request with a seed samples from its own ``torch.Generator``, so its output does not
    depend on batch composition or on other requests; unseeded requests share the
    engine's generator (seeded by ``EngineConfig.seed``).
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
        """``logits`` float32 ``[N, vocab]``; ``generators[i]`` is row i's own generator or None."""
        token_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):  # the common fast path: no sort, no softmax
            return token_ids.tolist()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = logits[i].float() / p.temperature
            sorted_logits, sorted_ids = filter_top_k_top_p(row, p.top_k, p.top_p)
            probs = sorted_logits.softmax(-1)
            gen = generators[i] or self.shared_generator(logits.device)
            choice = torch.multinomial(probs, 1, generator=gen)
            token_ids[i] = sorted_ids[choice[0]]
        return token_ids.tolist()
