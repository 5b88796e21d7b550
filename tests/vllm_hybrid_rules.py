"""vLLM's own KV cache rules for linear-attention hybrids, run inside a vLLM venv.

Not a test module: ``tests/test_plan_vllm_hybrid.py`` runs it with a vLLM venv's
interpreter (``python vllm_hybrid_rules.py TESTS_DIR TOKENIZER_DIR CASES.json``) and
compares kvmem's rules with the JSON it prints last. Each case is a model config
(Qwen3-Next-, Nemotron-H-, LFM2- or Kimi-Linear-shaped), written as a model directory that
vLLM's engine arguments read as they read any model: the model's own config hooks set the
Mamba cache mode, its state block size and dtypes, and vLLM's CPU platform its SSM dtype.
Then, as a start does once the layers exist (none are built here, no engine starts):

- ``Platform._align_hybrid_block_size`` raises the attention block size and pads the state
  page, with vLLM's CPU attention backend (device "cpu") or a backend declaring
  FlashAttention's kernel blocks (``MultipleOf(16)``, device "gpu": FlashAttention itself
  does not import here); 0.33's FlashInfer Gated DeltaNet prefill declares its checkpoint
  alignment (``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``) on "gpu", vLLM's CPU build none;
- the state layers' ``MambaSpec`` from the model class's own
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``, with the
  checkpoint block the layer classes add (``MambaMixer2`` always, 0.33's Gated DeltaNet
  with the FlashInfer prefill), and the attention layers' ``FullAttentionSpec``;
- ``get_kv_cache_configs`` and the rest, as ``tests/vllm_kv_rules.py`` asks them.

A case with ``replayssm`` (0.33, Nemotron-H) turns ``--use-replayssm`` on with its ring
length and Mamba backend once the engine arguments are read, as those flags set them; the
model class then shapes the ring (the flags' own checks are kvmem's refusals, tested apart).

Kimi Linear's full layers are MLA: vLLM's CPU platform turns prefix caching off for MLA
models (``CpuPlatform.check_and_update_config``), and the engine arguments then fail ("--
mamba-block-size can only be set with --enable-prefix-caching"). Its cases are on "gpu":
the config is built with prefix caching off and the case's setting (and ``--block-size``,
which the CPU platform sets to its MLA kernel's 16) is put back before
``MambaModelConfig.verify_and_update_config`` sets the Mamba cache mode, as on a GPU; the
MLA layers are ``MLAAttentionSpec`` layers of the latent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import traceback
from pathlib import Path
from unittest import mock


class GpuAttention:
    """The attention backend fields ``_align_hybrid_block_size`` reads, as vLLM's
    FlashAttention backend declares them on Ampere and Hopper GPUs."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        from vllm.v1.attention.backend import MultipleOf

        return [MultipleOf(16)]

    @staticmethod
    def supports_block_size(block_size) -> bool:
        return block_size % 16 == 0

    @staticmethod
    def customize_spec(spec):
        return spec

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def is_ssm() -> bool:
        return False


def engine_config(tokenizer: str, case: dict, workdir: Path):
    from vllm.engine.arg_utils import EngineArgs

    mla = "kv_lora_rank" in case["config"]  # CPU platform: no prefix caching with MLA
    model = workdir / f"model-{case['id']}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(case["config"]))
    args = EngineArgs(model=str(model), tokenizer=tokenizer, skip_tokenizer_init=True,
                      dtype=case["dtype"], max_model_len=case["max_model_len"],
                      block_size=case["block_size"], kv_cache_memory_bytes=1 << 30,
                      kv_cache_dtype=case["kv_dtype"],
                      enable_prefix_caching=case["prefix_caching"] and not mla)
    config = args.create_engine_config()
    config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    config.parallel_config.tensor_parallel_size = case["tp"]
    config.parallel_config.pipeline_parallel_size = len(case["stages"])
    config.scheduler_config.max_num_batched_tokens = case["batched"]
    config.scheduler_config.async_scheduling = case["device"] == "gpu"
    if case["device"] == "gpu":  # no CPU platform SSM dtype: the model's own hook only
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        config.cache_config.mamba_ssm_cache_dtype = "auto"
        hook = MODELS_CONFIG_MAP.get(config.model_config.architecture)
        if hook is not None:
            hook.verify_and_update_config(config)
    if case.get("replayssm"):  # --use-replayssm (0.33), set as its engine arguments set it
        from vllm.config.mamba import MambaBackendEnum

        config.cache_config.use_replayssm = True
        config.cache_config.replayssm_buffer_len = case["replayssm"]["buffer_len"]
        config.mamba_config.backend = MambaBackendEnum[case["replayssm"]["backend"].upper()]
    if mla:
        from vllm.model_executor.models.config import MambaModelConfig

        config.cache_config.enable_prefix_caching = case["prefix_caching"]
        config.cache_config.block_size = case["block_size"]  # the CPU MLA kernel's 16, undone
        config.scheduler_config.enable_chunked_prefill = True
        config.cache_config.mamba_block_size = None
        MambaModelConfig.verify_and_update_config(config)
    return config


