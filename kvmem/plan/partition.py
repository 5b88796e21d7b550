"""Pipeline layer partitions: vLLM's default split, validation, and the search used by the
``optimal`` KV budget policy."""

from __future__ import annotations

from collections.abc import Callable

from kvmem.errors import ConfigError


def even_partition(num_layers: int, pp: int) -> list[int]:
    """vLLM's default split: equal stages; the remainder layers go one each to the stages
    before the last, counting backwards from the second-to-last (the last stage also holds
    the LM head, the first the embedding)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def validate_partition(partition: list[int], num_layers: int, pp: int) -> list[int]:
    parts = list(partition)
    shown = format_partition(parts)
    if len(parts) != pp:
        raise ConfigError(f"layer partition {shown} has {len(parts)} stages but "
                          f"pipeline_parallel_size is {pp}")
    if any(not isinstance(p, int) or isinstance(p, bool) or p <= 0 for p in parts):
        raise ConfigError(f"layer partition {shown} has an empty or negative stage; "
                          "every stage needs at least one layer")
    if sum(parts) != num_layers:
        raise ConfigError(f"layer partition {shown} sums to {sum(parts)} but the model "
                          f"has {num_layers} layers")
    return parts


def stage_layers(partition: list[int]) -> list[range]:
    starts = [sum(partition[:s]) for s in range(len(partition))]
    return [range(a, a + n) for a, n in zip(starts, partition, strict=True)]


def parse_partition(text: str, what: str = "layer partition") -> list[int]:
    """Layers per stage from their comma spelling, e.g. ``"56,8"`` -> ``[56, 8]``."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{what} {text!r}: give whole numbers such as 56,8") from None


def format_partition(parts: list) -> str:
    """A partition as the engines' flags and environment variables spell it: ``56,8``."""
    return ",".join(str(p) for p in parts)


# A stage test: (stage index, first layer, end layer) -> does this interval fit for every rank?
StageFits = Callable[[int, int, int], bool]
# Incremental scan: (stage, first layer) -> the largest end layer that fits (first if none).
LongestStage = Callable[[int, int, int], int]


def greedy_partition(num_layers: int, pp: int, longest: LongestStage,
                     fits: StageFits) -> list[int] | None:
    """A partition where every stage fits, filling earlier stages as far as they can take.

    Correct because an interval's fit is monotone (fewer layers never need more memory):
    giving an earlier stage more layers only shortens what later stages must hold.
    """
    parts: list[int] = []
    start = 0
    for s in range(pp - 1):
        limit = num_layers - (pp - s - 1)  # leave one layer for each later stage
        end = longest(s, start, limit)
        if end <= start:
            return None
        parts.append(end - start)
        start = end
    if not fits(pp - 1, start, num_layers):
        return None
    parts.append(num_layers - start)
    return parts


def partition_fits(partition: list[int], fits: StageFits) -> bool:
    return all(fits(s, r.start, r.stop) for s, r in enumerate(stage_layers(partition)))


def best_partition(hi: int, search: Callable[[int], list[int] | None]
                   ) -> tuple[int, list[int]] | None:
    """Largest block count n in [0, hi] for which ``search(n)`` finds a partition, with it.

    ``search`` is monotone in n (a partition that holds n blocks also holds fewer).
    """
    best = search(0)
    if best is None:
        return None
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        parts = search(mid)
        if parts is None:
            hi = mid - 1
        else:
            lo, best = mid, parts
    return lo, best
