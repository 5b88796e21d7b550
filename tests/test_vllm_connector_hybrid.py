"""``KvmemConnector`` with a hybrid model (full attention beside sliding-window layers)
inside vLLM's CPU build, against plain vLLM, and its per-group rules against vLLM's own.

Live (three vLLM processes, a tiny random Gemma-3: 5 sliding-window layers of window 128
and one full layer, so vLLM's hybrid KV cache manager runs 6 KV cache groups): a pool of
48 blocks of 128 tokens holds one 2,000-token request but not two; chunked prefill (256
tokens a step) and prefix caching on.

1. plain vLLM: prompts A, B, A; its greedy tokens are the reference;
2. vLLM with ``KvmemConnector`` (CPU and disk tiers, every store slowed by 1 s): A, then B
   at once while A's stores are in flight (MISSION problem 3: B needs the blocks A's
   stores hold), then A again, from kvmem's CPU tier. The engine core runs in the script's
   process, and every block vLLM's block pool hands out is checked against the blocks held
   for stores in flight: none may be among them;
3. a fresh vLLM with only the disk tier: A from disk.

``KVMEM_TEST_DROP_STORE_HOLD=1`` runs (2) with the connector freeing a request's blocks
while its stores are still copying (the hold removed), to see the check fail.

Engine-free (one script in vLLM's venv): kvmem's rule for which blocks a group keeps is
vLLM's (``get_num_skipped_tokens`` of its sliding-window and chunked local managers), and
the scheduler side's lookups, loads and stores per KV cache group.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.vllm_cpu import run_script

pytestmark = pytest.mark.vllm

BLOCK_BYTES = 2 * 128 * 64 * 4  # 2 KV heads x 128 tokens x (key + value of 32) x fp32
POOL_BLOCKS = 48

SCRIPT = r"""
import json, os, random, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    mode, model, disk_dir, pool_bytes = sys.argv[1:5]
    kwargs = dict(model=model, dtype="float32", kv_cache_memory_bytes=int(pool_bytes),
                  max_model_len=2048, max_num_batched_tokens=256, enable_chunked_prefill=True,
                  enable_prefix_caching=True, seed=0, enforce_eager=True)
    extra = {
        "plain": None,
        "tiers": {"cpu_offload_gib": 0.25, "disk_offload_dir": disk_dir,
                  "disk_offload_gib": 0.25, "faults": {"store_delay_s": 1.0}},
        "disk": {"disk_offload_dir": disk_dir, "disk_offload_gib": 0.25},
    }[mode]
    if extra is not None:
        from kvmem.integrations.vllm import kv_transfer_config
        kwargs["kv_transfer_config"] = kv_transfer_config(**extra)
    llm = LLM(**kwargs)
    checks = {"allocations": 0, "handed_out_while_held": 0, "unref_held": 0,
              "most_held_while_waiting": 0}
    if mode == "tiers":
        # the engine core runs here (VLLM_ENABLE_V1_MULTIPROCESSING=0): watch its pool
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        pool, side = scheduler.kv_cache_manager.block_pool, scheduler.connector.scheduler_side
        if os.environ.get("KVMEM_TEST_DROP_STORE_HOLD") == "1":
            finished = side.request_finished
            side.request_finished = lambda *a: (finished(*a), (False, None))[1]
        take = pool.get_new_blocks

        def checked(num_blocks):
            blocks = take(num_blocks)
            held = side.held_block_ids()
            checks["allocations"] += 1
            checks["handed_out_while_held"] += sum(b.block_id in held for b in blocks)
            checks["unref_held"] += sum(pool.blocks[b].ref_cnt == 0 for b in held)
            return blocks

        schedule = scheduler.schedule

        def watched(*args, **kwargs):  # how long a waiting request waited on stores
            if scheduler.waiting:
                checks["most_held_while_waiting"] = max(checks["most_held_while_waiting"],
                                                        len(side.held_block_ids()))
            return schedule(*args, **kwargs)

        pool.get_new_blocks = checked
        scheduler.schedule = watched
    rng = random.Random(1)
    prompts = {name: [rng.randrange(10, 250) for _ in range(2000)] for name in "AB"}
    params = SamplingParams(max_tokens=8, temperature=0)

    def run(name):
        (out,) = llm.generate([{"prompt_token_ids": prompts[name]}], params, use_tqdm=False)
        return {"name": name, "tokens": list(out.outputs[0].token_ids),
                "cached": out.num_cached_tokens}

    results = [run("A")] if mode == "disk" else [run("A"), run("B"), run("A")]
    print("RESULT " + json.dumps({"runs": results, "checks": checks}), flush=True)
