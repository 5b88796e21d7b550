"""Block-manager throughput on a replayed serving trace (run by hand, not a test).

The trace (seeded, deterministic): N requests, prompts of 32-2,048 tokens, outputs of
16-512 tokens; 30% of requests start with one of 64 shared prefixes of 256-1,536 tokens
(a prompt shorter than its prefix is the prefix cut to the prompt length). Block size 16,
16,384 blocks, at most 128 requests in flight. Per request: hash the prompt's blocks,
look up the prefix, allocate the prompt's blocks, grow the output 16 tokens per step
(allocating decode blocks as it grows, caching full blocks), then free. When a decode
step finds no capacity, the newest running request is preempted and later restarts. Every
decode round starts a scheduler step (``new_step``).

Two layouts (``--layout``, both by default): ``full``, one full-attention group; ``gdn``, a
Qwen3-Next-like hybrid of 3 gated-delta-net (linear attention) layers to 1 full attention
layer: one full-attention group and three state groups, prefix caching on (vLLM's Mamba
"align" mode). There a prompt is computed in two chunks, the first ending at the last block
boundary before its last token (where its state checkpoint is cached), as vLLM's scheduler
splits prefills for "align".

Every backend runs in its own process and they take turns every ``--slice`` finished
requests (1,000 by default), so that load from other jobs on a shared machine falls on all
of them alike; only the time of each backend's own turns is counted.

Figures (one line each; drawing the trace's random token ids is never timed). "End to end"
is the time spent inside request construction and manager calls, hashing included; the
replay's own bookkeeping (lists of running and waiting requests, slicing each step's tokens),
the same for every backend, is not counted, and is printed apart as the replay's wall time:
- ``kvmem xxh3``: kvmem's KVCacheManager, end to end: request construction, xxh3 hashing
  and all manager operations;
- ``kvmem manager only``: the same replay, block hashes computed beforehand, time spent
  inside manager calls only;
- ``kvmem sha256+pickle``: end to end, hashing with hashlib.sha256 over pickled
  (parent, tokens) tuples like vLLM does (the in-script baseline);
- ``vllm`` (with ``--vllm-python``): vLLM's KVCacheManager on the same trace, run by the
  given interpreter: end to end (vLLM Request construction with its sha256 block hasher)
  and manager calls only.

Usage:
    .venv/bin/python benchmarks/block_manager.py [--requests N] [--slice N] [--layout L]
        [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import pickle
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator

import numpy as np

BLOCK_SIZE = 16
NUM_BLOCKS = 16_384
MAX_IN_FLIGHT = 128
NUM_PREFIXES = 64
SHARED_FRACTION = 0.3
VOCAB = 32_000
STEP_TOKENS = 16  # output tokens appended per decode step
# the KV groups of each layout: "full" or "state" (linear attention)
LAYOUTS = {"full": ("full",), "gdn": ("full", "state", "state", "state")}


class Trace:
    """Deterministic request shapes; token ids are drawn when a request is built."""

    def __init__(self, num_requests: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.num_requests = num_requests
        self.prompt_len = rng.integers(32, 2049, num_requests)
        self.output_len = rng.integers(16, 513, num_requests)
        shared = rng.random(num_requests) < SHARED_FRACTION
        self.prefix_id = np.where(shared, rng.integers(0, NUM_PREFIXES, num_requests), -1)
        self.prefixes = [rng.integers(0, VOCAB, int(n)).tolist()
                         for n in rng.integers(256, 1537, NUM_PREFIXES)]
        self.seed = seed

    def tokens(self, i: int) -> tuple[list[int], list[int]]:
        """Prompt and output token ids of request ``i``."""
        rng = np.random.default_rng((self.seed, i))
        n, p = int(self.prompt_len[i]), int(self.prefix_id[i])
        if p < 0:
            prompt = rng.integers(0, VOCAB, n).tolist()
        else:
            prefix = self.prefixes[p]
            prompt = prefix[:n] + rng.integers(0, VOCAB, max(0, n - len(prefix))).tolist()
        return prompt, rng.integers(0, VOCAB, int(self.output_len[i])).tolist()


# -- backends: the same five operations over each manager --------------------------------------

def checkpoint_chunk(num_tokens: int, hit: int, layout: str) -> int:
    """Tokens of a prompt's first chunk after a hit of ``hit`` tokens: up to the last block
    boundary before its last token when the layout has state groups, else all of it."""
    last_checkpoint = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    if "state" in LAYOUTS[layout] and hit < last_checkpoint:
        return last_checkpoint - hit
    return num_tokens - hit


class KvmemBackend:
    def __init__(self, hashing: str, layout: str) -> None:
        from kvmem.cache import KVCacheManager
        from kvmem.spec import AttentionKind, KVGroup

        kinds = {"full": AttentionKind.FULL, "state": AttentionKind.LINEAR}
        groups = [KVGroup(g, kinds[kind], None, (g,)) for g, kind in enumerate(LAYOUTS[layout])]
        self.mgr = KVCacheManager(groups, NUM_BLOCKS, BLOCK_SIZE, enable_events=False)
        self.layout = layout
        self.hashing = hashing  # "xxh3" (inside the manager), "precomputed", "sha256"

    def build(self, i: int, prompt: list[int], output: list[int]):
        req = _KvmemRequest(f"r{i}", prompt)
        if self.hashing == "precomputed":
            from kvmem.cache import hash_request_tokens
            req.block_hashes = hash_request_tokens(prompt + output, BLOCK_SIZE)
        elif self.hashing == "sha256":
            req.block_hashes = sha256_pickle_hashes(prompt + output)
        return req

    def new_step(self) -> None:
        self.mgr.new_step()

    def start(self, req) -> int | None:
        """Look up and allocate the whole prompt; the hit in tokens, or None (no capacity)."""
        hit = self.mgr.get_computed_blocks(req)
        first = checkpoint_chunk(req.num_tokens, hit.num_tokens, self.layout)
        if not self.mgr.allocate_slots(req, first, prefix_hit=hit):
            return None
        rest = req.num_tokens - hit.num_tokens - first
        if rest and not self.mgr.allocate_slots(req, rest):
            self.mgr.free(req)
            return None
        return hit.num_tokens

    def append(self, req, tokens: list[int]) -> bool:
        req.all_token_ids.extend(tokens)
        req.num_tokens += len(tokens)
        if self.mgr.allocate_slots(req, len(tokens)):
            return True
        del req.all_token_ids[-len(tokens):]
        req.num_tokens -= len(tokens)
        return False

    def free(self, req) -> None:
        self.mgr.free(req)


class _KvmemRequest:
    __slots__ = ("request_id", "all_token_ids", "num_tokens", "block_hashes")

    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = prompt
        self.num_tokens = len(prompt)
        self.block_hashes = None


def sha256_pickle_hashes(tokens: list[int]) -> list[bytes]:
    """Chained sha256 over pickled (parent, block tokens, extra keys) tuples."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = tuple(tokens[start:start + BLOCK_SIZE])
        parent = hashlib.sha256(pickle.dumps((parent, block, None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        hashes.append(parent)
    return hashes


class VllmBackend:
    """vLLM's KVCacheManager over the layout's groups (vLLM installed separately)."""

    def __init__(self, layout: str) -> None:
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
        )
        from vllm.v1.request import Request

        init_none_hash(sha256)
        specs = {"full": FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64,
                                           dtype=torch.float16),
                 "state": MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 16),),
                                    dtypes=(torch.float32,), mamba_cache_mode="align")}
        groups = [KVCacheGroupSpec([f"layer.{g}"], specs[kind])
                  for g, kind in enumerate(LAYOUTS[layout])]
        config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                               kv_cache_groups=groups)
        self.mgr = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK_SIZE,
                                  hash_block_size=BLOCK_SIZE, enable_caching=True)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.params = SamplingParams(max_tokens=512)
        self.Request = Request
        self.layout = layout

    def build(self, i: int, prompt: list[int], output: list[int]):
        return self.Request(f"r{i}", prompt, self.params, None, block_hasher=self.hasher)

    def new_step(self) -> None:
        self.mgr.new_step_starts()

    def start(self, req) -> int | None:
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        first = checkpoint_chunk(req.num_tokens, hit, self.layout)
        if self.mgr.allocate_slots(req, first, hit, blocks) is None:
            return None
        req.num_computed_tokens = hit + first
        rest = req.num_tokens - req.num_computed_tokens
        if rest and self.mgr.allocate_slots(req, rest) is None:
            self.free(req)
            return None
        req.num_computed_tokens = req.num_tokens
        return hit

    def append(self, req, tokens: list[int]) -> bool:
        req.append_output_token_ids(tokens)  # hashes new full blocks (outside the manager)
        if self.mgr.allocate_slots(req, len(tokens)) is None:
            del req._output_token_ids[-len(tokens):]
            del req._all_token_ids[-len(tokens):]
            return False
        req.num_computed_tokens = req.num_tokens
        return True

    def free(self, req) -> None:
        self.mgr.free(req)
        req.num_computed_tokens = 0


