"""Sampler: next tokens from last-position logits.

Per row, in vLLM's order: logit bias and the repetition, frequency and presence penalties
(which change the greedy choice too), then temperature, min-p, top-k and top-p, then a draw
from the row's own generator (seeded requests) or the engine's.

A row is one request's: when its processing fails, that row alone gets ``FAILED`` and a
``RequestFailed`` naming the stage (logit bias, penalties, sampling); the other rows are
sampled as if it were not there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmem.engine.errors import RequestFailed, request_stage
from kvmem.engine.sampling_params import SamplingParams

FAILED = -1  # the token id of a row whose request failed in the sampler


@dataclass
class Samples:
    """One token per row (``FAILED`` for a failed row) and why each failed row failed."""

    token_ids: list[int]
    failures: dict[int, RequestFailed] = field(default_factory=dict)  # row -> its error


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
        drop = mass_before >= top_p
        drop[0] = False  # the most likely token, whatever top_p rounds to
        sorted_logits[drop] = float("-inf")
    return sorted_logits, sorted_ids


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float]) -> torch.Tensor:
    """``logits`` (one row, modified in place) plus each token's bias."""
    device = logits.device
    ids = torch.tensor(list(logit_bias), dtype=torch.long, device=device)
    return logits.index_add_(0, ids, torch.tensor(list(logit_bias.values()),
                                                  dtype=logits.dtype, device=device))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """``logits`` (one row, modified in place) with the penalties applied.

    Repetition: every token in the prompt or output has a positive logit divided by the
    penalty, a negative one multiplied. Frequency / presence (OpenAI): minus
    ``frequency * count + presence * (count > 0)`` over the generated tokens.
    """
    vocab = logits.shape[-1]
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.long, device=device)
        scores = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long, device=device),
                                minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """``logits`` (one row, in place) with tokens below ``min_p`` x the top probability at -inf."""
    probs = logits.softmax(-1)
    logits[probs < min_p * probs.max()] = float("-inf")
    return logits


def _temperature_only(p: SamplingParams) -> bool:
    """Random sampling that only scales the logits: no bias, penalties, min-p, top-k, top-p."""
    return (not p.greedy and not p.processes_logits and p.min_p == 0.0
            and p.top_k <= 0 and p.top_p >= 1.0)


def _finite_(row: torch.Tensor) -> torch.Tensor:
    """``row`` in place with overflow (a tiny repetition penalty or temperature dividing
    large logits) clamped to the largest float and NaN at -inf: a valid distribution."""
    return torch.nan_to_num_(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)


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
                 generators: Sequence[torch.Generator | None],
                 histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                 banned: Sequence[Sequence[int] | None] | None = None) -> Samples:
        """``logits`` float32 ``[N, vocab]`` (left unchanged); ``generators[i]`` is row i's own
        generator or None; ``histories[i]`` row i's (prompt, output) token ids, which
        penalties need; ``banned[i]`` token ids row i must not pick (``min_tokens``)."""
        banned = banned or [None] * len(params)
        token_ids = logits.argmax(dim=-1)
        if all(p.greedy and not p.processes_logits and not b
               for p, b in zip(params, banned, strict=True)):  # the common fast path
            return Samples(token_ids.tolist())
        if histories is None and any(p.has_penalties for p in params):
            raise ValueError("penalties need the token histories")
        failures = {}
        plain = [i for i, (p, g, b) in enumerate(zip(params, generators, banned, strict=True))
                 if _temperature_only(p) and g is None and not b]
        if plain:
            token_ids[plain] = self._sample_rows(logits[plain], [params[i] for i in plain])
        batched = set(plain)
        for i, p in enumerate(params):
            if p.greedy and not p.processes_logits and not banned[i] or i in batched:
                continue
            try:
                token_ids[i] = self._sample_row(logits[i], p, generators[i],
                                                histories[i] if histories else ((), ()),
                                                banned[i])
            except RequestFailed as exc:
                failures[i] = exc
                token_ids[i] = FAILED
        return Samples(token_ids.tolist(), failures)

    def _sample_rows(self, logits: torch.Tensor, params: Sequence[SamplingParams]
                     ) -> torch.Tensor:
        """Rows that only scale by a temperature, from the shared generator, in a few
        kernels for the whole batch (a row at a time, a batch of 256 launched thousands):
        the row's argmax of ``probs / E`` with ``E ~ Exp(1)`` is a draw from ``probs``."""
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                   device=logits.device)
        probs = _finite_(logits.float() / temperature[:, None]).softmax(-1)
        race = torch.empty_like(probs).exponential_(
            generator=self.shared_generator(logits.device))
        return (probs / race).argmax(-1)

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams,
                    generator: torch.Generator | None,
                    history: tuple[Sequence[int], Sequence[int]],
                    banned: Sequence[int] | None = None) -> torch.Tensor:
        """Row's token id as a 0-d tensor: read back with the batch's, one device sync."""
        row = logits.float().clone()
        if banned:  # ids the model has (an EOS id of a larger tokenizer is not in the row)
            ids = [t for t in banned if t < row.numel()]
            row[torch.tensor(ids, dtype=torch.long, device=row.device)] = float("-inf")
        if p.logit_bias:
            with request_stage("logit_bias"):
                apply_logit_bias(row, p.logit_bias)
        if p.has_penalties:
            with request_stage("penalties"):
                apply_penalties(row, p, *history)
        if p.processes_logits:
            _finite_(row)
        if p.greedy:
            return row.argmax()
        with request_stage("sampling"):
            row /= p.temperature
            _finite_(row)
            if p.min_p > 0.0:
                apply_min_p(row, p.min_p)
            sorted_logits, sorted_ids = filter_top_k_top_p(row, p.top_k, p.top_p)
            probs = sorted_logits.softmax(-1)
            gen = generator or self.shared_generator(logits.device)
            choice = torch.multinomial(probs, 1, generator=gen)
            return sorted_ids[choice[0]]
