"""Scheduler policy against the real block manager (no model): token budget, chunked
prefill, max_num_seqs, decode-first ordering, prefix hits, preemption, failures, aborts,
and the step message it emits (block ids reach the runners only through it)."""

from __future__ import annotations

import pytest

from kvmem.cache import KVCacheManager
from kvmem.engine.request import Request, RequestStatus
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.scheduler import Scheduler
from kvmem.engine.step import ModelRunnerOutput, SchedulerOutput
from kvmem.spec import AttentionKind, KVGroup

BLOCK = 4


def make_scheduler(num_blocks: int = 64, *, budget: int = 64, max_num_seqs: int = 8,
                   prefix_caching: bool = True) -> Scheduler:
    mgr = KVCacheManager([KVGroup(0, AttentionKind.FULL, None, (0,))], num_blocks, BLOCK,
                         enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget)
    return Scheduler(mgr, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     enable_prefix_caching=prefix_caching)


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def play(sched: Scheduler, out: SchedulerOutput, token: int = 1):
    """Play the model: sample ``token`` for each request that completes its known tokens,
    and let the scheduler close the step."""
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = sched.requests.get(rid)  # None: finished since
        if r is not None and r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = token
    return sched.update_from_output(out, ModelRunnerOutput(sampled))


def run_step(sched: Scheduler, token: int = 1) -> dict[str, int]:
    """Schedule, then play the model; the tokens scheduled per request."""
    out = sched.schedule()
    play(sched, out, token)
    return dict(out.num_scheduled_tokens)


def test_token_budget_chunks_prefill_and_mixes_decodes():
    sched = make_scheduler(budget=16)
    for r in (req("a", 10), req("b", 10, start=100), req("c", 10, start=200)):
        sched.add_request(r)
    assert run_step(sched) == {"a": 10, "b": 6}  # b's prompt is chunked
    assert run_step(sched) == {"a": 1, "b": 4, "c": 10}  # decode first, then b's rest
    assert run_step(sched) == {"a": 1, "b": 1, "c": 1}


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", 5, start=10 * i))
    assert set(run_step(sched)) == {"r0", "r1"}
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_prefix_hit_skips_cached_blocks():
    sched = make_scheduler()
    first = req("a", 13)
    sched.add_request(first)
    run_step(sched)
    sched.finish_request(first, RequestStatus.FINISHED_STOPPED)
    second = Request("b", list(range(12)) + [99, 98], SamplingParams())
    sched.add_request(second)
    assert run_step(sched) == {"b": 2}  # 12 tokens (3 blocks) came from the cache
    assert second.num_cached_tokens == 12
    assert sched.stats.prefix_hit_tokens == 12


def test_a_state_checkpoint_from_the_last_step_is_hit():
    """A linear-attention hybrid: the state after 8 tokens, cached in step 1, is a prefix hit
    in step 2 (a hit on a checkpoint of the current step would have to wait)."""
    groups = [KVGroup(0, AttentionKind.FULL, None, (0,)),
              KVGroup(1, AttentionKind.LINEAR, None, (1,))]
    mgr = KVCacheManager(groups, 64, BLOCK, max_num_batched_tokens=8)
    sched = Scheduler(mgr, max_num_seqs=8, max_num_batched_tokens=8)
    sched.add_request(req("a", 9))
    assert run_step(sched) == {"a": 8}  # the chunk ends on a block boundary
    second = Request("b", list(range(8)) + [99, 98], SamplingParams())
    sched.add_request(second)
    assert run_step(sched) == {"a": 1, "b": 2}
    assert second.num_cached_tokens == 8


def test_preempts_newest_first_and_requeues_it_in_front():
    sched = make_scheduler(num_blocks=7)  # 6 usable blocks = 24 tokens
    a, b, c = req("a", 8), req("b", 8, start=100), req("c", 4, start=200)
    for r in (a, b, c):
        sched.add_request(r)
    run_step(sched)  # a: 2 blocks, b: 2 blocks, c: 1 block; 1 block left
    scheduled = run_step(sched)  # a takes the last block; b needs one too -> c is preempted
    assert scheduled == {"a": 1, "b": 1}
    assert a.status is b.status is RequestStatus.RUNNING
    assert c.status is RequestStatus.PREEMPTED and list(sched.waiting) == [c]
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("c") == ([],)
    sched.add_request(req("d", 2, start=300))
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert "c" in run_step(sched)  # the preempted request goes before newer arrivals
    assert sched.stats.num_preemptions == 1


def test_request_that_can_never_fit_fails_and_others_continue():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    big, small = req("big", 20), req("small", 3, start=50)
    sched.add_request(big)
    sched.add_request(small)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["small"]
    updates = play(sched, out)
    assert [u.request for u in updates if u.request.is_finished] == [big]
    assert big.status is RequestStatus.FINISHED_ERROR and "too small" in big.error


def test_running_request_outgrowing_pool_alone_fails():
    sched = make_scheduler(num_blocks=3)  # 2 usable blocks = 8 tokens
    r = req("r", 7)
    sched.add_request(r)
    run_step(sched)  # 7 prompt tokens + 1 sampled = 8: still fits
    run_step(sched)  # 9th token: no block anywhere, nobody to preempt
    out = sched.schedule()
    assert out.is_empty
    assert [u.request for u in play(sched, out)] == [r]
    assert r.status is RequestStatus.FINISHED_ERROR
    assert sched.kv_cache_manager.usage().used == 0 and not sched.has_unfinished_requests()


