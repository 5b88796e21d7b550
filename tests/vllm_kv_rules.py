"""vLLM's own KV cache rules over a grid of cases, run inside a vLLM venv (0.32 or 0.33).

Not a test module: ``tests/test_plan_vllm_rules.py`` runs this file with a vLLM venv's
interpreter (``python vllm_kv_rules.py MODEL_DIR CASES.json``), once for the whole grid,
and compares kvmem's rules with the JSON it prints last. Each case gives the layers (kind
and window), their KV heads and head size, the pipeline stages, the block size,
max_model_len, max_num_batched_tokens, asynchronous scheduling and each worker's KV
memory; the script builds every worker's KV specs as vLLM's attention layers do and asks
vLLM's own functions (``get_kv_cache_configs`` and what it calls, ``get_kv_cache_capacity``,
each spec's ``max_memory_usage_bytes``) what they make of them. Also the batch limits
(max_model_len, max_num_batched_tokens and max_num_seqs, each given or not, pp) that
vLLM's engine arguments make for ``vllm serve`` on its CPU platform, or its refusal. No
engine starts.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path

import torch


def cpu_platform() -> None:
    """vLLM 0.33's wheel is a CUDA build that finds no device here; use vLLM's CPU platform."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()


def layer_spec(case: dict, kind: str, window: int | None, head_dim: int | None = None):
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    # an 8-bit KV cache is fp8 in attention layers (the sparse MLA backend alone packs
    # DeepSeek's latent as fp8_ds_mla)
    dtype = torch.float32 if case.get("kv_dtype", "auto") == "auto" else torch.float8_e4m3fn
    common = {"block_size": case["block_size"], "num_kv_heads": case["heads"],
              "head_size": head_dim or case["head_dim"], "dtype": dtype}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    return mla_spec(case)


def mla_spec(case: dict):
    """An MLA layer's spec as ``MLAAttention.get_kv_cache_spec`` builds it for the case's
    KV cache dtype (auto: the model's float32; fp8; fp8_ds_mla: DeepSeek's packed page)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    kv_dtype = case.get("kv_dtype", "auto")
    dtype = {"auto": torch.float32, "fp8": torch.float8_e4m3fn,
             "fp8_ds_mla": torch.uint8}[kv_dtype]
    return MLAAttentionSpec(block_size=case["block_size"], num_kv_heads=1, max_tp_shards=1,
                            head_size=case["latent"], dtype=dtype, cache_dtype_str=kv_dtype,
                            kv_quant_mode=get_kv_quant_mode(kv_dtype),
                            state_content_bytes=656 if kv_dtype == "fp8_ds_mla" else None)


def indexer_spec(case: dict):
    """DeepSeek V3.2's indexer key cache (``DeepseekV32IndexerCache.get_kv_cache_spec``):
    index_head_dim fp8 values and a float32 scale per 128, one vector per token."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    dim = case["index_head_dim"]
    return MLAAttentionSpec(block_size=case["block_size"], num_kv_heads=1, max_tp_shards=1,
                            head_size=dim + dim // 128 * 4, dtype=torch.uint8,
                            cache_role=SparseCacheRole.INDEXER)


def worker_specs(case: dict, stage: list[int]) -> dict:
    """The specs one worker's runner collects: a layer reading another's KV (``kv_sharing_
    target_layer_name``) has none, an indexed MLA layer has its indexer's beside its own."""
    specs = {}
    for i in stage:
        if str(i) in case.get("kv_sources", {}):
            continue
        specs[name(i)] = layer_spec(case, *case["layers"][i])
        if i in case.get("indexed", ()):
            specs[indexer_name(i)] = indexer_spec(case)
    return specs


def speculative(case: dict):
    """vLLM's own SpeculativeConfig for the case's method, its fields set without building
    a draft model (its methods decide the lookahead)."""
    from types import SimpleNamespace

    from vllm.config.speculative import SpeculativeConfig

    draft = case["speculative"]
    config = object.__new__(SpeculativeConfig)
    hf = SimpleNamespace(num_nextn_predict_layers=draft["mtp_layers"], model_type="draft")
    for field, value in (("method", draft["method"]),
                         ("num_speculative_tokens", draft["tokens"]),
                         ("draft_model_config", SimpleNamespace(hf_config=hf)),
                         ("disable_eagle_block_drop", False),
                         ("disable_lookahead_block_hashes", False)):
        object.__setattr__(config, field, value)
    return config


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def indexer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


