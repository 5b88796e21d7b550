"""vLLM's KV cache rules as they changed between releases, on small hand-worked models.

vLLM 0.32 and 0.33 are checked against vLLM's own functions (``test_plan_vllm_rules.py``);
these are the earlier releases' rules as read in their source (``kvmem.plan.vllm_release``),
each figure worked out by hand in the test. Models are built from layer lists: a layer
is ``s`` (sliding window), ``f`` (full) or ``c`` (chunked local), 1 KV head of 32 at fp32
on one rank, so a page of 16 tokens is 16 x 2 x 32 x 4 = 4 KiB.
"""

from __future__ import annotations

import pytest

from kvmem.cli import main
from kvmem.errors import ConfigError
from kvmem.plan import EngineSettings, Layout, RankProfile, plan
from kvmem.plan.planner import engine_geometry
from kvmem.plan.vllm_release import VllmRelease
from kvmem.spec import AttentionKind, LayerKV, ModelSpec

PAGE = 16 * 2 * 32 * 4
KINDS = {"s": AttentionKind.SLIDING, "f": AttentionKind.FULL, "c": AttentionKind.CHUNKED}


def model(layers: str, window: int = 100) -> ModelSpec:
    spec = [LayerKV(i, KINDS[k], 1, 32, window=window if k != "f" else None)
            for i, k in enumerate(layers)]
    return ModelSpec(name="m", architecture="M", model_type="m", num_layers=len(spec),
                     hidden_size=64, num_attention_heads=1, num_kv_heads=1, head_dim=32,
                     intermediate_size=64, vocab_size=64, tie_word_embeddings=False,
                     dtype="float32", max_position_embeddings=None, layers=tuple(spec))


def settings(version: str, max_len: int = 1000, batched: int = 200, **kw) -> EngineSettings:
    return EngineSettings(gpu_memory_utilization=1.0, block_size=16, max_model_len=max_len,
                          max_num_seqs=8, max_num_batched_tokens=batched, cuda_graphs=False,
                          vllm_version=version, **kw)


def geometry(layers: str, version: str, pp: int = 1, **kw):
    s = settings(version, **kw)
    return engine_geometry(model(layers), 1, pp, s, "float32")


def planned(layers: str, version: str, memory: list[int], partition=None, **kw):
    pp = len(partition) if partition else 1
    return plan(model(layers), Layout(pipeline_parallel_size=pp, layer_partition=partition),
                settings(version, **kw), profile=[RankProfile(0, 0, 0, 0, m) for m in memory],
                suggest=False)


def groups(layers: str, version: str, **kw) -> list[tuple[str, tuple[int, ...]]]:
    return [(g.kind, g.layers) for g in geometry(layers, version, **kw).global_groups]


# ---------------------------------------------------------------------- releases
@pytest.mark.parametrize(("text", "version"), [
    ("0.32", (0, 32, 0)), ("v0.11.0", (0, 11, 0)), ("0.10.1.1", (0, 10, 1, 1)),
    ("0.32.0+cpu", (0, 32, 0)), ("0.11.0rc2", (0, 11, 0))])
def test_release_names_read(text, version):
    assert VllmRelease.parse(text).version == version


def test_a_minor_release_has_the_rules_of_its_first_patch():
    # 0.11 is 0.11.0: interleaved groups (0.11.0), logs per worker (until 0.11.0)
    assert VllmRelease.parse("0.11").interleaved_groups
    assert VllmRelease.parse("0.11").logs_per_worker
    assert VllmRelease.parse("0.11").name == "0.11"
    assert groups("sssfsssf", "0.11") == groups("sssfsssf", "0.11.0")


def test_the_oldest_release_named_by_its_minor_version_is_known():
    # the error names 0.9 as known, so "0.9" must be taken (it is 0.9.0)
    assert VllmRelease.parse("0.9").version == (0, 9, 0)
    assert not VllmRelease.parse("0.9").hybrid_manager


@pytest.mark.parametrize("text", ["0.8.5", "0.8", "latest", "1", ""])
def test_a_release_kvmem_does_not_know_is_one_error(text):
    with pytest.raises(ConfigError):
        VllmRelease.parse(text)


