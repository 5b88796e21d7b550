"""The garbage collector told to leave a serving process's startup heap alone.

A serving process builds most of what it will ever hold before its first request: the
model's modules and parameters, the tokenizer, the block pool's tables, the imported
libraries. Python's oldest-generation collection walks every tracked object each time,
so with that heap a collection during serving took 134-144 ms in ``kvmem serve`` (the
tiny model of ``benchmarks/elastic_sharing.py``, 2-core AMD EPYC Zen 4): a step, or an
answer to another engine's ask for memory, waited that long. ``freeze_startup_heap``
collects once and moves what is left to the collector's permanent generation
(``gc.freeze``), so later collections walk only what serving allocates (a 3 ms oldest
collection in the same run). vLLM's engine process does the same after its start-up.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then keep every object alive now out of later collections; the
    number of objects frozen. Call once the engine is built, before it serves."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("garbage collector: %d start-up objects frozen", frozen)
    return frozen
