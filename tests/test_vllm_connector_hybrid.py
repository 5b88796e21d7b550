"""``KvmemConnector`` with a hybrid model (full attention beside sliding-window layers)
inside vLLM's CPU build, against plain vLLM, and its per-group rules against vLLM's own.

Engine-free (one script in vLLM's venv): kvmem's rule for which blocks a group keeps is
vLLM's (``get_num_skipped_tokens`` of its sliding-window and chunked local managers), and
the scheduler side's lookups, loads and stores per KV cache group.
"""

from __future__ import annotations

import pytest

from tests.vllm_cpu import run_script

pytestmark = pytest.mark.vllm

RULES_SCRIPT = r"""
from types import SimpleNamespace as NS

import torch
from vllm.v1.core.single_type_kv_cache_manager import (ChunkedLocalAttentionManager,
                                                       SlidingWindowManager)
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        SlidingWindowSpec)

from kvmem.cache.hashing import hash_request_tokens
from kvmem.integrations.vllm.connector_layout import GroupRule, group_rule
from kvmem.integrations.vllm.connector_meta import TierReport
from kvmem.integrations.vllm.connector_scheduler import SchedulerSide
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
print("HYBRID RULES OK")
"""


def test_group_rules_are_vllms_and_decisions_follow_each_group() -> None:
    """Which blocks a sliding-window or chunked local group keeps, as vLLM's managers
    compute it; lookups stop where any group could not be restored; loads fill each
    group's non-null blocks with that group's keys; stores take what vLLM still holds."""
    assert "HYBRID RULES OK" in run_script(RULES_SCRIPT, timeout=300).check().stdout
