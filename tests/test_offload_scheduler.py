"""The scheduler with an offload connector, against the real block manager and CPU tier (no
model): finished requests are offered, a tier hit parks the request while it loads (it
counts toward max_num_seqs and can be aborted), and a lone request short of blocks that
transfers hold is preempted to wait for them instead of failing. A hybrid model (full +
sliding-window groups) loads only the blocks each group needs for the hit, into blocks
that the block manager takes all-or-nothing and makes findable only after the load."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmem.cache import NULL_BLOCK_ID, KVCacheManager, PrefixHit
from kvmem.cache.coordinator import LOAD_BLOCK
from kvmem.engine.request import Request, RequestStatus
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.scheduler import Scheduler
from kvmem.engine.step import ModelRunnerOutput
from kvmem.memory.storage import SlotShape, TensorKVStorage
from kvmem.spec import AttentionKind, KVGroup
from kvmem.tiers import Faults, OffloadConfig, OffloadConnector, OffloadManager

BLOCK = 4
SHAPE = SlotShape(num_kv=2, block_size=BLOCK, num_heads=1, head_dim=4)
FULL = [KVGroup(0, AttentionKind.FULL, None, (0,))]
# layer 0 full attention, layer 1 a sliding window of one block: at a hit of L blocks the
# window needs only block L - 1
HYBRID = [*FULL, KVGroup(1, AttentionKind.SLIDING, BLOCK, (1,))]


class GatedConnector(OffloadConnector):
    """The real connector whose transfers only complete (holds released, loads returned)
    while the gate is open, so the test decides when in-flight work finishes."""

    gate_open = False

    def poll(self):
        if not self.gate_open:
            return []
        assert self.offload.engine.wait_idle(10)  # every queued copy has run
        return super().poll()


@pytest.fixture
def setup():
    made = []

    def make(num_blocks: int = 32, max_num_seqs: int = 8, groups=FULL):
        mgr = KVCacheManager(groups, num_blocks, BLOCK, enable_prefix_caching=True,
                             max_num_batched_tokens=64)
        storage = TensorKVStorage(num_blocks, 1, SHAPE, torch.float32)
        storage.slot_tensor(0).copy_(torch.randn(storage.slot_tensor(0).shape,
                                                 generator=torch.Generator().manual_seed(0)))
        offload = OffloadManager(OffloadConfig(cpu_bytes=1 << 20), storage, 1, mgr,
                                 model="m", layout="l")
        connector = GatedConnector(offload, mgr)
        connector.storage = storage
        made.append(connector)
        sched = Scheduler(mgr, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          offload=connector)
        return sched, connector

    yield make
    for connector in made:
        connector.shutdown()


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def run_step(sched: Scheduler):
    """Schedule, then play the model: sample a token for each request that completes its
    known tokens, and let the scheduler close the step."""
    out = sched.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = sched.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = 1
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out


def finish(sched: Scheduler, request: Request) -> None:
    """Run ``request`` until it samples its first token, then finish it."""
    while not request.output_token_ids:
        run_step(sched)
    sched.finish_request(request, RequestStatus.FINISHED_STOPPED)


def store_and_forget(sched: Scheduler, connector: GatedConnector, request: Request) -> None:
    """Run ``request`` to the end, let its blocks reach the CPU tier, then drop them from
    the device pool's prefix cache so that only the tier has them."""
    sched.add_request(request)
    finish(sched, request)
    connector.gate_open = True
    sched.schedule()  # polls: the copies finish and the holds are released
    connector.gate_open = False
    assert sched.kv_cache_manager.reset_prefix_cache()


def test_finished_request_blocks_are_offered_to_the_tier(setup):
    sched, connector = setup()
    a = req("a", 13)
    sched.add_request(a)
    finish(sched, a)  # 14 tokens with the sampled one: 3 full blocks
    assert sched.kv_cache_manager.usage().held == 3  # held until the copies are done
    connector.gate_open = True
    sched.schedule()
    assert connector.stats()["cpu"].stored_blocks == 3
    assert sched.kv_cache_manager.usage().held == 0


def test_tier_hit_parks_the_request_and_counts_toward_max_num_seqs(setup):
    sched, connector = setup(max_num_seqs=1)
    store_and_forget(sched, connector, req("a", 13))
    again, other = req("a-again", 13), req("other", 5, start=500)
    sched.add_request(again)
    sched.add_request(other)
    out = sched.schedule()
    assert out.is_empty and sched.loading == [again] and sched.num_running == 0
    assert sched.has_unfinished_requests() and list(sched.waiting) == [other]
    connector.gate_open = True
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a-again", 1)]
    assert again.num_computed_tokens == 12 and again.num_cached_tokens == 12
    assert sched.stats.prefix_hit_tokens == 12
    assert list(sched.waiting) == [other]  # max_num_seqs 1: still waiting
    assert connector.stats()["cpu"].hits == 3