"""


def _run(mode: str, model: str, disk_dir: str, env: dict | None = None) -> tuple[dict, str]:
    run = run_script(SCRIPT, mode, model, disk_dir, str(POOL_BLOCKS * BLOCK_BYTES),
                     threads_bind="0", timeout=900,
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}).check()
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), run.output


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_models import make_tiny_gemma3

    return str(make_tiny_gemma3(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, str]]:
    disk_dir = str(tmp_path_factory.mktemp("kvmem-disk"))
    return {mode: _run(mode, model, disk_dir) for mode in ("plain", "tiers", "disk")}


@pytest.mark.slow
def test_hybrid_manager_stays_on_and_a_comes_back_from_the_cpu_tier(runs) -> None:
    plain, _ = runs["plain"]
    tiers, log = runs["tiers"]
    assert "kv cache group sizes (128, 128, 128, 128, 128, 128)" in log  # 6 groups
    assert "6 KV cache groups (sliding128,sliding128,sliding128,sliding128,sliding128," \
           "full)" in log
    a, b, again = tiers["runs"]
    assert a["cached"] == 0 and b["cached"] == 0
    # B evicted A from vLLM's pool: plain vLLM recomputes, kvmem loads every full block but
    # the one holding the last prompt token (2,000 tokens: 15 full blocks, 1,920 tokens)
    assert plain["runs"][2]["cached"] < 1920
    assert again["cached"] == 1920
    for ours, reference in zip(tiers["runs"], plain["runs"], strict=True):
        assert ours["tokens"] == reference["tokens"], ours["name"]


@pytest.mark.slow
def test_no_block_held_by_a_store_in_flight_goes_to_another_request(runs) -> None:
    """MISSION problem 3 inside vLLM: B arrives while A's (slowed) stores still hold A's
    blocks and the pool cannot hold both; B waits for them, nothing crashes, and vLLM's
    block pool never hands out a block a store still holds."""
    tiers, log = runs["tiers"]
    checks = tiers["checks"]
    # B was waiting while A's blocks (15 full-attention and 5 window blocks) were held
    assert checks["most_held_while_waiting"] >= 20 and checks["allocations"] > 10
    assert checks["handed_out_while_held"] == 0 and checks["unref_held"] == 0
    assert log.count("store of 20 blocks") == 2  # A's, then B's, each held until copied
    assert "EngineDeadError" not in log and "AssertionError" not in log


@pytest.mark.slow
def test_fresh_process_serves_the_hybrid_prompt_from_disk(runs) -> None:
    plain, _ = runs["plain"]
    disk, _ = runs["disk"]
    (a,) = disk["runs"]
    assert a["cached"] == 1920 and a["tokens"] == plain["runs"][0]["tokens"]

RULES_SCRIPT = r"""
from types import SimpleNamespace as NS

import torch
from vllm.v1.core.single_type_kv_cache_manager import (ChunkedLocalAttentionManager,
                                                       SlidingWindowManager)
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        SlidingWindowSpec)

from kvmem.cache.hashing import hash_request_tokens
from kvmem.integrations.vllm.connector.layout import GroupRule, group_rule
from kvmem.integrations.vllm.connector.meta import TierReport
from kvmem.integrations.vllm.connector.scheduler import SchedulerSide
from kvmem.tiers.blocks import key_name

# -- the rules are vLLM's ------------------------------------------------------------------
common = dict(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
assert group_rule(FullAttentionSpec(**common)) == GroupRule("full")
for window, extra in [(1, 0), (16, 0), (17, 0), (100, 0), (128, 5)]:
    spec = SlidingWindowSpec(sliding_window=window, extra_retained_tokens=extra, **common)
    rule = group_rule(spec)
    vllm_side = NS(sliding_window=window, extra_retained_tokens=extra)
    for n in range(0, 400):
        skipped = SlidingWindowManager.get_num_skipped_tokens(vllm_side, n)
        assert rule.first_kept_block(n, 16) == skipped // 16, (window, extra, n)
for chunk in (16, 48, 100):
    rule = group_rule(ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **common))
    vllm_side = NS(attention_chunk_size=chunk)
    for n in range(0, 400):
        skipped = ChunkedLocalAttentionManager.get_num_skipped_tokens(vllm_side, n)
        assert rule.first_kept_block(n, 16) == skipped // 16, (chunk, n)

# -- lookups, loads and stores per group -----------------------------------------------------
bs = 4
tokens = list(range(200, 241))  # 10 full blocks and 1 token
hashes = hash_request_tokens(tokens, bs)
full, sliding = GroupRule("full"), GroupRule("sliding", 8)  # keeps 2 blocks (7 tokens back)

def request(rid, toks=tokens, computed=0):
    return NS(request_id=rid, all_token_ids=toks, num_tokens=len(toks),
              num_computed_tokens=computed, mm_features=None, prompt_embeds=None,
              lora_request=None, cache_salt=None)

def holding(side, group, blocks):
    side.update_connector_output(NS(finished_sending=None, kv_connector_worker_meta=TierReport(
        {0: [(key_name((group, hashes[b])), True) for b in blocks]})))