def model_class(config):
    from vllm.model_executor.models import ModelRegistry

    return ModelRegistry.resolve_model_cls(config.model_config.architecture,
                                           model_config=config.model_config)[0]


def gdn_checkpoints(config, device: str) -> bool:
    """Whether 0.33's Gated DeltaNet layers export prefill checkpoints (FlashInfer prefill,
    on CUDA only, in align mode)."""
    return (device == "gpu" and config.cache_config.mamba_cache_mode == "align"
            and "Qwen3Next" in config.model_config.architecture
            and _has_checkpoint_alignment())


def _has_checkpoint_alignment() -> bool:
    from vllm.model_executor.layers.mamba import abstract

    return hasattr(abstract, "get_mamba_prefill_checkpoint_alignment")


def align_block_size(config, device: str) -> None:
    """``Platform._align_hybrid_block_size`` with the case's attention backend."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    backend = CPUAttentionBackend if device == "cpu" else GpuAttention
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            CpuPlatform, "_find_non_ssm_backends", classmethod(lambda cls, c: [backend])))
        if _has_checkpoint_alignment():
            from vllm.model_executor.layers.mamba import abstract

            alignment = None
            if gdn_checkpoints(config, device):
                from vllm.v1.attention.backends.gdn_attn import (
                    FLASHINFER_GDN_CHECKPOINT_ALIGNMENT,
                )

                alignment = FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
            stack.enter_context(mock.patch.object(
                abstract, "get_mamba_prefill_checkpoint_alignment", lambda c: alignment))
        CpuPlatform._align_hybrid_block_size(config, backend)


def layer_specs(config, case: dict) -> dict[int, object]:
    """Each layer's spec as its layer class would build it (none for MLP layers)."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        get_kv_quant_mode,
    )

    cache, model = config.cache_config, config.model_config
    cls = model_class(config)
    mamba = MambaSpec(shapes=tuple(cls.get_mamba_state_shape_from_config(config)),
                      dtypes=tuple(cls.get_mamba_state_dtype_from_config(config)),
                      block_size=cache.mamba_block_size,
                      page_size_padded=cache.mamba_page_size_padded,
                      mamba_cache_mode=cache.mamba_cache_mode)
    if "NemotronH" in model.architecture:  # MambaMixer2.get_kv_cache_spec
        mamba = dataclasses.replace(mamba, num_prefill_checkpoint_blocks=1,
                                    prefill_checkpoint_alignment=1)
    elif gdn_checkpoints(config, case["device"]):  # 0.33 Gated DeltaNet, FlashInfer prefill
        mamba = dataclasses.replace(mamba, num_prefill_checkpoint_blocks=1,
                                    prefill_checkpoint_alignment=cache.mamba_block_size)
    kv_dtype = (model.dtype if cache.cache_dtype == "auto"
                else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype])
    attention = FullAttentionSpec(
        block_size=cache.block_size, num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(), dtype=kv_dtype,
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype))
    if model.use_mla:  # MLAAttention.get_kv_cache_spec: the latent, one head
        attention = MLAAttentionSpec(
            block_size=cache.block_size, num_kv_heads=1, head_size=model.get_head_size(),
            dtype=kv_dtype, cache_dtype_str=cache.cache_dtype,
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype))
    elif case["device"] == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        attention = CPUAttentionBackend.customize_spec(attention)
    specs = {"full": attention, "linear": mamba}
    assert isinstance(kv_dtype, torch.dtype)
    return {i: specs[kind] for i, kind in enumerate(case["layers"]) if kind in specs}


def name(i: int) -> str:
    return f"model.layers.{i}.mixer"


def run_case(tokenizer: str, case: dict, workdir: Path) -> dict:
    from vllm_kv_rules import sized

    config = engine_config(tokenizer, case, workdir)
    align_block_size(config, case["device"])
    by_layer = layer_specs(config, case)
    specs = [{name(i): by_layer[i] for i in stage if i in by_layer} for stage in case["stages"]]
    mamba = next(s for s in by_layer.values() if type(s).__name__ == "MambaSpec")
    return {
        "block_size": config.cache_config.block_size,
        "mamba_cache_mode": config.cache_config.mamba_cache_mode,
        "state_bytes": mamba.state_content_size_bytes,
        "state_page": mamba.page_size_bytes,
        **sized(config, specs, {name(i): i for i in by_layer}, case["memory"]),
    }


def main() -> None:
    tests_dir, tokenizer, cases_file = sys.argv[1:4]
    sys.path.insert(0, tests_dir)
    import vllm
    from vllm_kv_rules import cpu_platform

    cpu_platform()  # before anything imports the platform
    cases = json.loads(Path(cases_file).read_text())
    results = []
    for case in cases:
        try:
            results.append(run_case(tokenizer, case, Path(cases_file).parent))
        except Exception:  # noqa: BLE001 - reported to the test with its traceback
            results.append({"traceback": traceback.format_exc()})
    print("KVMEM_HYBRID " + json.dumps({"vllm": vllm.__version__, "cases": results}),
          flush=True)


if __name__ == "__main__":
    main()
