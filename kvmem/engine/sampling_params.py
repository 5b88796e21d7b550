"""SamplingParams: how one request picks its tokens and when it stops, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.engine.errors import InvalidRequestError

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5

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
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be a number in [0, 100]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
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

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # NaN fails