def test_aborting_a_parked_request_frees_its_blocks(setup):
    sched, connector = setup()
    store_and_forget(sched, connector, req("a", 13))
    again = req("a-again", 13)
    sched.add_request(again)
    sched.schedule()
    assert sched.loading == [again] and sched.kv_cache_manager.usage().used == 3
    assert sched.abort_requests(["a-again"]) == [again]
    assert again.status is RequestStatus.FINISHED_ABORTED
    assert not sched.loading and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage().used == 0


class StuckRead(Faults):
    """Every block read waits until ``go`` is set: a tier's file system that hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def before_read(self) -> None:
        self.go.wait(60)


def test_aborting_a_request_whose_load_hangs_does_not_wait_for_it(setup):
    """The step that aborts a request loading from a tier that hangs goes on at once; the
    blocks the load writes into stay held (not reused) until the load is done."""
    sched, connector = setup()
    store_and_forget(sched, connector, req("a", 13))
    stuck = StuckRead()
    for tier in connector.offload.tiers:
        tier.faults = stuck
    again = req("a-again", 13)
    sched.add_request(again)
    sched.schedule()
    assert sched.loading == [again]
    assert sched.abort_requests(["a-again"]) == [again]  # returns while the read hangs
    usage = sched.kv_cache_manager.usage()
    assert not stuck.go.is_set() and usage.used == 0 and usage.held == 3
    stuck.go.set()
    connector.gate_open = True
    sched.schedule()
    assert sched.kv_cache_manager.usage().held == 0


def test_a_load_that_fails_in_the_tiers_code_fails_its_request_alone(setup, monkeypatch):
    """Completing a load raises for one request: it fails (its blocks freed, its stage
    tier_load) and the request beside it is admitted from its own load as usual."""
    sched, connector = setup()
    store_and_forget(sched, connector, req("a", 13))
    store_and_forget(sched, connector, req("b", 13, start=300))
    bad, good = req("a-again", 13), req("b-again", 13, start=300)
    sched.add_request(bad)
    sched.add_request(good)
    sched.schedule()
    assert sched.loading == [bad, good]
    num_computed = connector.kv.num_computed_tokens

    def failing_for_bad(rid):
        if rid == "a-again":
            raise RuntimeError("injected")
        return num_computed(rid)

    monkeypatch.setattr(connector.kv, "num_computed_tokens", failing_for_bad)
    connector.gate_open = True
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("b-again", 1)]
    assert bad.status is RequestStatus.FINISHED_ERROR and bad.failure.stage == "tier_load"
    assert "RuntimeError: injected" in bad.error
    assert [u.request for u in sched.update_from_output(out, ModelRunnerOutput())] == [bad]
    assert sched.kv_cache_manager.usage().used == 4  # b-again's 3 loaded blocks and 1 new


def test_lone_request_short_of_held_blocks_waits_instead_of_failing(setup):
    """10 usable blocks, 3 held by a finished request's copies: a lone request that grows
    to 8 blocks cannot get its 8th, is preempted rather than failed, and runs once the
    copies are done."""
    sched, connector = setup(num_blocks=11)
    a = req("a", 13, start=900)
    sched.add_request(a)
    finish(sched, a)
    assert sched.kv_cache_manager.usage().held == 3
    r = req("r", 24)
    sched.add_request(r)
    for _ in range(8):  # prefill (6 blocks), then decodes into blocks 7 and 8
        run_step(sched)
        if r.status is not RequestStatus.RUNNING:
            break
    assert r.status is RequestStatus.PREEMPTED and sched.stats.num_preemptions == 1
    assert list(sched.waiting) == [r]
    connector.gate_open = True
    out = run_step(sched)
    assert list(out.num_scheduled_tokens) == ["r"] and r.status is RequestStatus.RUNNING


def test_wait_blocks_until_the_parked_load_lands(setup):
    """What an engine with nothing else to run does instead of spinning on poll."""
    sched, connector = setup()
    assert connector.wait(5) is False  # nothing parked: returns at once
    store_and_forget(sched, connector, req("a", 13))
    again = req("a-again", 13)
    sched.add_request(again)
    sched.schedule()
    assert sched.loading == [again]
    assert connector.wait(60) is True
    connector.gate_open = True
    assert list(sched.schedule().num_scheduled_tokens) == ["a-again"]


def test_hybrid_hit_loads_only_the_blocks_each_group_needs(setup):
    """Full attention needs blocks 0..2 of a 3-block hit, the sliding window only block 2;
    the window's earlier entries are null, and the loaded rows are the stored ones."""
    sched, connector = setup(groups=HYBRID)
    mgr, slot = sched.kv_cache_manager, connector.storage.slot_tensor(0)
    a = req("a", 13)
    sched.add_request(a)
    finish(sched, a)
    stored = [{i: slot[b].clone() for i, b in enumerate(table[:3])}
              for table in mgr.get_block_ids("a")]
    connector.gate_open = True
    sched.schedule()
    connector.gate_open = False
    assert mgr.reset_prefix_cache() and connector.stats()["cpu"].stored_blocks == 6

    again = req("a-again", 13)
    sched.add_request(again)
    assert sched.schedule().is_empty and sched.loading == [again]
    full, sliding = mgr.get_block_ids("a-again")
    assert len(full) == 3 and sliding[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert mgr.usage().used == 4 and connector.stats()["cpu"].hits == 4
    # blocks on their way are not findable by hash
    assert mgr.get_computed_blocks(req("peek", 13)).num_tokens == 0

    connector.gate_open = True
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a-again", 1)]
    assert again.num_cached_tokens == 12 and sched.stats.prefix_hit_tokens == 12
    for g, table in enumerate((full, sliding)):
        for i, expected in stored[g].items():
            if table[i] != NULL_BLOCK_ID:
                assert torch.equal(slot[table[i]], expected)
    assert mgr.get_computed_blocks(req("peek", 13)).num_tokens == 12  # loaded: now cached


def test_hybrid_hit_mixes_pool_and_tier_blocks(setup):
    """The device pool holds the first two blocks of each group again (a 2-block hit), the
    tier the third: the hit adopts the pool's blocks and loads only the third ones."""
    sched, connector = setup(groups=HYBRID)
    mgr = sched.kv_cache_manager
    store_and_forget(sched, connector, req("a", 13))
    b = req("b", 9)  # a's first 9 tokens: brings blocks 0 and 1 back into the pool
    sched.add_request(b)
    connector.gate_open = True
    finish(sched, b)
    sched.schedule()
    connector.gate_open = False
    pooled = [mgr.lookup_hash(0, h) for h in mgr.request_block_hashes(req("peek", 13), 2)]
    assert None not in pooled
    assert mgr.get_computed_blocks(req("peek", 13)).num_tokens == 8  # the pool alone
    hits_before = connector.stats()["cpu"].hits
    again = req("a-again", 13)
    sched.add_request(again)
    sched.schedule()
    assert sched.loading == [again]
    full, sliding = mgr.get_block_ids("a-again")
    assert full[:2] == pooled and full[2] not in pooled
    assert sliding[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID] and sliding[2] != NULL_BLOCK_ID
    assert connector.stats()["cpu"].hits - hits_before == 2
    connector.gate_open = True
    assert list(sched.schedule().num_scheduled_tokens.items()) == [("a-again", 1)]
    assert again.num_computed_tokens == 12


def test_a_hit_with_blocks_to_load_is_all_or_nothing_and_cached_only_after():
    mgr = KVCacheManager(HYBRID, 7, BLOCK)  # 6 usable blocks
    r = req("r", 13)
    hashes = mgr.request_block_hashes(r, 3)
    hit = PrefixHit(12, ([LOAD_BLOCK] * 3, [NULL_BLOCK_ID, NULL_BLOCK_ID, LOAD_BLOCK]),
                    hashes, mgr.pool.epoch)
    with pytest.raises(ValueError, match="no new tokens"):
        mgr.allocate_slots(r, 1, prefix_hit=hit)
    other = req("other", 7, start=500)
    assert mgr.allocate_slots(other, 7)  # two blocks in each group: 2 of 6 left
    refused = mgr.allocate_slots(r, 0, prefix_hit=hit)
    assert not refused and refused.needed_blocks == 4
    assert not mgr.has_request("r") and mgr.usage().used == 4
    mgr.free(other)
    new_ids = mgr.allocate_slots(r, 0, prefix_hit=hit).new_block_ids
    full, sliding = (list(table) for table in mgr.get_block_ids("r"))
    assert new_ids == (full, [sliding[2]]) and len(set(full) | {sliding[2]}) == 4
    assert sliding[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID] and mgr.num_computed_tokens("r") == 12
    peek = req("peek", 13)
    assert mgr.get_computed_blocks(peek).num_tokens == 0  # not findable while loading
    assert mgr.allocate_slots(r, 1)  # the next token: the loaded blocks become findable
    assert mgr.get_computed_blocks(peek).blocks == (full, [NULL_BLOCK_ID] * 2 + sliding[2:3])