class Rules:
    """vLLM's functions, wherever this release keeps them."""

    def __init__(self, config) -> None:
        try:  # 0.33: planning in its own module, behind a config builder
            from vllm.v1.core import kv_cache_planning as planning
            from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

            self.builder = get_kv_cache_config_builder(config)
            self.planning = planning
        except ImportError:
            from vllm.v1.core import kv_cache_utils as planning

            self.builder, self.planning = None, planning

    def global_groups(self, config, specs):
        if self.builder is not None:
            return self.planning.get_global_kv_cache_groups(config, specs)
        merged = {k: v for worker in specs for k, v in worker.items()}
        return self.planning.get_kv_cache_groups(config, merged)

    def configs(self, config, specs, memory):
        if self.builder is not None:
            return self.planning.get_kv_cache_configs(config, specs, memory,
                                                       self.global_groups(config, specs))
        return self.planning.get_kv_cache_configs(config, specs, memory)

    def pool_bytes_per_block(self, config, groups) -> int:
        if self.builder is not None:
            return self.planning._pool_bytes_per_block_from_builder(self.builder, config,
                                                                    groups)
        return self.planning._pool_bytes_per_block(config, groups)

    def need(self, config, groups) -> int:
        if self.builder is not None:
            return self.planning._max_memory_usage_bytes_from_groups(self.builder, config,
                                                                     groups)
        return self.planning._max_memory_usage_bytes_from_groups(config, groups)


def run_case(base, case: dict) -> dict:
    config = copy.deepcopy(base)
    config.model_config.max_model_len = case["max_model_len"]
    config.scheduler_config.max_num_batched_tokens = case["batched"]
    config.scheduler_config.async_scheduling = case["async"]
    config.cache_config.block_size = case["block_size"]
    config.parallel_config.pipeline_parallel_size = len(case["stages"])
    if case.get("hybrid") is False:  # --disable-hybrid-kv-cache-manager
        config.scheduler_config.disable_hybrid_kv_cache_manager = True
    if "speculative" in case:
        object.__setattr__(config, "speculative_config", speculative(case))
    specs = [worker_specs(case, stage) for stage in case["stages"]]
    index = {name(i): i for i in range(len(case["layers"]))}
    index.update({indexer_name(i): i for i in case.get("indexed", ())})
    return {
        "max_concurrent_batches": config.max_concurrent_batches,
        "lookahead": [config.num_lookahead_tokens, config.num_prefill_lookahead_tokens],
        **sized(config, specs, index, case["memory"]),
    }


def sized(config, specs: list[dict], index: dict[str, int], memory: list[int]) -> dict:
    """What vLLM makes of the workers' ``specs`` with ``memory`` each: groups (layers by
    ``index``), charges, block bytes, blocks, logged capacity, the start-up check's need,
    and the check's message one byte short of it on the first worker."""
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
    )

    rules = Rules(config)
    groups = rules.global_groups(config, specs)
    projected = [rules.planning._project_kv_cache_groups_to_worker(groups, worker)
                 for worker in specs]
    per_block = [rules.pool_bytes_per_block(config, g) for g in projected]
    configs = rules.configs(config, specs, list(memory))
    scheduler = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(config, scheduler)
    need = [rules.need(config, g) for g in projected]
    # the start-up check at its boundary: exactly the need (and the null block) passes,
    # one byte less on the first worker fails with vLLM's message
    enough = [n + b for n, b in zip(need, per_block, strict=True)]
    rules.configs(config, specs, enough)
    try:
        rules.configs(config, specs, [enough[0] - 1, *enough[1:]])
        short = None
    except ValueError as exc:
        short = str(exc)
    return {
        "groups": [[type(g.kv_cache_spec).__name__, [index[n] for n in g.layer_names]]
                   for g in groups],
        "charges": [-(-g.kv_cache_spec.max_memory_usage_bytes(config)
                      // g.kv_cache_spec.page_size_bytes) for g in groups],
        "bytes_per_block": per_block,
        "worker_blocks": [m // b for m, b in zip(memory, per_block, strict=True)],
        "num_blocks": [c.num_blocks for c in configs],
        "tokens": tokens,
        "concurrency": concurrency,
        "need": need,
        "short_of_need": short,
    }


def batch_limits(model: str, case: dict) -> dict:
    """The limits vLLM's config for ``vllm serve`` holds, or why vLLM refuses them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = EngineArgs(model=model, dtype="float32", kv_cache_memory_bytes=1 << 30,
                      max_model_len=case["max_model_len"], max_num_seqs=case["seqs"],
                      max_num_batched_tokens=case["batched"], pipeline_parallel_size=case["pp"])
    try:
        config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    except ValueError as exc:  # pydantic's ValidationError of SchedulerConfig
        return {"refused": str(exc)}
    s = config.scheduler_config
    return {"batched": s.max_num_batched_tokens, "seqs": s.max_num_seqs}


def main() -> None:
    model, cases_file = sys.argv[1:3]
    import vllm

    cpu_platform()  # before anything imports the platform
    from vllm.engine.arg_utils import EngineArgs

    base = EngineArgs(model=model, dtype="float32", max_model_len=1024, block_size=16,
                      kv_cache_memory_bytes=1 << 30).create_engine_config()
    base.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    cases = json.loads(Path(cases_file).read_text())
    results = []
    for case in cases["kv"]:
        try:
            results.append(run_case(base, case))
        except Exception:  # noqa: BLE001 - reported to the test with its traceback
            results.append({"traceback": traceback.format_exc()})
    limits = [batch_limits(model, case) for case in cases["batch"]]
    print("KVMEM_RULES " + json.dumps({"vllm": vllm.__version__, "cases": results,
                                       "batch_limits": limits}), flush=True)


if __name__ == "__main__":
    main()
