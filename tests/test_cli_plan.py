"""The ``kvmem plan`` command: output formats, engine flags, plots and one-line errors."""

import json
import re
import subprocess
import sys

import pytest

from kvmem.cli import main
from kvmem.plan import vllm_rules

PROBLEM2 = ["plan", "Qwen/Qwen3-32B", "--pp", "2", "--layer-partition", "56,8",
            "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "5GiB", "--max-model-len",
            "40960"]


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_documented_object(capsys):
    d = _json(capsys, PROBLEM2)
    assert [r["tokens"] for r in d["ranks"]] == [46_800, 327_680]
    assert [r["layers"][0] for r in d["ranks"]] == [0, 56]
    assert [(r["rank"], r["pp_stage"], r["tp_rank"]) for r in d["ranks"]] == [(0, 0, 0),
                                                                             (1, 1, 0)]
    e = d["engine"]
    assert e["num_blocks"] == 2925 and e["tokens"] == 46_800 and e["fits"]
    assert e["layer_partition"] == [56, 8] and e["max_model_len_that_fits"] == 40_960
    assert round(e["max_concurrency"], 2) == 1.14


@pytest.mark.parametrize("size, expected", [("5GiB", 5 << 30), ("512MiB", 512 << 20),
                                            ("1073741824", 1 << 30)])
def test_kv_cache_memory_bytes_accepts_units(capsys, size, expected):
    d = _json(capsys, ["plan", "qwen3-8b", "--kv-cache-memory-bytes", size])
    assert d["ranks"][0]["kv_budget_bytes"] == expected


def test_proportional_from_the_command_line(capsys):
    d = _json(capsys, PROBLEM2 + ["--kv-budget", "proportional"])
    assert [r["tokens"] for r in d["ranks"]] == [40_960, 40_960]
    assert [r["kv_budget_bytes"] for r in d["ranks"]] == [4.375 * (1 << 30), 0.625 * (1 << 30)]


def test_table_shows_ranks_and_engine_summary(capsys):
    assert main(PROBLEM2) == 0
    out = capsys.readouterr().out
    for text in ("46,800", "327,680", "engine blocks", "2,925", "1.14x", "56,8", "uniform"):
        assert text in out


def test_gpus_by_name_repeated_or_comma_list(capsys):
    a = _json(capsys, ["plan", "qwen3-8b", "--pp", "2", "--gpu", "V100-16GB", "--gpu",
                       "V100-32GB"])
    b = _json(capsys, ["plan", "qwen3-8b", "--pp", "2", "--gpu", "v100-16gb,V100-32GB"])
    assert a["ranks"] == b["ranks"]
    assert a["ranks"][0]["memory_bytes"] < a["ranks"][1]["memory_bytes"]