side = SchedulerSide([full, sliding], bs, num_ranks=1)
holding(side, 0, range(10))  # the full group holds every block
holding(side, 1, [3, 4, 8, 9])  # the sliding group only two windows' worth
# the longest run every group can be restored to: 10 blocks -> needs sliding 8, 9 (held)
assert side.get_num_new_matched_tokens(request("a"), 0) == (40, False)
# the last prompt token is never loaded: 37 tokens -> 9 blocks -> sliding needs 7, 8: 7 is
# missing, so the run ends where the sliding group's blocks are: 5 blocks (needs 3, 4)
assert side.get_num_new_matched_tokens(request("b", tokens[:37]), 0) == (20, False)
# vLLM's own hit covers the first blocks; the run continues from there
assert side.get_num_new_matched_tokens(request("b", tokens[:37]), 8) == (12, False)
# without the sliding group's window blocks there is no hit past vLLM's own
side2 = SchedulerSide([full, sliding], bs, num_ranks=1)
holding(side2, 0, range(10))
assert side2.get_num_new_matched_tokens(request("c"), 0) == (0, False)
# a full group's missing block ends every run there
side3 = SchedulerSide([full, sliding], bs, num_ranks=1)
holding(side3, 0, [0, 1, 2, 4, 5])
holding(side3, 1, [1, 2, 4])
assert side3.get_num_new_matched_tokens(request("d"), 0) == (12, False)

# loads: every non-null block vLLM allocated in each group, with that group's key
side.get_num_new_matched_tokens(request("a"), 0)
tables = ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [0, 0, 0, 0, 0, 0, 0, 0, 31, 32, 33])
side.update_state_after_alloc(request("a"), NS(get_block_ids=lambda: tables), 40)
(load,) = side.build_connector_meta().loads
assert load.block_ids == [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 31, 32]
assert load.keys == [(0, h) for h in hashes[:10]] + [(1, hashes[8]), (1, hashes[9])]

# stores: a finished request's full blocks in each group that vLLM still holds (a sliding
# group's null blocks are skipped, a full group's prefix stops at one)
side4 = SchedulerSide([full, sliding], bs, num_ranks=1)
holding(side4, 0, [0])
done, _ = side4.request_finished(request("e", computed=41), (
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [0, 0, 0, 0, 0, 0, 0, 0, 0, 40, 41]))
(store,) = side4.build_connector_meta().stores
assert done and store.block_ids == [12, 13, 14, 15, 16, 17, 18, 19, 20, 40]
assert store.keys == [(0, h) for h in hashes[1:10]] + [(1, hashes[9])]
done, _ = side4.request_finished(request("f", computed=41), ([11, 12, 0, 14], [0, 0, 0, 5]))
(store,) = side4.build_connector_meta().stores
assert store.block_ids == [12, 5] and store.keys == [(0, hashes[1]), (1, hashes[3])]

# -- kvmem plan --device cpu: vLLM-CPU's own defaults for `vllm serve` ----------------------
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
from kvmem.plan.estimates import vllm_cpu_defaults
from kvmem.spec import load_spec

import torch

# MLA: the reference CPU kernel's blocks of 16 where the CPU has no AMX tiles
mla_block = 128 if torch.cpu._is_amx_tile_supported() else 16
for world_size in (1, 2, 4):
    batched, seqs = EngineArgs.get_batch_defaults(world_size)
    served = (batched[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER])
    assert vllm_cpu_defaults(load_spec("Qwen/Qwen3-8B"), world_size)[1:] == served, served
    assert vllm_cpu_defaults(load_spec("deepseek-ai/DeepSeek-V3"), world_size)[0] == mla_block
print("HYBRID RULES OK")
"""


def test_group_rules_are_vllms_and_decisions_follow_each_group() -> None:
    """Which blocks a sliding-window or chunked local group keeps, as vLLM's managers
    compute it; lookups stop where any group could not be restored; loads fill each
    group's non-null blocks with that group's keys; stores take what vLLM still holds."""
    assert "HYBRID RULES OK" in run_script(RULES_SCRIPT, timeout=300).check().stdout


@pytest.mark.slow
def test_plan_gives_vllms_kv_cache_size_for_the_hybrid_model(runs, model) -> None:
    """``kvmem plan --device cpu`` prints vLLM's "KV cache size" (concurrency times
    max_model_len) beside its own block tokens, and both match the running engine."""
    _, log = runs["plain"]
    logged = re.findall(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for "
                        r"2,048 tokens per request: ([\d.]+)x", log)
    assert len(logged) == 1, log[-3000:]
    out = subprocess.run(
        [sys.executable, "-m", "kvmem", "plan", model, "--device", "cpu", "--json",
         "--kv-cache-memory-bytes", str(POOL_BLOCKS * BLOCK_BYTES), "--max-model-len", "2048",
         "--max-num-batched-tokens", "256", "--kv-cache-dtype", "fp32"],
        capture_output=True, text=True, check=True).stdout
    engine = json.loads(out)["engine"]
    assert (engine["kv_cache_size_tokens"], f"{engine['max_concurrency']:.2f}") == (
        int(logged[0][0].replace(",", "")), logged[0][1])
    assert engine["num_blocks"] == POOL_BLOCKS and engine["block_size"] == 128
    assert engine["tokens"] == POOL_BLOCKS * 128 // 6  # the blocks' tokens over 6 groups