def test_abort_frees_blocks_of_running_and_removes_waiting():
    sched = make_scheduler(max_num_seqs=1)
    a, b = req("a", 9), req("b", 9, start=40)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert sched.kv_cache_manager.usage().used == 3
    aborted = sched.abort_requests(["a", "b", "unknown"])
    assert {r.request_id for r in aborted} == {"a", "b"}
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert sched.kv_cache_manager.usage().used == 0
    assert not sched.has_unfinished_requests()


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_never_exceeds_budget_and_finishes_everything(budget):
    sched = make_scheduler(num_blocks=12, budget=budget, max_num_seqs=3)
    reqs = [req(f"r{i}", 5 + 3 * i, start=20 * i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    for r in reqs:
        r.sampling_params.max_tokens = 6
    for _ in range(500):
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget
        play(sched, out, token=7)
        if not sched.has_unfinished_requests():
            break
    assert all(r.num_output_tokens == 6 and r.status is RequestStatus.FINISHED_LENGTH
               for r in reqs)
    assert sched.kv_cache_manager.usage().used == 0


def test_step_message_carries_new_tables_then_block_deltas():
    """A request's first step sends its whole block table; later steps only the blocks
    added. Preemption makes the runners drop it, and it comes back as new; a finished
    request is named once, in the next step."""
    sched = make_scheduler(num_blocks=7)
    a, b = req("a", 7), req("b", 8, start=100)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert set(new) == {"a", "b"} and not out.scheduled_cached_reqs
    assert new["a"].token_ids == list(range(7)) and new["a"].num_computed_tokens == 0
    assert new["a"].block_ids == sched.kv_cache_manager.get_block_ids("a")
    assert new["a"].block_ids is not sched.kv_cache_manager.get_block_ids("a")  # a copy
    play(sched, out, token=5)
    out = sched.schedule()  # a: its 8th token fills block 2; b: a 9th token needs block 3
    cached = {c.req_id: c for c in out.scheduled_cached_reqs}
    assert cached["a"].new_token_ids == [5] and cached["a"].new_block_ids == ([],)
    assert cached["b"].new_token_ids == [5] and len(cached["b"].new_block_ids[0]) == 1
    assert cached["b"].num_computed_tokens == 8
    play(sched, out)
    c = req("c", 12, start=200)
    sched.add_request(c)  # needs 3 blocks: only 1 is free, so it waits
    out = sched.schedule()
    assert "c" not in out.num_scheduled_tokens
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    play(sched, out)
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and "c" in out.num_scheduled_tokens
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]


def test_siblings_of_one_prompt_share_its_full_blocks_in_their_first_step():
    """n samples of one prompt (sibling requests) admitted in one step: the first caches
    its full prompt blocks as it allocates them, the others hit them, so the full blocks
    are held once (ref counts) and only the partial last block is per sibling."""
    sched = make_scheduler(num_blocks=32)
    siblings = [Request(f"p-{i}", list(range(10)), SamplingParams(max_tokens=4))
                for i in range(3)]
    for r in siblings:
        sched.add_request(r)
    out = sched.schedule()
    tables = [n.block_ids[0] for n in out.scheduled_new_reqs]
    assert [t[:2] for t in tables] == [tables[0][:2]] * 3  # 2 full blocks, shared
    assert len({t[2] for t in tables}) == 3  # the partial block is each sibling's own
    assert [out.num_scheduled_tokens[r.request_id] for r in siblings] == [10, 2, 2]
    assert sched.kv_cache_manager.usage().used == 2 + 3


class RecordingKVMemory:
    """A shared KV limit that refuses nothing of its own and records each ask."""

    def __init__(self) -> None:
        self.asks: list[list[int]] = []

    def fits_limit(self, num_tokens: int) -> bool:
        return True

    def excess_pages(self) -> int:
        return 0

    def want(self, num_tokens: list[int]) -> bool:
        self.asks.append(list(num_tokens))
        return False

    def backoff(self) -> None:
        pass


def test_an_ask_for_shared_memory_covers_each_request_to_its_finish():
    """Short of blocks, the scheduler asks other engines once for what the running and
    waiting requests hold by their finish (prompt + max_tokens, within max_model_len), so
    a burst is asked for once rather than again at every block a decode fills."""
    memory = RecordingKVMemory()
    mgr = KVCacheManager([KVGroup(0, AttentionKind.FULL, None, (0,))], 8, BLOCK,
                         enable_prefix_caching=False, max_num_batched_tokens=64)
    sched = Scheduler(mgr, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40,
                      enable_prefix_caching=False, kv_memory=memory)
    sched.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=10)))
    sched.add_request(Request("b", list(range(100, 116)), SamplingParams(max_tokens=100)))
    play(sched, sched.schedule())  # a takes 5 of the 7 blocks; b's 4 do not fit
    assert memory.asks == [[30, 40]]  # a: 20 + 10; b: 16 + 100, within max_model_len 40
