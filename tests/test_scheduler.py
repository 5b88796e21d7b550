"""Scheduler policy against the real block manager (no model): token budget, chunked
prefill, max_num_seqs, decode-first ordering, prefix hits, preemption, failures, aborts."""

from __future__ import annotations

import pytest

from kvmem.cache import KVCacheManager
from kvmem.engine.request import Request, RequestStatus
from kvmem.engine.sampling_params import SamplingParams
from kvmem.engine.scheduler import Scheduler
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


def run_step(sched: Scheduler, token: int = 1) -> dict[str, int]:
    """Schedule, then play the model: advance computed tokens and sample ``token``."""
    out = sched.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(token)
    return {r.request_id: n for r, n in out.scheduled}


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
    assert out.failed == [big] and big.status is RequestStatus.FINISHED_ERROR
    assert "too small" in big.error
    assert [r.request_id for r, _ in out.scheduled] == ["small"]


def test_running_request_outgrowing_pool_alone_fails():
    sched = make_scheduler(num_blocks=3)  # 2 usable blocks = 8 tokens
    r = req("r", 7)
    sched.add_request(r)
    run_step(sched)  # 7 prompt tokens + 1 sampled = 8: still fits
    run_step(sched)  # 9th token: no block anywhere, nobody to preempt
    out = sched.schedule()
    assert out.failed == [r] and r.status is RequestStatus.FINISHED_ERROR
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
    for _ in range(500):
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        for r, n in out.scheduled:
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(7)
                if r.num_output_tokens == 6:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
        if not sched.has_unfinished_requests():
            break
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sched.kv_cache_manager.usage().used == 0
