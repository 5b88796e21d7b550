"""One serving trace replayed over a block manager, recording every decision it makes.

The same seeded trace drives kvmem's ``KVCacheManager`` (in kvmem's venv) and vLLM's own
``KVCacheManager`` (run as a script inside a vLLM venv: ``python cache_replay.py CASES``),
so ``tests/test_cache_vllm_replay.py`` can compare them.

The driver is a small scheduler: every step it calls ``new_step``, then gives each running
request its next prefill chunk (at most ``CHUNK`` tokens, ending on a block boundary and
stopping at the last block boundary before the prompt's last token, where a state
checkpoint can be cached, as vLLM's scheduler splits prefills for Mamba "align") or one
decode token, preempting the newest other running request when a request gets no blocks;
then admits waiting requests in order (prefix lookup, first chunk) until one gets no
blocks or ``MAX_RUNNING`` run. Prompts share a few prefixes, so later requests hit the
cache, and the pool is small, so cached blocks are evicted and requests are preempted.

Recorded per operation: the prefix hit in tokens, each allocation's outcome and new block
ids per group (null entries included), preemptions, finishes, and the free block count at
the end of every step.
"""

from __future__ import annotations

import json
import math
import random
import sys

BS = 16
MAX_MODEL_LEN = 1024
MAX_RUNNING = 8
CHUNK = 96  # prefill tokens per request per step (a multiple of BS)

# the groups of each model: ("full" | "sliding" | "state", window)
MODELS: dict[str, list[tuple[str, int | None]]] = {
    "full": [("full", None)],
    "sliding": [("full", None), ("sliding", 40)],
    # Qwen3-Next-like: 3 gated-delta-net layers : 1 full attention layer
    "gdn": [("full", None), ("state", None), ("state", None), ("state", None)],
    # Nemotron-H-like Mamba2 hybrid: mostly Mamba2 layers, a few attention layers
    "mamba2": [("state", None), ("state", None), ("state", None), ("state", None),
               ("full", None)],
}


def trace(seed: int, num_requests: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) token ids of each request."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(rng.randrange(64, 257))]
                for _ in range(4)]
    requests = []
    for _ in range(num_requests):
        n = rng.randrange(17, 401)
        prompt = [rng.randrange(1, 30_000) for _ in range(n)]
        if rng.random() < 0.5:
            prefix = rng.choice(prefixes)
            prompt = (prefix + prompt)[:max(n, len(prefix) + rng.randrange(0, 40))]
        output = [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 49))]
        requests.append((prompt, output))
    return requests


class Running:
    """The driver's view of one request."""

    def __init__(self, index: int, prompt: list[int], output: list[int], req) -> None:
        self.index = index
        self.prompt_len = len(prompt)
        self.output = output
        self.sampled = 0  # output tokens appended so far
        self.computed = 0
        self.req = req


def chunk(r: Running, num_tokens: int) -> int:
    """Tokens to schedule for ``r`` now: its next prefill chunk or one decode token."""
    start = r.computed
    end = min(num_tokens, start + CHUNK)
    if end < num_tokens:
        end = end // BS * BS
    last_checkpoint = (r.prompt_len - 1) // BS * BS
    if start < last_checkpoint < end:
        end = last_checkpoint
    return end - start


def replay(backend, seed: int, num_requests: int, num_blocks: int) -> list:
    """Serve the trace over ``backend``; the list of decisions."""
    reqs = trace(seed, num_requests)
    log: list = []
    waiting = [Running(i, p, o, backend.build(i, p)) for i, (p, o) in enumerate(reqs)]
    running: list[Running] = []
    finished = 0
    for _step in range(20_000):
        if finished == len(reqs):
            return log
        backend.new_step()
        i = 0
        while i < len(running):
            r = running[i]
            n = chunk(r, backend.num_tokens(r.req))
            while True:
                res = backend.allocate(r.req, n)
                log.append(["alloc", r.index, n, res])
                if res is not None:
                    break
                victim = running[-1] if running[-1] is not r else running[-2]
                if victim is r:
                    raise RuntimeError("one request does not fit in the pool")
                running.remove(victim)
                backend.free(victim.req)
                victim.computed = 0
                waiting.insert(0, victim)
                log.append(["preempt", victim.index])
            r.computed += n
            backend.set_computed(r.req, r.computed)
            if r.computed == backend.num_tokens(r.req):  # a token is sampled
                if r.sampled == len(r.output):
                    backend.free(r.req)
                    running.pop(i)
                    finished += 1
                    log.append(["finish", r.index])
                    continue
                backend.append(r.req, r.output[r.sampled])
                r.sampled += 1
            i += 1
        while waiting and len(running) < MAX_RUNNING:
            r = waiting[0]
            hit = backend.lookup(r.req)
            log.append(["hit", r.index, hit])
            n = chunk(_at(r, hit), backend.num_tokens(r.req))
            res = backend.allocate(r.req, n, first=True)
            log.append(["alloc", r.index, n, res])
            if res is None:
                break
            waiting.pop(0)
            r.computed = hit + n
            backend.set_computed(r.req, r.computed)
            running.append(r)
            if r.computed == backend.num_tokens(r.req):
                backend.append(r.req, r.output[r.sampled])
                r.sampled += 1
        log.append(["free", backend.num_free_blocks()])
    raise RuntimeError("the trace did not finish")