def test_a_newer_release_takes_the_newest_rules_and_says_so():
    assert VllmRelease.parse("0.34.1").newer_than_known
    assert not VllmRelease.parse("0.33.2").newer_than_known


# ---------------------------------------------------------------------- charges
def test_the_sliding_window_charge_counts_the_extra_block_even_when_the_window_covers_it():
    # 100-token window, 200 batched, a 150-token request: min(99 + 200, 150) = 150 tokens,
    # cdiv(150, 16) = 10 blocks and the extra one; kvmem's engine holds 10
    g = geometry("sf", "0.25", max_len=150)
    sliding = g.global_groups[0]
    assert g.charge(sliding, 150) == 11
    kvmem = engine_geometry(model("sf"), 1, 1, EngineSettings(
        block_size=16, max_model_len=150, max_num_batched_tokens=200, max_num_seqs=8), "fp32")
    assert kvmem.blocks_per_request(150) == 10 + 10


@pytest.mark.parametrize(("version", "pp", "device", "blocks"), [
    ("0.25", 1, "gpu", 20),  # cdiv(99 + 200, 16) + 1 = 19 + 1
    ("0.26", 1, "gpu", 33),  # 2 batches in flight (async scheduling): cdiv(99 + 400, 16) + 1
    ("0.26", 1, "cpu", 20),  # vLLM-CPU schedules synchronously: 1
    ("0.26", 3, "gpu", 45),  # pp 3 on the V1 runner: 3 batches, cdiv(99 + 600, 16) + 1
    ("0.29", 3, "gpu", 58),  # the V2 runner keeps pp + 1 = 4 in flight: cdiv(899, 16) + 1
    ("0.32", 3, "gpu", 45),
])
def test_tokens_in_flight_follow_the_release_and_the_scheduling(version, pp, device, blocks):
    g = geometry("sfs", version, pp=pp, max_len=5000, device=device)
    assert g.charge(g.global_groups[0], 5000) == blocks


def test_chunked_local_layers_are_full_before_their_spec_and_without_the_manager():
    # Llama-4-like: chunk 100 of a 1,000-token request is cdiv(100 + 200, 16) = 19 blocks;
    # groups of one layer (the fewest of a kind)
    assert groups("cccf", "0.10.0") == [("chunked", (0,)), ("chunked", (1,)),
                                        ("chunked", (2,)), ("full", (3,))]
    assert geometry("cccf", "0.10.0").blocks_per_request(1000) == 3 * 19 + 63
    # 0.9: no chunked spec; 0.10.1 to 0.13: the manager off by default for chunked models
    for version in ("0.9.2", "0.10.1", "0.13.0"):
        assert groups("cccf", version) == [("full", (0, 1, 2, 3))], version
    assert groups("cccf", "0.32", hybrid_kv_cache_manager=False) == [("full", (0, 1, 2, 3))]


@pytest.mark.parametrize(("version", "chunk_blocks"), [
    ("0.14.0", 19), ("0.19.1", 19), ("0.32", 32), ("0.33", 32)])
def test_chunked_local_layers_keep_the_hybrid_manager_from_0_14(version, chunk_blocks):
    # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE defaults to 1 from 0.14: a chunked
    # model keeps its chunked groups, and one request of 1,000 tokens needs 3 chunked
    # charges + 63 blocks of one layer's page, not 63 blocks of four layers' pages. A
    # chunked charge is cdiv(100 + 200, 16) = 19, from 0.26 cdiv(100 + 2 x 200, 16) = 32
    # (two batches in flight under asynchronous scheduling)
    need = 3 * chunk_blocks + 63
    assert groups("cccf", version) == [("chunked", (0,)), ("chunked", (1,)),
                                       ("chunked", (2,)), ("full", (3,))]
    assert geometry("cccf", version).blocks_per_request(1000) == need
    on = planned("cccf", version, [4 * PAGE * 1200])
    off = planned("cccf", version, [4 * PAGE * 1200], hybrid_kv_cache_manager=False)
    assert on.engine.max_concurrency == 4800 / need
    assert off.engine.max_concurrency == 1200 / 63  # 19.0: what kvmem said before