class Timed:
    """Wraps a backend; sums the time spent inside manager calls (``seconds``) and inside
    request construction (``build_seconds``)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.seconds = 0.0
        self.build_seconds = 0.0

    def build(self, i, prompt, output):
        t = time.perf_counter()
        try:
            return self.backend.build(i, prompt, output)
        finally:
            self.build_seconds += time.perf_counter() - t

    def new_step(self):
        t = time.perf_counter()
        try:
            self.backend.new_step()
        finally:
            self.seconds += time.perf_counter() - t

    def start(self, req):
        t = time.perf_counter()
        try:
            return self.backend.start(req)
        finally:
            self.seconds += time.perf_counter() - t

    def append(self, req, tokens):
        t = time.perf_counter()
        try:
            return self.backend.append(req, tokens)
        finally:
            self.seconds += time.perf_counter() - t

    def free(self, req):
        t = time.perf_counter()
        try:
            self.backend.free(req)
        finally:
            self.seconds += time.perf_counter() - t


# -- the replay ----------------------------------------------------------------------------

def replay(backend, trace: Trace, pause_every: int = 0) -> Iterator[dict | None]:
    """Serve the trace with at most MAX_IN_FLIGHT requests running.

    Yields None after every ``pause_every`` finished requests (time spent paused is not
    counted), then the result.
    """
    n = trace.num_requests
    # [request, output tokens, output tokens appended, prompt length, not admitted yet]
    running: list[list] = []
    waiting: deque = deque()
    next_i = finished = 0
    prompt_tokens = hit_tokens = preemptions = blocks = 0
    seconds = 0.0
    t0 = time.perf_counter()
    while finished < n:
        while len(running) < MAX_IN_FLIGHT and (waiting or next_i < n):
            if waiting:
                item = waiting.popleft()
            else:
                t = time.perf_counter()
                prompt, output = trace.tokens(next_i)  # drawing the trace is not timed
                seconds -= time.perf_counter() - t
                item = [backend.build(next_i, prompt, output), output, 0, len(prompt), True]
                next_i += 1
            req = item[0]
            hit = backend.start(req)
            if hit is None:
                waiting.appendleft(item)
                break
            if item[4]:  # first admission: count the prompt and its hit
                prompt_tokens += item[3]
                hit_tokens += hit
                item[4] = False
            blocks += -(-req.num_tokens // BLOCK_SIZE) - hit // BLOCK_SIZE
            running.append(item)
        backend.new_step()
        i = 0
        while i < len(running):  # one decode step for every running request
            item = running[i]
            req, output, done = item[0], item[1], item[2]
            before = -(-req.num_tokens // BLOCK_SIZE)
            step = output[done:done + STEP_TOKENS]
            while not backend.append(req, step):  # preempt the newest other request
                if len(running) == 1:
                    raise RuntimeError("a single request does not fit in the pool")
                j = len(running) - 1 if running[-1] is not item else len(running) - 2
                victim = running.pop(j)
                if j < i:
                    i -= 1
                backend.free(victim[0])
                waiting.appendleft(victim)
                preemptions += 1
            blocks += -(-req.num_tokens // BLOCK_SIZE) - before
            item[2] = done + len(step)
            if item[2] >= len(output):
                backend.free(req)
                running.pop(i)
                finished += 1
                if pause_every and finished % pause_every == 0 and finished < n:
                    seconds += time.perf_counter() - t0
                    yield None
                    t0 = time.perf_counter()
            else:
                i += 1
    seconds += time.perf_counter() - t0
    yield {"seconds": seconds, "requests": n,
           "blocks": blocks, "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
           "preemptions": preemptions}


def replay_backend(name: str, trace: Trace, layout: str,
                   pause_every: int = 0) -> Iterator[dict | None]:
    """``replay`` over the named backend; the result adds ``manager_seconds`` (inside
    manager calls) and ``call_seconds`` (those and request construction: end to end)."""
    if name == "vllm":
        backend = Timed(VllmBackend(layout))
    elif name == "kvmem-precomputed":
        backend = Timed(KvmemBackend("precomputed", layout))
    else:
        backend = Timed(KvmemBackend("sha256" if name == "kvmem-sha256" else "xxh3", layout))
    for result in replay(backend, trace, pause_every):
        if result is not None:
            result["manager_seconds"] = backend.seconds
            result["call_seconds"] = backend.seconds + backend.build_seconds
        yield result


def serve_backend(name: str, trace: Trace, layout: str, pause_every: int) -> None:
    """Child process: replay one slice per line read from stdin; answer each with a line
    (``paused``, or the result as JSON at the end)."""
    steps = replay_backend(name, trace, layout, pause_every)
    print("ready", flush=True)
    for _ in sys.stdin:
        result = next(steps)
        print("paused" if result is None else json.dumps(result), flush=True)
        if result is not None:
            return


def run_interleaved(backends: dict[str, str], args: argparse.Namespace,
                    layout: str) -> dict[str, dict]:
    """Run every backend in its own process, taking turns every ``args.slice`` finished
    requests, so that load from other jobs on the machine falls on all of them alike."""
    with contextlib.ExitStack() as stack:
        children, logs = {}, {}
        for name, python in backends.items():
            logs[name] = stack.enter_context(tempfile.TemporaryFile("w+"))
            children[name] = stack.enter_context(subprocess.Popen(
                [python, __file__, "--backend", name, "--requests", str(args.requests),
                 "--seed", str(args.seed), "--slice", str(args.slice), "--layout", layout],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[name], text=True,
                bufsize=1))

        def expect(name: str) -> str:
            line = children[name].stdout.readline().strip()
            if not line:
                logs[name].seek(0)
                raise RuntimeError(f"{name} backend exited early:\n{logs[name].read()[-2000:]}")
            return line

        for name in children:
            expect(name)  # "ready": imports and setup done
        results: dict[str, dict] = {}
        while len(results) < len(children):
            for name, child in children.items():
                if name not in results:
                    child.stdin.write("go\n")
                    line = expect(name)
                    if line != "paused":
                        results[name] = json.loads(line)
        return results


def report(label: str, r: dict, seconds: float) -> str:
    return (f"{label:<28} {r['requests'] / seconds:>9,.0f} req/s  "
            f"{r['blocks'] / seconds:>11,.0f} blocks/s  "
            f"hit rate {r['hit_tokens'] / r['prompt_tokens']:6.2%}  "
            f"preemptions {r['preemptions']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", help="interpreter with vLLM installed, for the comparison")
    ap.add_argument("--slice", type=int, default=1000,
                    help="finished requests per turn when the backends take turns")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), action="append",
                    help="KV layout to replay (repeatable; default: every layout)")
    ap.add_argument("--backend", help=argparse.SUPPRESS)  # child process: one backend
    args = ap.parse_args(argv)
    if args.requests <= 0 or args.slice <= 0:
        ap.error("--requests and --slice must be positive")
    trace = Trace(args.requests, args.seed)
    if args.backend:
        serve_backend(args.backend, trace, args.layout[0], args.slice)
        return 0
    for layout in args.layout or list(LAYOUTS):
        run_layout(layout, args)
    return 0


def run_layout(layout: str, args: argparse.Namespace) -> None:
    """Replay the trace over every backend for one layout and print the figures."""
    print(f"layout {layout} ({' + '.join(LAYOUTS[layout])} groups); trace: {args.requests:,} "
          f"requests, block size {BLOCK_SIZE}, {NUM_BLOCKS:,} blocks, {MAX_IN_FLIGHT} in "
          f"flight, seed {args.seed}; backends take turns every {args.slice:,} finished "
          f"requests")
    backends = dict.fromkeys(("kvmem-xxh3", "kvmem-precomputed", "kvmem-sha256"),
                             sys.executable)
    if args.vllm_python:
        backends["vllm"] = args.vllm_python
    results = run_interleaved(backends, args, layout)

    k, kp, ks = results["kvmem-xxh3"], results["kvmem-precomputed"], results["kvmem-sha256"]
    print(report("kvmem xxh3 (end to end)", k, k["call_seconds"]))
    print(report("kvmem manager only", kp, kp["manager_seconds"]))
    print(report("kvmem sha256+pickle (e2e)", ks, ks["call_seconds"]))
    if "vllm" in results:
        v = results["vllm"]
        print(report("vllm (end to end)", v, v["call_seconds"]))
        print(report("vllm manager only", v, v["manager_seconds"]))
        print(f"ratio end to end: {v['call_seconds'] / k['call_seconds']:.2f}x; "
              f"manager only: {v['manager_seconds'] / kp['manager_seconds']:.2f}x; "
              f"replay wall time (end to end and the replay's bookkeeping): "
              f"{v['seconds'] / k['seconds']:.2f}x")
    print(f"ratio xxh3 vs sha256+pickle end to end: "
          f"{ks['call_seconds'] / k['call_seconds']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
