"""SamplingParams: how one request picks its tokens and when it stops, validated on creation."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from kvmem.engine.errors import InvalidRequestError

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5

# The most top logprobs a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most samples one request may ask for (n, best_of).
MAX_SAMPLES = 128

# The seeds torch.Generator.manual_seed accepts: any value that fits in 64 bits, signed or
# unsigned (a negative seed is taken modulo 2**64).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1


@dataclass
class SamplingParams:
    """Per-request decoding settings (names follow the OpenAI API and vLLM).

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) and ``top_p == 1`` disable those
    filters. ``seed`` gives the request its own random generator, so its samples do not
    depend on what else is in the batch; it must lie in [-2**63, 2**64 - 1].

    ``n`` samples are drawn for the prompt (``best_of`` of them, keeping the ``n`` with the
    highest cumulative logprob); they share the prompt's KV blocks. With a ``seed``, sample
    ``i`` uses ``seed + i``.

    Logits processors (vLLM's semantics; 0, 1 or empty disable each): ``logit_bias`` adds a
    bias per token id; ``repetition_penalty`` divides positive (multiplies negative) logits
    of tokens seen in the prompt or output (transformers' RepetitionPenaltyLogitsProcessor);
    ``presence_penalty`` / ``frequency_penalty`` subtract a constant / a per-occurrence
    amount for tokens already generated (the OpenAI definition, output tokens only);
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely one;
    ``min_tokens`` (vLLM's): until that many tokens are generated, EOS (unless
    ``ignore_eos``) and ``stop_token_ids`` cannot be sampled and stop strings do not stop.

    ``logprobs``: return the sampled token's log-probability and the ``logprobs`` most likely
    alternatives at every generated position; ``prompt_logprobs`` the same for every prompt
    token after the first. Both come from the log-softmax of the model's raw fp32 logits,
    before any processor or temperature (vLLM's default ``raw_logprobs``).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self._check()

    def _check(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be a number in [0, 100]")
        # checked as the sampler computes with it: 1e-46 is positive, its float32 is 0
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0 \
                or not _float32(self.top_p) > 0.0:
            raise bad("top_p", "must be a number in (0, 1] (and above 0 as a float32)")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if self.seed is not None and not (_is_int(self.seed) and
                                          SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_unicode(s) for s in self.stop):  # a lone surrogate can never match
            raise bad("stop", "must be valid Unicode (no lone surrogates)")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise bad("n", f"must be an integer in [1, {MAX_SAMPLES}]")
        if self.best_of is not None and not (_is_int(self.best_of) and
                                             self.n <= self.best_of <= MAX_SAMPLES):
            raise bad("best_of", f"must be an integer in [n, {MAX_SAMPLES}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be a number in (0, 100]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1]")
        if not all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100
                   for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """How many sequences are generated (``best_of``, else ``n``)."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether any processor changes the logits before temperature and top-k/top-p."""
        return self.has_penalties or bool(self.logit_bias)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _float32(x: float) -> float:
    """``x`` rounded to float32, the precision the sampler computes in."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # NaN fails