def test_without_the_hybrid_manager_sliding_layers_are_full_attention():
    assert groups("ssf", "0.9.0") == [("full", (0, 1, 2))]  # 0.9.0 had no hybrid manager
    split = [("sliding", (0,)), ("sliding", (1,)), ("full", (2,))]
    assert groups("ssf", "0.9.1") == split
    assert groups("ssf", "0.10.1", device="cpu") == [("full", (0, 1, 2))]  # not on CPU yet
    assert groups("ssf", "0.10.2", device="cpu") == split


# ---------------------------------------------------------------------- groups
def test_groups_are_consecutive_runs_before_0_11_and_interleaved_after():
    layers = "sssfsssf"  # 6 sliding, 2 full: groups of 2
    assert groups(layers, "0.10.2") == [("sliding", (0, 1)), ("sliding", (2, 4)),
                                        ("sliding", (5, 6)), ("full", (3, 7))]
    assert groups(layers, "0.11.0") == [("sliding", (0, 4)), ("sliding", (1, 5)),
                                        ("sliding", (2, 6)), ("full", (3, 7))]


@pytest.mark.parametrize(("version", "size"), [("0.11.0", 10), ("0.12.0", 10), ("0.18.0", 14)])
def test_the_group_size_ratio_rule(version, size):
    # 14 sliding and 10 full: 1.4 x the fewest, under 1.5 (0.18) but not under 1.25 (0.12)
    found = groups("s" * 14 + "f" * 10, version)
    assert max(len(layers) for _, layers in found) == size


def test_a_stage_holds_fewer_layers_per_group_when_groups_interleave():
    """pp 2 over sssfsssf (4 + 4 layers): interleaved groups put one layer of each group
    on each stage (a block is 1 page); before 0.11 stage 0 grouped its own three sliding
    layers and one full layer in groups of one."""
    p = planned("sssfsssf", "0.11.0", [100 * PAGE] * 2, partition=[4, 4])
    assert [r.bytes_per_block for r in p.ranks] == [PAGE, PAGE]
    old = planned("sssfsssf", "0.10.2", [100 * PAGE] * 2, partition=[4, 4])
    assert [r.bytes_per_block for r in old.ranks] == [PAGE, PAGE]
    old = planned("ssssssff", "0.10.2", [100 * PAGE] * 2, partition=[4, 4])
    # stage 0 holds only sliding layers: one group of 4, a block is 4 pages; stage 1 (ssff)
    # groups of 2
    assert [r.bytes_per_block for r in old.ranks] == [4 * PAGE, 2 * PAGE]
    new = planned("ssssssff", "0.11.0", [100 * PAGE] * 2, partition=[4, 4])
    # global groups of 2: sliding [0,3,..] interleaved: stage 0 holds 2 of group 0
    assert [r.bytes_per_block for r in new.ranks] == [2 * PAGE, 2 * PAGE]