def _at(r: Running, computed: int) -> Running:
    r.computed = computed
    return r


# -- vLLM's manager (run inside a vLLM venv) ---------------------------------------------

class VllmBackend:
    def __init__(self, model: str, caching: bool, num_blocks: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        init_none_hash(sha256)
        groups = []
        for g, (kind, window) in enumerate(MODELS[model]):
            if kind == "full":
                spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64,
                                         dtype=torch.float16)
            elif kind == "sliding":
                spec = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=64,
                                         dtype=torch.float16, sliding_window=window)
            else:
                spec = MambaSpec(block_size=BS if caching else MAX_MODEL_LEN,
                                 shapes=((4, 16),), dtypes=(torch.float32,),
                                 mamba_cache_mode="align" if caching else "none")
            groups.append(KVCacheGroupSpec([f"layer.{g}"], spec))
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=groups)
        # vLLM schedules in the least common multiple of its groups' block sizes
        scheduler_block_size = math.lcm(*(g.kv_cache_spec.block_size for g in groups))
        self.mgr = KVCacheManager(config, max_model_len=MAX_MODEL_LEN,
                                  scheduler_block_size=scheduler_block_size,
                                  hash_block_size=BS, enable_caching=caching)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.params = SamplingParams(max_tokens=64)
        self.Request = Request
        self.hits: dict[str, tuple] = {}

    def build(self, i: int, prompt: list[int]):
        return self.Request(f"r{i}", list(prompt), self.params, None, block_hasher=self.hasher)

    def new_step(self) -> None:
        self.mgr.new_step_starts()

    def num_tokens(self, req) -> int:
        return req.num_tokens

    def lookup(self, req) -> int:
        blocks, hit, *_ = self.mgr.get_computed_blocks(req)
        self.hits[req.request_id] = (blocks, hit)
        return hit

    def allocate(self, req, n: int, first: bool = False):
        if first:
            blocks, hit = self.hits.pop(req.request_id)
            out = self.mgr.allocate_slots(req, n, hit, blocks)
        else:
            out = self.mgr.allocate_slots(req, n)
        return None if out is None else [list(ids) for ids in out.get_block_ids()]

    def set_computed(self, req, n: int) -> None:
        req.num_computed_tokens = n

    def append(self, req, token: int) -> None:
        req.append_output_token_ids(token)

    def free(self, req) -> None:
        self.mgr.free(req)
        req.num_computed_tokens = 0

    def num_free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()


# -- kvmem's manager ---------------------------------------------------------------------

class _KvmemRequest:
    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class KvmemBackend:
    def __init__(self, model: str, caching: bool, num_blocks: int, series: str = "0.33") -> None:
        from kvmem.cache import KVCacheManager
        from kvmem.spec import AttentionKind, KVGroup

        kinds = {"full": AttentionKind.FULL, "sliding": AttentionKind.SLIDING,
                 "state": AttentionKind.LINEAR}
        groups = [KVGroup(g, kinds[kind], window, (g,))
                  for g, (kind, window) in enumerate(MODELS[model])]
        self.mgr = KVCacheManager(groups, num_blocks, BS, enable_prefix_caching=caching,
                                  republish_prompt_checkpoint=series == "0.32")
        self.hits: dict[str, object] = {}

    def build(self, i: int, prompt: list[int]):
        return _KvmemRequest(f"r{i}", prompt)

    def new_step(self) -> None:
        self.mgr.new_step()

    def num_tokens(self, req) -> int:
        return req.num_tokens

    def lookup(self, req) -> int:
        hit = self.mgr.get_computed_blocks(req)
        self.hits[req.request_id] = hit
        return hit.num_tokens

    def allocate(self, req, n: int, first: bool = False):
        hit = self.hits.pop(req.request_id) if first else None
        res = self.mgr.allocate_slots(req, n, prefix_hit=hit)
        return [list(ids) for ids in res.new_block_ids] if res else None

    def set_computed(self, req, n: int) -> None:
        pass  # the manager counts computed tokens itself

    def append(self, req, token: int) -> None:
        req.all_token_ids.append(token)

    def free(self, req) -> None:
        self.mgr.free(req)

    def num_free_blocks(self) -> int:
        return self.mgr.pool.num_free_blocks


def main(argv: list[str]) -> int:
    """``cache_replay.py CASES_JSON``: each case [model, caching, seed, requests, blocks];
    prints ``KVMEM_REPLAY`` and a JSON object: the vLLM version and each case's decisions
    under vLLM's manager."""
    import vllm

    logs = [replay(VllmBackend(model, caching, num_blocks), seed, num_requests, num_blocks)
            for model, caching, seed, num_requests, num_blocks in json.loads(argv[0])]
    print("KVMEM_REPLAY " + json.dumps({"vllm": vllm.__version__, "logs": logs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
