"""What the vLLM benchmarks share: the keyword arguments of one ``vllm.LLM`` on kvmem's
embedded model in fp32 (eager, 2,048-token context), with or without ``KvmemConnector``."""

from __future__ import annotations

from kvmem.integrations.vllm import kv_transfer_config


def engine_kwargs(model: str, extra: dict | None, kv_cache_memory_bytes: int, *,
                  max_num_batched_tokens: int = 0) -> dict:
    """``extra``: the connector's ``kv_connector_extra_config``; None: plain vLLM.
    ``max_num_batched_tokens``: chunked prefill of that many tokens a step (0: vLLM's)."""
    kwargs = dict(model=model, dtype="float32", kv_cache_memory_bytes=kv_cache_memory_bytes,
                  max_model_len=2048, seed=0, enforce_eager=True)
    if max_num_batched_tokens:
        kwargs.update(max_num_batched_tokens=max_num_batched_tokens,
                      enable_chunked_prefill=True)
    if extra is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(**extra)
    return kwargs
