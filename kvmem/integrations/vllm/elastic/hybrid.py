"""Elastic KV memory on hybrid linear-attention models (Gated DeltaNet, Mamba2 beside full
attention): what differs from an attention-only model.

vLLM gives a hybrid's state layers (``MambaSpec``) pages of the attention page's size in
the same KV tensors, so a block id is a page of every group and the elastic pool maps,
credits and reclaims state pages as it does attention blocks. Two figures differ:

- a pipeline stage's KV bytes per block follow the KV tensors vLLM gives its layers (one
  per layer of its largest group), not its share of the model's layers: a stage of MLP
  and state layers may hold as many tensors as a longer one. The scheduler, which sees
  only its own stage, reads every stage's from kvmem's plan of the deployment under vLLM's
  rules (``kvmem.plan.vllm_rules``);
- a state group's block size is the attention one only with prefix caching (vLLM's
  ``align`` mode; without it the state's "block" spans the whole request), so the tokens a
  block holds are read from the attention groups.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from kvmem.errors import KvmemError

log = init_logger("vllm.kvmem.elastic")


def state_groups(kv_cache_config: Any) -> int:
    """How many of the KV cache groups hold per-request states."""
    return sum(type(g.kv_cache_spec).__name__ == "MambaSpec"
               for g in kv_cache_config.kv_cache_groups)


def attention_block_size(kv_cache_config: Any) -> int:
    """Tokens per block of the attention groups (of any group when there is none)."""
    groups = kv_cache_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups
             if type(g.kv_cache_spec).__name__ != "MambaSpec"]
    return min(sizes or [g.kv_cache_spec.block_size for g in groups])


def planned_rank_block_bytes(vllm_config: Any, kv_cache_config: Any, own: int
                             ) -> list[int] | None:
    """Every rank's KV bytes per block, in rank order, from kvmem's plan scaled to the
    scheduler's ``own`` (rank 0's); None when kvmem cannot plan the model."""
    from kvmem.integrations.vllm.deployment import deployment_plan

    attention = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups
                 if type(g.kv_cache_spec).__name__ != "MambaSpec"]
    try:
        ranks = deployment_plan(vllm_config, block_size=attention_block_size(kv_cache_config),
                                layer_dtype=attention[0].dtype if attention else None).ranks
    except KvmemError as exc:
        log.warning("kvmem: elastic KV memory: no plan of this hybrid model (%s); each "
                    "pipeline stage's KV bytes per block are counted by its layers", exc)
        return None
    first = ranks[0].bytes_per_block
    return [own * r.bytes_per_block // first for r in ranks]
