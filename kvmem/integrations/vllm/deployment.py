"""kvmem's plan of the deployment a vLLM configuration describes: its model, tp, pp,
vLLM's own layer split, block size and KV dtype, planned by the running vLLM's rules
(``kvmem.plan.vllm_rules``).

The budget part of the plugin plans with it (``plugin.budget``), and so do elastic KV
memory's sizing (``elastic.config``) and its hybrid-model checks (``elastic.hybrid``).
Imports vLLM only when called.
"""

from __future__ import annotations

from typing import Any

from kvmem.errors import ConfigError
from kvmem.plan import EngineSettings, Layout, Plan, RankProfile, plan
from kvmem.plan.flags import PLUGIN_POLICY_ENV as ENV  # KVMEM_VLLM_KV_BUDGET
from kvmem.spec import spec_from_config

__all__ = ["config_dict", "deployment_plan", "kv_dtype"]

# KV dtypes as vLLM names them (cache_dtype, or the model dtype for "auto") -> kvmem's names.
_KV_DTYPES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}


def deployment_plan(vllm_config: Any, *, block_size: int | None = None,
                    layer_dtype: Any = None, policy: str = "uniform",
                    profile: list[RankProfile] | None = None) -> Plan:
    """kvmem's plan of the deployment ``vllm_config`` describes: its model, tp, pp, vLLM's
    own layer split, block size and KV dtype (the layers' KV specs' where given)."""
    import vllm
    from vllm.distributed.utils import get_pp_indices

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    spec = spec_from_config(config_dict(model.hf_config), name=str(model.model))
    # vLLM's own split: VLLM_PP_LAYER_PARTITION, else its even split.
    bounds = [get_pp_indices(spec.num_layers, stage, pp) for stage in range(pp)]
    explicit = vllm_config.cache_config.kv_cache_memory_bytes
    settings = EngineSettings(
        # with neither a stated budget nor a measured one, only the needs are read
        kv_cache_memory_bytes=explicit if explicit is not None or profile else 1,
        gpu_memory_utilization=1.0,  # the workers' figures are already KV memory
        block_size=block_size or vllm_config.cache_config.block_size,
        max_model_len=model.max_model_len,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        cuda_graphs=False,
        kv_cache_dtype=kv_dtype(vllm_config.cache_config.cache_dtype,
                                layer_dtype if layer_dtype is not None else model.dtype),
        # this vLLM's own rules: its groups, charges and fit check (kvmem.plan.vllm_rules)
        vllm_version=vllm.__version__,
        device="cpu" if vllm_config.device_config.device_type == "cpu" else "gpu",
        max_concurrent_batches=getattr(vllm_config, "max_concurrent_batches", None),
        hybrid_kv_cache_manager=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        # linear-attention states: the mode and dtypes vLLM's hooks settled on
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        mamba_cache_dtype=str(getattr(vllm_config.cache_config, "mamba_cache_dtype", "auto")),
        mamba_ssm_cache_dtype=str(getattr(vllm_config.cache_config, "mamba_ssm_cache_dtype",
                                          "auto")),
        replayssm_buffer_len=(vllm_config.cache_config.replayssm_buffer_len
                              if getattr(vllm_config.cache_config, "use_replayssm", False)
                              else None),
        mamba_backend=_mamba_backend(vllm_config),
    )
    layout = Layout(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                    layer_partition=[end - start for start, end in bounds])
    return plan(spec, layout, settings, policy, profile=profile)


def _mamba_backend(vllm_config: Any) -> str:
    """vLLM's Mamba backend by name ("triton" where this vLLM has no choice of it)."""
    backend = getattr(getattr(vllm_config, "mamba_config", None), "backend", None)
    return str(getattr(backend, "name", "triton")).lower()


def config_dict(hf_config: Any) -> dict[str, Any]:
    """The model's config as kvmem's spec reads it: ``to_dict()``, and ``num_hidden_layers``
    where the config derives it from its layer list and writes only that (transformers'
    Nemotron-H: ``layers_block_type``)."""
    config = hf_config.to_dict()
    if "num_hidden_layers" not in config and hasattr(hf_config, "num_hidden_layers"):
        config["num_hidden_layers"] = hf_config.num_hidden_layers
    return config


def kv_dtype(cache_dtype: str, layer_dtype: Any) -> str:
    """kvmem's name for the KV dtype vLLM uses (``cache_dtype``, else the layers' dtype)."""
    name = cache_dtype if cache_dtype and cache_dtype != "auto" else str(layer_dtype)
    name = name.removeprefix("torch.")
    if name not in _KV_DTYPES:
        raise ConfigError(f"{ENV}: KV cache dtype {name!r} is not one kvmem plans")
    return _KV_DTYPES[name]