# ---------------------------------------------------------------------- reports
def test_the_kv_cache_size_formula_changed_in_0_20_1():
    # sf at 1,000 tokens: sliding cdiv(min(299, 1000), 16) + 1 = 20, full 63: 83 blocks
    for version, tokens in (("0.20.0", 1000 // 2 * 16), ("0.20.1", int(1000 / 83 * 1000))):
        p = planned("sf", version, [1000 * PAGE])
        assert p.engine.num_blocks == 1000
        assert p.engine.kv_cache_size_tokens == tokens, version
        assert p.engine.max_concurrency == 1000 / 83


def test_0_9_0_logged_concurrency_as_tokens_over_max_model_len():
    p = planned("ff", "0.9.0", [100 * 2 * PAGE])
    assert (p.engine.kv_cache_size_tokens, p.engine.max_concurrency) == (1600, 1.6)


def test_per_worker_logs_until_0_11_0_use_each_workers_own_blocks():
    g = geometry("ffff", "0.10.2", pp=2)
    assert g.kv_cache_size(300, 1000, [0, 1]) == (300 * 16, 300 / 63)


# ---------------------------------------------------------------------- the start-up check
def test_the_check_per_release_on_a_hybrid_model():
    """sssf at 1,000 tokens: a sliding layer is charged 20 blocks, the full one 63; groups
    of 1, so a block is one page."""
    def need(version: str, pp=None) -> list[int]:
        return [r.need_bytes_at_max_model_len
                for r in planned("sssf", version, [200 * PAGE] * len(pp or [4]), pp).ranks]

    assert need("0.13") == [(3 * 20 + 63) * PAGE]  # each layer's own
    assert need("0.16") == [20 * PAGE]  # group 0 (sliding) charged for the whole model
    assert need("0.18") == [20 * PAGE]  # group 0 charged, per worker
    assert need("0.19") == [(3 * 20 + 63) * PAGE]  # all groups
    # and the null block; from 0.26 two batches in flight: cdiv(99 + 400, 16) + 1 = 33
    assert need("0.29") == [(3 * 33 + 63 + 1) * PAGE]
    # 0.14 to 0.16 check the whole model on every stage; 0.17 on each stage's own layers
    assert need("0.16", [2, 2]) == [20 * PAGE] * 2
    assert need("0.13", [2, 2]) == [40 * PAGE, (20 + 63) * PAGE]


def test_mission_problem_1_under_the_global_check():
    """tp 8 x pp 2, 1,000,000 tokens: vLLM 0.14 to 0.16 count all 56 layers (one KV head
    each at tp 8: 27.95 GiB) against one worker's 15.57 GiB; each rank needs 13.98 GiB."""
    from tests.test_plan import _problem1_model

    def run(version: str):
        return plan(_problem1_model(), Layout(tensor_parallel_size=8, pipeline_parallel_size=2),
                    EngineSettings(kv_cache_memory_bytes=int(15.57 * (1 << 30)),
                                   max_model_len=1_000_000, vllm_version=version))

    old, new = run("0.15"), run("0.17")
    per_token = 56 * 2 * 134 * 2
    assert old.ranks[0].need_bytes_at_max_model_len == 62_500 * 16 * per_token
    assert not old.engine.fits and new.engine.fits
    assert new.ranks[0].need_bytes_at_max_model_len == 62_500 * 16 * per_token // 2


# ---------------------------------------------------------------------- the command line
def test_the_command_line_picks_the_rules(capsys):
    import json

    argv = ["plan", "google/gemma-3-4b-it", "--device", "cpu", "--kv-cache-memory-bytes",
            "1GiB", "--max-model-len", "4096", "--json"]

    def engine(*extra: str) -> dict:
        assert main(argv + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["engine"]

    assert engine()["rules"] == "vLLM 0.33"
    assert engine("--vllm-version", "0.19")["rules"] == "vLLM 0.19"
    assert engine("--engine", "kvmem")["rules"] == "kvmem"
    tight, loose = engine("--max-concurrent-batches", "1"), engine(
        "--max-concurrent-batches", "4")
    assert tight["max_concurrency"] > loose["max_concurrency"]
    assert engine("--disable-hybrid-kv-cache-manager")["num_kv_groups"] == 1
    assert main(argv + ["--disable-hybrid-kv-cache-manager", "--engine", "vllm"]) == 0
    command = json.loads(capsys.readouterr().out)["engine_command"]["argv"]
    assert command[-1] == "--disable-hybrid-kv-cache-manager"


@pytest.mark.parametrize(("argv", "message"), [
    (["--vllm-version", "0.5"], "kvmem knows the KV cache rules of vLLM 0.9 to 0.33"),
    (["--vllm-version", "x"], "cannot read 'x' as a vLLM version"),
    (["--engine", "kvmem", "--vllm-version", "0.32"], "--vllm-version names vLLM's rules"),
])
def test_bad_rule_flags_are_one_line(capsys, argv, message):
    assert main(["plan", "qwen3-8b", "--gpu", "H100", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_without_a_model_is_one_line(capsys):
    assert main(["plan"]) == 2
    assert "give MODEL" in capsys.readouterr().err
