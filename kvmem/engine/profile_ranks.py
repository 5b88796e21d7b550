"""``kvmem profile``'s engine side: start every rank of a layout only to measure it.

>>> profile = profile_memory(EngineConfig(model=None, max_num_batched_tokens=512))
>>> profile.suggested_kv_bytes_fit, profile.suggested_kv_bytes_whole
>>> profile.save("profile.json")  # `kvmem plan MODEL --profile profile.json` reads it

The ranks are brought up by ``kvmem.engine.rank_builder.load_rank``, the code an engine's
ranks run while they start, so a profile measures what the engine measures: each rank's
shard, its forward, its sampler (last stage), its CUDA graphs (world size 1 on a GPU).
"""

from __future__ import annotations

from kvmem.engine.config import EngineConfig
from kvmem.engine.memory_profile import MemoryProfile
from kvmem.errors import ConfigError


def check_profilable(config: EngineConfig) -> None:
    """Refuse, with one line naming what to do instead, the settings a profile of one
    process cannot measure or that it would silently ignore."""
    if config.kv_cache_memory_bytes is not None:
        raise ConfigError("kvmem profile measures what is left for the KV cache; "
                          "--kv-cache-memory-bytes would only be ignored: drop it")
    if config.kv_memory != "plain":
        raise ConfigError(f"kvmem profile does not measure --kv-memory {config.kv_memory}: "
                          f"profile without it and pass the suggested budget to the engine "
                          f"that uses it")
    if config.cpu_offload_gib or config.disk_offload_dir or config.disk_offload_gib:
        raise ConfigError("kvmem profile does not measure the KV offload tiers (host memory "
                          "and disk, not device memory): profile without --cpu-offload-gib "
                          "and --disk-offload-*")


def profile_memory(config: EngineConfig) -> MemoryProfile:
    """Load ``config``'s model in one process and measure its memory (see module doc)."""
    return profile_ranks(config)[0]


def profile_ranks(config: EngineConfig) -> list[MemoryProfile]:
    """Start every rank of ``config``'s tp x pp layout only to measure it, the way an engine
    measures its ranks while it starts; one profile per rank, in rank order.

    Raises ConfigError for settings a profile cannot measure (``check_profilable``).
    """
    check_profilable(config)
    from kvmem.engine.loader import resolve_model
    from kvmem.engine.rank_builder import Alone, load_rank, rank_context
    from kvmem.spec import spec_from_config

    files = resolve_model(config.model, load_format=config.load_format)
    files.tokenizer  # noqa: B018 (part of the runtime a server holds, so measured at start)
    ctx = rank_context(config, spec_from_config(files.config, files.name), profile_only=True)
    if ctx.parallel.world_size == 1:
        return load_rank(ctx, Alone()).profiles
    from kvmem.engine.distributed.driver import start_parallel

    driver = start_parallel(ctx)
    try:
        return driver.profiles
    finally:
        driver.shutdown()