def test_engine_vllm_prints_flags_and_partition_env(capsys):
    assert main(PROBLEM2 + ["--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "VLLM_PP_LAYER_PARTITION=56,8 vllm serve Qwen/Qwen3-32B" in out
    for flag in ("--tensor-parallel-size 1", "--pipeline-parallel-size 2",
                 "--kv-cache-memory-bytes 5368709120", "--kv-cache-dtype fp8",
                 "--max-model-len 40960", "--block-size 16"):
        assert flag in out


def test_vllm_budget_fits_the_smallest_rank_when_the_largest_does_not(capsys):
    d = _json(capsys, ["plan", "Qwen/Qwen3-14B", "--pp", "2", "--gpu", "V100-16GB,V100-32GB",
                       "--kv-budget", "optimal", "--max-model-len", "32768", "--engine", "vllm"])
    argv, ranks = d["engine_command"]["argv"], d["ranks"]
    budget = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert budget == min(r["kv_capacity_bytes"] for r in ranks)
    assert budget < max(r["kv_budget_bytes"] for r in ranks)
    blocks = min(budget // r["bytes_per_block"] for r in ranks)
    note = d["engine_command"]["notes"][0]
    assert f"{budget:,} bytes" in note and "smallest rank's KV capacity" in note
    assert f"gives {blocks:,} blocks ({blocks * 16:,} tokens)" in note
    assert f"the plan's per-rank budgets hold {d['engine']['num_blocks']:,} blocks" in note


def test_vllm_budget_is_the_largest_when_every_rank_holds_it(capsys):
    d = _json(capsys, PROBLEM2 + ["--kv-budget", "proportional", "--engine", "vllm"])
    cmd, ranks = d["engine_command"], d["ranks"]
    budget = int(cmd["argv"][cmd["argv"].index("--kv-cache-memory-bytes") + 1])
    assert budget == max(r["kv_budget_bytes"] for r in ranks)
    blocks = min(budget // r["bytes_per_block"] for r in ranks)
    assert blocks == d["engine"]["num_blocks"] == 2560
    note = cmd["notes"][0]
    assert f"{budget:,} bytes (the largest per-rank budget" in note
    assert "gives 2,560 blocks (40,960 tokens)" in note


def test_uneven_budgets_point_to_the_vllm_plugin_with_its_environment(capsys):
    d = _json(capsys, PROBLEM2 + ["--kv-budget", "proportional", "--engine", "vllm"])
    cmd = d["engine_command"]
    assert any("KVMEM_VLLM_KV_BUDGET=proportional" in n and "vllm.general_plugins" in n
               for n in cmd["notes"])
    plugin = cmd["plugin"]
    assert plugin["env"] == {"KVMEM_VLLM_KV_BUDGET": "proportional",
                             "VLLM_PP_LAYER_PARTITION": "56,8"}
    # the plugin gets the stated per-GPU value and splits it as the plan does
    argv = plugin["argv"]
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(5 << 30)


def test_vllm_default_partition_and_even_budgets_need_no_plugin_or_variable(capsys):
    d = _json(capsys, ["plan", "Qwen/Qwen3-32B", "--pp", "2", "--kv-cache-memory-bytes", "5GiB",
                       "--engine", "vllm"])
    cmd = d["engine_command"]
    assert cmd["env"] == {} and "plugin" not in cmd and cmd["notes"] == []
    assert cmd["argv"][cmd["argv"].index("--kv-cache-memory-bytes") + 1] == str(5 << 30)


@pytest.mark.parametrize("output", [["--json"], []])
def test_a_plan_without_kv_blocks_is_reported_and_exits_2(capsys, output):
    """Not one block fits: no engine would start, so the plan fails (without --check too)
    after printing what it found and why."""
    assert main(["plan", "Qwen/Qwen3-32B", "--pp", "2", "--layer-partition", "56,8",
                 "--gpu", "RTX-3090", "--engine", "vllm", *output]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("kvmem: error: ") and "\n" not in err and "rank 0" in err
    if output:
        d = json.loads(captured.out)
        assert d["engine"]["num_blocks"] == 0
        assert d["engine_command"]["notes"][0].startswith("this plan holds no KV blocks")
    else:
        assert "0 B for KV cache" in captured.out or "does not fit" in captured.out


def test_sglang_says_it_cannot_express_per_rank_budgets(capsys):
    d = _json(capsys, PROBLEM2 + ["--kv-budget", "proportional", "--engine", "sglang"])
    assert any("no SGLang plugin" in n for n in d["engine_command"]["notes"])


@pytest.mark.parametrize("engine, flag", [("vllm", "serve"), ("sglang", "--model-path"),
                                          ("kvmem", "serve")])
def test_engine_commands_name_the_model_as_given_not_its_config_label(tmp_path, capsys,
                                                                       engine, flag):
    model = tmp_path / "my model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**BASE_CONFIG,
                                                   "_name_or_path": "Some Label 135M",
                                                   "max_position_embeddings": 2048}))
    for given, named in ((str(model), str(model)), (str(model / "config.json"), str(model))):
        d = _json(capsys, ["plan", given, "--kv-cache-memory-bytes", "1GiB", "--engine", engine])
        argv = d["engine_command"]["argv"]
        assert argv[argv.index(flag) + 1] == named and d["model"] == named
        assert "Some Label 135M" not in argv
    shell = subprocess.run([sys.executable, "-c", "from kvmem.cli import main; main(['plan', "
                            f"{str(model)!r}, '--kv-cache-memory-bytes', '1GiB', '--engine', "
                            f"{engine!r}])"], capture_output=True, text=True, check=True).stdout
    assert f"'{model}'" in shell  # quoted for the shell: a path with a space pastes as one


def test_engine_sglang_and_kvmem(capsys):
    argv = ["plan", "qwen3-14b", "--pp", "2", "--gpu", "V100-16GB,V100-32GB", "--kv-budget",
            "optimal", "--max-model-len", "32768"]
    d = _json(capsys, argv + ["--engine", "sglang"])
    cmd = d["engine_command"]
    assert cmd["env"]["SGLANG_PP_LAYER_PARTITION"] == ",".join(
        map(str, d["engine"]["layer_partition"]))
    for flag in ("--tp-size", "--pp-size", "--mem-fraction-static", "--context-length",
                 "--page-size", "--max-running-requests", "--chunked-prefill-size"):
        assert flag in cmd["argv"]
    assert cmd["argv"][cmd["argv"].index("--max-total-tokens") + 1] == str(d["engine"]["tokens"])
    k = _json(capsys, argv + ["--engine", "kvmem"])["engine_command"]["argv"]
    assert k[:3] == ["kvmem", "serve", "Qwen/Qwen3-14B"]
    assert k[k.index("--kv-budget") + 1] == "optimal"
    assert k[k.index("--layer-partition") + 1] == ",".join(
        map(str, d["engine"]["layer_partition"]))


def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert main(["plan", "qwen3-14b", "--tp", "2", "--gpu", "L40S", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_fails_with_the_per_rank_message(capsys):
    assert main(["plan", "qwen3-8b", "--kv-cache-memory-bytes", "1GiB", "--max-model-len",
                 "40960", "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmem: error: rank 0") and "longest max_model_len" in err


@pytest.mark.parametrize("argv, match", [
    (["plan", "qwen3-32", "--gpu", "H100"], "did you mean"),
    (["plan", "qwen3-32b", "--tp", "3", "--gpu", "H100"], "does not divide"),
    (["plan", "qwen3-32b", "--pp", "2", "--layer-partition", "60,8", "--gpu", "H100"],
     "sums to 68"),
    (["plan", "qwen3-32b", "--pp", "2", "--layer-partition", "64,0", "--gpu", "H100"], "empty"),
    (["plan", "qwen3-32b", "--pp", "2", "--layer-partition", "60,8"], "sums to 68"),
    (["plan", "qwen3-32b", "--pp", "2", "--layer-partition", "a,b", "--gpu", "H100"],
     "whole numbers"),
    (["plan", "qwen3-32b", "--gpu", "H1000"], "unknown GPU"),
    (["plan", "qwen3-32b", "--gpu-memory", "0"], "positive"),
    (["plan", "qwen3-32b", "--gpu-memory", "-4"], "positive"),
    (["plan", "qwen3-32b", "--kv-cache-memory-bytes", "0"], "positive"),
    (["plan", "qwen3-32b", "--kv-cache-memory-bytes", "5 parsecs"], "cannot read"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--kv-cache-dtype", "int3"], "unknown dtype"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--gpu-memory-utilization", "1.5"], r"\(0, 1\]"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--block-size", "-16"], "block_size"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--max-num-seqs", "0"], "max_num_seqs"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--max-num-seqs", "99999999999999999999"],
     "--max-num-seqs 99,999,999,999,999,999,999 is more than --max-num-batched-tokens"),
    (["plan", "qwen3-32b"], "give each rank's GPU"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--cpu-offload-gib", "-1"], "negative"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--tp", "x"], "--tp.*not an integer: 'x'"),
    (["plan", "smollm2-135m", "--tp", "0"], "--tp.*must be at least 1, got 0"),
    (["plan", "smollm2-135m", "--tp", "-2"], "--tp.*must be at least 1, got -2"),
    (["plan", "smollm2-135m", "--pp", "0"], "--pp.*must be at least 1, got 0"),
    (["plan", "smollm2-135m", "--pp", "-1"], "--pp.*must be at least 1, got -1"),
    (["plan", "smollm2-135m", "--profile", "/dev/zero"], "profile /dev/zero: not a regular file"),
    (["plan", "qwen3-32b", "--gpu-memory", "inf"], "not a usable size"),
    (["plan", "qwen3-32b", "--gpu-memory", "1e400"], "not a usable size"),
    (["plan", "qwen3-32b", "--gpu-memory", "80,nan"], "positive number of GiB"),
    (["plan", "qwen3-32b", "--kv-cache-memory-bytes", "1e400"], "not a usable size"),
    (["plan", "qwen3-32b", "--kv-cache-memory-bytes", "2e15"], "not a usable size"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--kv-memory", "elastic", "--kv-memory-limit",
      "1e400"], "not a usable size"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--weight-offload-gib", "inf"], "not a usable size"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--weight-offload-gib", "nan"], "non-negative"),
    (["plan", "qwen3-32b", "--gpu", "H100", "--weight-offload-gib", "-1"], "non-negative"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, match):
    import re

    try:
        code = main(argv)
    except SystemExit as done:  # argparse's own errors (same one-line format)
        code = done.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("kvmem: error:") and re.search(match, err), err


ELASTIC = ["plan", "qwen3-8b", "--gpu", "H100", "--kv-memory", "elastic", "--engine", "kvmem"]


def test_check_fails_when_the_elastic_limit_cannot_hold_one_request(capsys):
    """The planner refuses what the engine would refuse at start-up: 100 MiB maps one
    72 MiB page (32 blocks) but a 40,960-token request needs 2,561 blocks."""
    assert main(ELASTIC + ["--kv-memory-limit", "100MiB", "--check"]) == 2
    captured = capsys.readouterr()
    assert "needs 2,561 (incl. the null block)" in captured.err
    assert "--kv-memory elastic --kv-memory-limit 104857600" in captured.out


def test_elastic_limit_that_holds_a_request_passes_the_check(capsys):
    assert main(ELASTIC + ["--kv-memory-limit", "10GiB", "--max-model-len", "8192",
                           "--check"]) == 0
    assert "elastic KV memory limit" not in capsys.readouterr().out


VLLM_CPU_ELASTIC = ["plan", "smollm2", "--device", "cpu", "--engine", "vllm", "--kv-memory",
                    "elastic", "--kv-cache-memory-bytes", "1GiB", "--max-model-len", "4096"]


def test_elastic_in_vllms_cpu_build_is_planned_as_vllm_maps_it(capsys):
    """vLLM's own KV cache is the reservation, mapped by OS pages: SmolLM2's 128-token
    block of one layer (K and V of 3 heads of 64 in bf16: 98,304 bytes) fills whole 4 KiB
    pages, so a page holds one block, not the 2 MiB granules of a GPU; the command turns
    it on with kvmem's variable."""
    d = _json(capsys, VLLM_CPU_ELASTIC + ["--kv-memory-limit", "100MiB"])
    kv, engine = d["kv_memory"], d["engine"]
    assert kv["engine"] == "vllm" and kv["granularity"] == 4096
    assert kv["blocks_per_page"] == 1 and kv["reserved_blocks"] == engine["num_blocks"]
    assert kv["page_bytes"] == kv["block_bytes"] == d["ranks"][0]["bytes_per_block"]
    assert kv["limit_blocks"] == (100 << 20) // kv["page_bytes"]
    assert kv["request_pages"] == 4096 // 128 + 1
    assert d["engine_command"]["env"] == {"KVMEM_VLLM_KV_MEMORY": "elastic",
                                          "KVMEM_VLLM_KV_MEMORY_LIMIT": str(100 << 20)}
    assert main(VLLM_CPU_ELASTIC) == 0
    out = capsys.readouterr().out
    assert "mapped in pages of 1 block" in out and "OS pages of 4.00 KiB" in out
    assert "2 MiB" not in out


def test_huge_pages_make_whole_huge_pages_of_a_page(capsys):
    """SmolLM2's 98,304-byte block of one layer fills whole 2 MiB huge pages 64 at a time
    (98,304 = 3 x 32 KiB); the command and the environment ask for huge pages."""
    d = _json(capsys, VLLM_CPU_ELASTIC + ["--kv-memory-huge-pages"])
    kv = d["kv_memory"]
    assert (kv["granularity"], kv["blocks_per_page"]) == (2 << 20, 64)
    assert kv["page_bytes"] == 64 * kv["block_bytes"]
    assert d["engine_command"]["env"]["KVMEM_VLLM_KV_MEMORY_HUGE_PAGES"] == "1"
    assert main(VLLM_CPU_ELASTIC + ["--kv-memory-huge-pages"]) == 0
    assert "huge pages of 2.00 MiB on vLLM's CPU build" in capsys.readouterr().out
    ours = ["plan", "smollm2", "--device", "cpu", "--engine", "kvmem", "--kv-memory",
            "elastic", "--kv-cache-memory-bytes", "1GiB", "--kv-memory-huge-pages"]
    d = _json(capsys, ours)
    [rank] = d["kv_memory"]["ranks"]
    assert rank["blocks_per_page"] == 64
    assert d["engine_command"]["argv"][-1] == "--kv-memory-huge-pages"
    for argv, message in ((ours[:6] + ours[8:], "needs --kv-memory elastic"),
                          (ELASTIC + ["--kv-memory-huge-pages"], "for KV memory on the CPU")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_elastic_in_vllm_fails_the_check_where_vllm_would_refuse(capsys):
    """50 MiB maps 17 one-block pages; a 4,096-token request needs 32 and the null
    block's (vLLM's scheduler side refuses to start with the same figures)."""
    assert main(VLLM_CPU_ELASTIC + ["--kv-memory-limit", "50MiB", "--check"]) == 2
    assert "needs 33 (incl. the null block's)" in capsys.readouterr().err
    assert main(VLLM_CPU_ELASTIC[:5] + ["sglang"] + VLLM_CPU_ELASTIC[6:]) == 2
    assert "not in SGLang" in capsys.readouterr().err


BASE_CONFIG = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
               "vocab_size": 10}


@pytest.mark.parametrize("fields, match", [
    ({"kv_lora_rank": "a"}, "'kv_lora_rank' must be an integer, got 'a'"),
    ({"intermediate_size": "x"}, "'intermediate_size' must be an integer, got 'x'"),
    ({"num_experts": 8, "num_experts_per_tok": "two"}, "'num_experts_per_tok'.*'two'"),
    ({"sliding_window": "big"}, "'sliding_window' must be an integer, got 'big'"),
    ({"quantization_config": {"bits": "four"}}, "'quantization_config.bits'.*'four'"),
    ({"model_type": "gemma3_text", "sliding_window": 0}, "'sliding_window' must be positive"),
    ({"model_type": "gemma2", "sliding_window": -4096}, "'sliding_window'.*-4096"),
    ({"model_type": "mistral", "sliding_window": -1}, "'sliding_window' must be positive"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": -128},
     "'sliding_window'.*-128"),
    ({"attention_chunk_size": -8192}, "'attention_chunk_size' must not be negative"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be positive, got 0"),
    ({"head_dim": 0}, "'head_dim' must be positive, got 0"),
    ({"max_position_embeddings": "long"}, "'max_position_embeddings'"),
])
def test_bad_config_fields_are_one_line_errors(tmp_path, capsys, fields, match):
    import re

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE_CONFIG, **fields}))
    assert main(["plan", str(path), "--kv-cache-memory-bytes", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("kvmem: error:") and re.search(match, err), err


def test_bad_config_files_are_one_line_errors(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64}))
    latin1 = tmp_path / "latin1" / "config.json"  # a model directory; "é" as one byte, 0xe9
    latin1.parent.mkdir()
    latin1.write_bytes('{"model_type": "llama", "_name_or_path": "café"}'.encode("latin-1"))
    for path, match in ((broken, "not valid JSON"), (partial, "missing"),
                        (latin1, f"{latin1}: not valid JSON (not UTF-8 text: byte 0xe9 "
                                 "at offset 45)"),
                        (latin1.parent, f"{latin1}: not valid JSON (not UTF-8")):
        assert main(["plan", str(path), "--kv-cache-memory-bytes", "1GiB"]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err


def test_smollm2_is_the_model_serve_embeds(capsys):
    """`kvmem serve` accepts `smollm2` for its embedded model; so does `kvmem plan`."""
    argv = ["plan", "--kv-cache-memory-bytes", "1GiB"]
    assert _json(capsys, argv + ["smollm2"]) == _json(capsys, argv + ["smollm2-135m-instruct"])


def test_what_is_read_from_a_named_file_is_bounded(tmp_path, capsys):
    """`--profile /dev/zero` used to read until memory ran out. A named file that is not a
    regular file, or is larger than any real one, is a one-line error before it is read."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").symlink_to("/dev/zero")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB that takes no disk
    for argv, match in ((["plan", str(model)], "config.json: not a regular file"),
                        (["plan", str(huge)], "huge.json: larger than 64.00 MiB"),
                        (["plan", "smollm2-135m", "--profile", str(huge)],
                         "profile .*huge.json: larger than 64.00 MiB")):
        assert main([*argv, "--kv-cache-memory-bytes", "1GiB"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(match, err), err


def test_plot_to_an_unwritable_path_is_a_clean_error(tmp_path, capsys):
    assert main(["plan", "qwen3-8b", "--gpu", "L4", "--plot",
                 str(tmp_path / "missing" / "x.png")]) == 2
    assert "cannot write plot" in capsys.readouterr().err


def test_plan_command_does_not_import_torch():
    code = ("import sys; from kvmem.cli import main; "
            "main(['plan', 'qwen3-8b', '--gpu', 'H100', '--json', '--engine', 'vllm']); "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--tp", "--pp", "--layer-partition", "--gpu", "--gpu-memory",
                "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-budget",
                "--kv-cache-dtype", "--block-size", "--max-model-len", "--max-num-seqs",
                "--max-num-batched-tokens", "--cpu-offload-gib", "--json", "--engine",
                "--plot"):
        assert opt in out


def test_a_cpu_deployment_takes_vllm_cpus_defaults_and_names_vllms_kv_size(capsys,
                                                                          monkeypatch):
    """--device cpu: blocks of 128, `vllm serve`'s CPU batch defaults per rank, no CUDA
    graphs; vLLM's "KV cache size" (concurrency x max_model_len) beside kvmem's tokens. An
    MLA model gets blocks of 16 on a host without AMX tiles (vLLM's reference MLA kernel),
    128 on one with them, whichever host the test runs on."""
    argv = ["plan", "google/gemma-3-4b-it", "--device", "cpu", "--kv-cache-memory-bytes",
            "2GiB", "--max-model-len", "8192", "--tp", "2"]
    d = _json(capsys, argv)
    s, e = d["settings"], d["engine"]
    assert (s["block_size"], s["max_num_batched_tokens"], s["max_num_seqs"]) == (128, 4096, 256)
    assert not s["cuda_graphs"] and e["num_kv_groups"] > 1
    assert e["kv_cache_size_tokens"] == int(e["max_concurrency"] * 8192) != e["tokens"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"KV cache size      {e['kv_cache_size_tokens']:,} tokens (as vLLM 0.33" in out
    assert "GPU memory not given" not in out and "vLLM's CPU build" in out
    given = _json(capsys, argv + ["--block-size", "64", "--max-num-batched-tokens", "512"])
    assert (given["settings"]["block_size"], given["settings"]["max_num_batched_tokens"]) == (
        64, 512)
    for amx, block in ((False, 16), (True, 128)):
        monkeypatch.setattr(vllm_rules, "cpu_amx_tiles", lambda amx=amx: amx)
        assert _json(capsys, ["plan", "deepseek-ai/DeepSeek-V3", "--device", "cpu",
                              "--kv-cache-memory-bytes", "8GiB"])["settings"]["block_size"] == block


def test_a_defaulted_max_num_seqs_is_lowered_to_the_token_budget_as_vllm_does(capsys):
    """In vLLM a max_num_seqs left to its default is at most the token budget (0.32 and 0.33
    start so; tests/test_plan_vllm_rules.py checks vLLM's own code); one given above the
    budget is refused, as vLLM refuses it. kvmem's engine takes both as given."""
    argv = ["plan", "smollm2-135m", "--device", "cpu", "--kv-cache-memory-bytes", "1GiB",
            "--max-model-len", "96", "--max-num-batched-tokens", "64"]
    d = _json(capsys, argv + ["--engine", "vllm"])
    assert (d["settings"]["max_num_batched_tokens"], d["settings"]["max_num_seqs"]) == (64, 64)
    command = d["engine_command"]["argv"]
    assert command[command.index("--max-num-seqs") + 1] == "64"
    assert main(argv + ["--max-num-seqs", "128"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs 128 is more than --max-num-batched-tokens 64: vLLM refuses" in err
    assert err.count("\n") == 1
    ours = _json(capsys, argv + ["--max-num-seqs", "128", "--engine", "kvmem"])["settings"]
    assert (ours["max_num_batched_tokens"], ours["max_num_seqs"]) == (64, 128)
    # a defaulted budget is at most max_num_seqs x max_model_len
    short = _json(capsys, argv[:-4] + ["--max-model-len", "8", "--max-num-seqs", "4"])
    assert short["settings"]["max_num_batched_tokens"] == 32


def test_a_cpu_deployment_needs_its_kv_size(capsys):
    assert main(["plan", "qwen3-8b", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--device cpu needs --kv-cache-memory-bytes" in err and err.count("\n") == 1
