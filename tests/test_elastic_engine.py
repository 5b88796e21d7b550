"""The engine on elastic KV memory (``--kv-memory elastic``), on CPU with tiny models.

Token-exact output against plain tensors (one process, tp 2, pp 2); resident memory that
follows live KV in a real engine; a limit too small for one request; a request refused
by a shared budget that waits instead of failing; two engine processes sharing one
budget (two Llamas, and a Llama beside a Gated DeltaNet hybrid); a tp-2 ``kvmem serve``
that starts and serves; and a rank that never joins the page map, which fails rank 0's
startup within the timeout with a clear error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil
import pytest
from serve_process import ServeProcess, free_port
from tiny_models import make_tiny_checkpoint, make_tiny_qwen3_next

from kvmem.engine.config import EngineConfig
from kvmem.engine.llm import LLM
from kvmem.engine.llm_engine import LLMEngine
from kvmem.engine.sampling_params import SamplingParams
from kvmem.errors import ConfigError
from kvmem.memory import Ledger

TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
# 8 layers x 8 KV heads x head_dim 64 in fp32: 32 KiB of KV per token, 512 KiB per block
WIDE = dict(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
BLOCK_BYTES = 16 * 8 * 2 * 8 * 64 * 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 90)), [200, 3, 77, 14, 15, 16, 17, 18, 19, 20, 21]]
OPTIONS = dict(kv_cache_memory_bytes="4MiB", max_model_len=128, max_num_batched_tokens=32)


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_LEDGER_DIR", str(tmp_path / "ledger"))
    return tmp_path / "ledger"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("elastic"), "llama", **TINY)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("elastic_wide"), "llama", **WIDE)


@pytest.fixture(scope="module")
def reference(tiny):
    return _generate(LLM(str(tiny), **OPTIONS))


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, [GREEDY, SEEDED, GREEDY])
    return [o.outputs[0].token_ids for o in outs]


def test_tokens_match_plain_and_shutdown_leaves_the_ledger(tiny, reference):
    llm = LLM(str(tiny), kv_memory="elastic", engine_name="tiny-a", **OPTIONS)
    engine = llm.engine
    storage = engine.kv_storage
    try:
        assert _generate(llm) == reference
        sizing = engine.elastic.sizing
        assert sizing.limit_bytes == 4 << 20  # the planned budget is the limit
        assert engine.num_blocks == sizing.max_blocks > engine.kv_plan.engine.num_blocks
        stats = storage.stats()
        assert 0 < stats.mapped_bytes < stats.reserved_bytes
        [entry] = Ledger.for_device("cpu").entries()
        assert (entry.name, entry.pid, entry.ceiling_bytes) == ("tiny-a", os.getpid(), 4 << 20)
        # Cached prefixes keep their pages; dropping them gives the pages back.
        assert stats.live_blocks > 1
        assert engine.kv_cache_manager.reset_prefix_cache()
        storage.settle()
        after = storage.stats()
        assert after.live_blocks == 1  # the null block
        assert after.mapped_pages <= 1 + storage.table.reserve_pages
    finally:
        engine.shutdown()
    assert Ledger.for_device("cpu").entries() == []
    with pytest.raises(Exception, match="shut down"):
        engine.step()


def test_engine_reservation_is_the_planners(tiny):
    """The engine sizes its elastic reservation with the function `kvmem plan --kv-memory
    elastic` calls, over the same plan: the planner's blocks are the engine's."""
    import mmap

    import torch

    from kvmem.engine.kv_cache_setup import plan_kv_cache
    from kvmem.memory.sizing import plan_elastic
    from kvmem.spec import load_spec

    options = dict(kv_memory="elastic", engine_name="tiny-plan", kv_memory_limit_bytes="3MiB",
                   **OPTIONS)
    config = EngineConfig(model=str(tiny), **options)
    llm = LLM(str(tiny), **options)
    try:
        spec = load_spec(str(tiny))
        planned = plan_kv_cache(spec, config, device=torch.device("cpu"), kv_dtype="float32",
                                max_model_len=llm.engine.max_model_len)
        [sizing] = plan_elastic(planned, spec, 3 << 20, granularity=mmap.PAGESIZE)
        assert llm.engine.elastic.sizing == sizing
        assert llm.engine.num_blocks == sizing.max_blocks
        assert sizing.limit_bytes == 3 << 20
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_tokens_match_plain(tiny, reference, tp, pp):
    """Every rank maps rank 0's pages (pp ranks hold different slots over the same blocks)."""
    llm = LLM(str(tiny), kv_memory="elastic", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, **OPTIONS)
    try:
        assert _generate(llm) == reference
        engine = llm.engine
        allocations = engine.parallel.state.allocations
        assert {a.num_blocks for a in allocations} == {engine.num_blocks}
        assert engine.num_blocks == engine.elastic.sizing.max_blocks
        assert 0 < allocations[0].allocated_bytes < engine.elastic.sizing.reserved_bytes
        table = engine.elastic.storage.table
        with table.cond:  # the memory thread's maps and the ledger's counts wait meanwhile
            [entry] = Ledger.for_device("cpu").entries()
            held = table.held_bytes
        assert entry.name == engine.elastic.name  # rank 0 speaks for the engine
        # ... for every rank's KV, all in this host's memory: each page it maps costs the
        # ledger a page of each rank, and the default ceiling is their budgets together
        k = engine.elastic.sizing.blocks_per_page
        ranks = [r for r in engine.kv_plan.ranks if r.num_slots]
        assert len(ranks) == 2
        assert table.page_bytes == sum(k * r.slot_page_bytes * r.num_slots for r in ranks)
        assert entry.mapped_bytes == held and held % table.page_bytes == 0
        assert entry.ceiling_bytes == sum(r.kv_budget_bytes for r in ranks) == 2 * (4 << 20)
    finally:
        llm.engine.shutdown()


def test_limit_too_small_for_one_request_is_a_clear_error(tiny):
    with pytest.raises(ConfigError, match=r"KV memory limit .* max_model_len 128 needs 9 "):
        LLM(str(tiny), kv_memory="elastic", kv_memory_limit_bytes="64KiB", **OPTIONS)
    with pytest.raises(ConfigError, match="kv_memory_limit_bytes needs kv_memory elastic"):
        EngineConfig(kv_memory_limit_bytes="1GiB")
    with pytest.raises(ConfigError, match="unknown kv_memory 'paged'"):
        EngineConfig(kv_memory="paged")
    assert Ledger.for_device("cpu").entries() == []


def rss() -> int:
    """Resident bytes, after handing the heap's free memory back (allocator noise)."""
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def _step_until(engine: LLMEngine, done) -> None:
    deadline = time.monotonic() + 120
    while not done():
        assert time.monotonic() < deadline
        for out in engine.step():
            assert out.error is None


def test_resident_memory_follows_live_kv_in_the_engine(wide):
    """RSS grows by the live KV while requests run and returns to the baseline plus the
    reserve once they end (prefix caching off, so finished blocks hold nothing)."""
    config = EngineConfig(model=str(wide), kv_memory="elastic",
                          kv_cache_memory_bytes=128 * BLOCK_BYTES, max_model_len=256,
                          max_num_seqs=8, max_num_batched_tokens=2048,
                          enable_prefix_caching=False)
    engine = LLMEngine(config)
    storage = engine.kv_storage
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request("warm", list(range(1, 200)), params)  # activations' heap, once
        _step_until(engine, lambda: not engine.has_unfinished_requests())
        storage.settle()
        base = rss()
        requests = [engine.add_request(f"r{i}", [(i * 7 + j) % 300 + 1 for j in range(200)],
                                       params) for i in range(6)]
        _step_until(engine, lambda: all(r.num_output_tokens >= 5 for r in requests))
        storage.settle()
        live = storage.stats().used_bytes
        assert live >= 6 * 13 * BLOCK_BYTES  # 205 tokens: 13 blocks each
        assert rss() - base > 0.8 * live
        _step_until(engine, lambda: not engine.has_unfinished_requests())
        storage.settle()
        reserve = storage.table.reserve_pages * storage.geometry.page_bytes
        assert storage.stats().mapped_bytes <= reserve + storage.geometry.page_bytes  # + null
        assert rss() - base < reserve + 0.15 * live
    finally:
        engine.shutdown()


def test_a_request_refused_by_the_shared_budget_waits_then_runs(tiny, reference):
    """Another engine holds all of the device total but the null block's page: the
    request waits (no error) and runs once that memory is given back."""
    ledger = Ledger.for_device("cpu")
    ledger.set_total_limit(2 << 20)
    other = ledger.register("other", ceiling_bytes=None)
    page = 4 * 16 * 2 * 2 * 16 * 4  # one block in 4 layers, K and V, 2 heads x 16, fp32
    assert other.try_acquire((2 << 20) - page)
    llm = LLM(str(tiny), kv_memory="elastic", **OPTIONS)
    engine = llm.engine
    try:
        assert engine.kv_storage.stats().mapped_pages == 1
        engine.add_request("r", PROMPTS[2], GREEDY)
        for _ in range(30):
            assert engine.step() == []
        assert engine.scheduler.num_waiting == 1
        other.release(2 << 20)
        outs = []
        deadline = time.monotonic() + 60
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            outs.extend(o for o in engine.step() if o.finished)
        assert [(o.outputs[0].token_ids, o.error) for o in outs] == [(reference[2], None)]
    finally:
        engine.shutdown()
        other.close()


# -- two engine processes, one budget -------------------------------------------------------
ENGINE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.engine.sampling_params import SamplingParams

    model, name, control, limit = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    engine = LLMEngine(EngineConfig(
        model=model, kv_memory="elastic", kv_cache_memory_bytes=limit, engine_name=name,
        max_model_len=256, max_num_seqs=8, max_num_batched_tokens=2048,
        enable_prefix_caching=False))
    storage = engine.kv_storage
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def wait_file(path):
        deadline = time.monotonic() + 300
        while not path.exists():
            assert time.monotonic() < deadline, f"no {path}"
            time.sleep(0.02)

    (control / f"ready-{name}").touch()
    for phase in ("alone", "both"):
        wait_file(control / f"go-{phase}-{name}")
        for i in range(6):
            engine.add_request(f"{phase}{i}", [(i * 11 + j) % 300 + 1 for j in range(200)], params)
        outputs, max_held, blocked = {}, 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id[len(phase):]] = (out.outputs[0].token_ids,
                                                            out.outputs[0].finish_reason)
            max_held = max(max_held, storage.stats().held_bytes)
            blocked += engine.scheduler.num_waiting > 0
        deadline = time.monotonic() + 60  # idle: free pages go back to the ledger
        reserve = (storage.table.reserve_pages + 1) * storage.geometry.page_bytes
        while storage.stats().held_bytes > reserve:
            assert time.monotonic() < deadline, storage.stats()
            time.sleep(0.05)
        result = dict(outputs=outputs, max_held=max_held, blocked=blocked,
                      preemptions=engine.num_preemptions)
        partial = control / f"{phase}-{name}.partial"  # renamed whole: never read half-written
        partial.write_text(json.dumps(result))
        partial.rename(control / f"{phase}-{name}.json")
    engine.shutdown()
""")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3-Next (Gated DeltaNet 3 : 1 full attention) whose six requests hold about as
    much KV as ``wide``'s (its states included)."""
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("elastic_hybrid"), 8,
                                hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=8, head_dim=64,
                                linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.mark.parametrize("pair", ["llama+llama", "llama+hybrid"])
def test_two_engine_processes_share_one_budget(pair, wide, hybrid, tmp_path, ledger_dir):
    """Each engine serves its six requests alone, under its own ceiling; then both at
    once under a device total of 3/4 of what they held alone together. The total holds
    at every moment, they contend, and each gives the tokens it gave alone; a hybrid's
    state pages count in the total as its attention pages do."""
    models = {"a": wide, "b": hybrid if pair.endswith("hybrid") else wide}
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    control = tmp_path / "control"
    control.mkdir()
    env = {**os.environ, "KVMEM_LEDGER_DIR": str(ledger_dir), "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, str(script), str(models[name]), name,
                                     str(control), str(128 * BLOCK_BYTES)], env=env)
             for name in "ab"}
    over: list[int] = []
    stop = threading.Event()
    total = 0  # none while each serves alone

    def watch() -> None:  # the device total holds at every moment
        ledger = Ledger.for_device("cpu")
        while not stop.is_set():
            held = sum(e.mapped_bytes for e in ledger.entries())
            if total and held > total:
                over.append(held)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)

    def phase(name: str, engines: str) -> dict:
        for e in engines:
            (control / f"go-{name}-{e}").touch()
        deadline = time.monotonic() + 300
        while not all((control / f"{name}-{e}.json").exists() for e in engines):
            assert time.monotonic() < deadline
            # after the last phase an engine that has written its results exits 0 while the
            # other still runs; an engine that fails, or exits without its results, does not
            exited = {e: p.returncode for e, p in procs.items() if p.poll() is not None}
            assert all(code == 0 and (control / f"{name}-{e}.json").exists()
                       for e, code in exited.items()), f"an engine exited: {exited}"
            time.sleep(0.05)
        return {e: json.loads((control / f"{name}-{e}.json").read_text()) for e in engines}

    try:
        alone = phase("alone", "a") | phase("alone", "b")  # a grows, idles, frees; then b
        total = 3 * (alone["a"]["max_held"] + alone["b"]["max_held"]) // 4
        Ledger.for_device("cpu").set_total_limit(total)
        watcher.start()
        both = phase("both", "ab")
        for e in "ab":
            assert procs[e].wait(60) == 0
    finally:
        stop.set()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert over == []
    assert sum(r["blocked"] + r["preemptions"] for r in both.values()) > 0  # they contended
    for e in "ab":
        assert both[e]["outputs"] == alone[e]["outputs"]
        assert {reason for _, reason in both[e]["outputs"].values()} == {"length"}
    if models["a"] == models["b"]:
        assert alone["a"]["outputs"] == alone["b"]["outputs"]  # same prompts, same model
    else:  # the hybrid's part of the total is no rounding error
        assert alone["b"]["max_held"] > alone["a"]["max_held"] // 3, (
            {e: r["max_held"] for e, r in alone.items()})


# -- tensor-parallel serving ----------------------------------------------------------------
def serve_elastic_tp2(model_dir, ledger_dir) -> ServeProcess:
    """``kvmem serve -tp 2 --kv-memory elastic`` in a subprocess."""
    return ServeProcess(model_dir, "--max-model-len", "256", "--kv-cache-memory-bytes", "4MiB",
                        "-tp", "2", "--kv-memory", "elastic", "--engine-name", "served",
                        env={"KVMEM_LEDGER_DIR": str(ledger_dir)})


def test_tp2_serve_reaches_health_and_serves(tiny, ledger_dir):
    """Two requests in turn, so rank 0 maps and trims pages that rank 1 replays."""
    server = serve_elastic_tp2(tiny, ledger_dir)
    try:
        llm = LLM(str(tiny), kv_cache_memory_bytes="4MiB", max_model_len=256)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for prompt in ("hello there", "a second, longer prompt that maps more KV pages"):
            body = {"model": str(tiny), "prompt": prompt, "max_tokens": 40, "temperature": 0.0,
                    "ignore_eos": True}
            reply = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            want = llm.generate([prompt], params)[0].outputs[0].text
            assert reply.json()["choices"][0]["text"] == want
        [entry] = Ledger.for_device("cpu", ledger_dir).entries()
        assert entry.name == "served" and entry.mapped_bytes > 0
        # /metrics: the figures kvmem top shows for it
        metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                   for line in httpx.get(f"{server.base}/metrics").text.splitlines()
                   if line.startswith("kvmem_kv_memory_")}
        # both ranks' KV is in this host's memory: the ceiling is their 4 MiB each
        assert metrics["kvmem_kv_memory_ceiling_bytes"] == 2 * (4 << 20)
        assert metrics["kvmem_kv_memory_floor_bytes"] == 0
        assert 0 < metrics["kvmem_kv_memory_mapped_bytes"] <= 2 * (4 << 20)
        assert metrics["kvmem_kv_memory_live_bytes"] >= 0
        assert metrics["kvmem_kv_memory_cached_bytes"] > 0  # the two prompts, cached
        assert metrics["kvmem_kv_memory_reclaims_total"] == 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, "".join(server.lines)
        assert Ledger.for_device("cpu", ledger_dir).entries() == []
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


# A rank 1 that starts, loads its shard and allocates its KV cache, then never joins the
# page map (as a rank stuck before serving would).
STUCK_RANK = textwrap.dedent("""
    import sys, threading
    from kvmem.cli import main
    from kvmem.engine.elastic_setup import ElasticSetup

    ElasticSetup.start = lambda self, *args, **kwargs: threading.Event().wait()
    sys.exit(main(sys.argv[1:]))
""")


def test_rank_that_never_joins_the_page_map_fails_startup_clearly(tiny, tmp_path):
    script = tmp_path / "stuck_rank.py"
    script.write_text(STUCK_RANK)
    args = ["serve", str(tiny), "--max-model-len", "128", "--kv-cache-memory-bytes", "4MiB",
            "-tp", "2", "--kv-memory", "elastic", "--distributed-timeout", "3",
            "--port", str(free_port())]
    master = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": master}
    rank0 = subprocess.Popen([sys.executable, "-m", "kvmem", *args],
                             env={**env, "RANK": "0", "LOCAL_RANK": "0"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank1 = subprocess.Popen([sys.executable, str(script), *args],
                             env={**env, "RANK": "1", "LOCAL_RANK": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, _ = rank0.communicate(timeout=120)
        assert rank0.returncode == 2, out
        assert "kvmem: error: timed out after 3 s waiting for rank 1 of 2 to map the startup " \
               "KV pages (is rank 1 running?)" in out
        assert "Traceback" not in out
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait(10)


# -- kvmem plan --------------------------------------------------------------------------------
PLAN = ["plan", "qwen3-14b", "--tp", "2", "--gpu", "H100", "--max-model-len", "32768",
        "--kv-memory", "elastic", "--json"]


def _plan_json(*extra: str) -> dict:
    """``kvmem plan`` in a fresh interpreter, which must not import torch."""
    code = ("import json, sys; from kvmem.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, *PLAN, *extra], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_plan_shows_the_reservation_and_the_limit():
    result = _plan_json("--kv-memory-limit", "10GiB")
    ranks, sizings = result["ranks"], result["kv_memory"]["ranks"]
    assert len(sizings) == 2
    for rank, s in zip(ranks, sizings, strict=True):
        k = s["blocks_per_page"]
        assert s["page_bytes"] == k * rank["slot_page_bytes"] * rank["num_slots"]
        assert k * rank["slot_page_bytes"] % (2 << 20) == 0  # whole CUDA granules per slot
        assert s["reserved_bytes"] == s["max_blocks"] // k * s["page_bytes"]
    lead = sizings[0]
    assert lead["limit_bytes"] == 10 << 30
    assert lead["limit_blocks"] == (10 << 30) // lead["page_bytes"] * lead["blocks_per_page"]
    # The reservation is what the GPU could hold, well above the 10 GiB limit.
    capacity_blocks = ranks[0]["kv_capacity_bytes"] // ranks[0]["bytes_per_block"]
    assert lead["limit_blocks"] < lead["max_blocks"]
    assert capacity_blocks <= lead["max_blocks"] < capacity_blocks + lead["blocks_per_page"]
    default = _plan_json()["kv_memory"]["ranks"][0]  # the limit defaults to the KV budget
    assert default["limit_bytes"] == ranks[0]["kv_budget_bytes"]


def test_plan_limit_needs_elastic():
    from kvmem.cli import main

    assert main(["plan", "qwen3-14b", "--gpu", "H100", "--kv-memory-limit", "1GiB"]) == 2


@pytest.mark.parametrize("lose", ["delete", "reset"])
def test_engine_goes_on_when_its_ledger_entry_is_lost(tiny, reference, ledger_dir, lose):
    """The ledger file deleted or reset mid-generation: the engine registers again and its
    tokens are unchanged (no UnknownEngineError out of a step)."""
    llm = LLM(str(tiny), kv_memory="elastic", engine_name="tiny-lost", **OPTIONS)
    engine = llm.engine
    try:
        params = [GREEDY, SEEDED, GREEDY]
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            engine.add_request(str(i), prompt, p)
        engine.step()
        (path,) = ledger_dir.glob("kvmem-ledger-*.json")
        path.unlink() if lose == "delete" else path.write_text("{}")
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()
                         if o.finished})
        assert [outs[str(i)] for i in range(3)] == reference
        assert [e.name for e in Ledger.for_device("cpu").entries()] == ["tiny-lost"]
    finally:
        engine.shutdown()


def test_a_lowered_ceiling_shrinks_the_engine_and_no_request_fails(tiny):
    """A ceiling below one request of max_model_len is refused in one line. Lowered to one
    request while four long ones run: cached blocks go first, then running requests are
    preempted (recomputed later) until the engine is under it, within a step and a
    heartbeat; every request finishes with its tokens."""
    prompts = [[(i * 37 + j) % 250 + 1 for j in range(100)] for i in range(4)]
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny), **OPTIONS).generate(
        prompts, GREEDY)]
    llm = LLM(str(tiny), kv_memory="elastic", engine_name="tiny-low", **OPTIONS)
    engine = llm.engine
    ledger = Ledger.for_device("cpu")
    one_request = engine.elastic.request_bytes
    try:
        with pytest.raises(ConfigError, match="below one request of its max_model_len"):
            ledger.set_limits("tiny-low", ceiling_bytes=one_request - 1)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, GREEDY)
        outs = {}
        for _ in range(14):  # all four prefilled (32 tokens a step) and decoding
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert not outs and engine.scheduler.num_running == 4
        ledger.set_limits("tiny-low", ceiling_bytes=one_request)
        engine.kv_storage._heartbeat()  # as the pre-mapping thread does within 50 ms
        preempted = engine.num_preemptions
        for _ in range(2):  # one step preempts, the next runs under the ceiling
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv_storage._heartbeat()
        engine.kv_storage.settle()
        assert engine.num_preemptions > preempted
        assert engine.kv_storage.stats().held_bytes <= one_request
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
            assert engine.kv_storage.stats().held_bytes <= one_request + \
                engine.kv_storage.geometry.page_bytes  # one page in flight at most
        assert all(o.error is None for o in outs.values())
        assert [outs[str(i)].outputs[0].token_ids for i in range(4)] == reference
    finally:
        engine.shutdown()


# -- memory that moves between engines ------------------------------------------------------
def test_an_idle_engine_gives_its_cache_to_a_busy_one_and_reloads_it_from_its_tier(tiny):
    """Engine a serves distinct long prompts and goes idle holding them as prefix cache;
    engine b then needs most of the device total. a takes no step, yet gives back the
    pages that hold only cached blocks (its pre-mapping thread sees b's ask in the ledger,
    evicts them under a's step lock, copying each to a's CPU tier first); b serves its
    burst with the tokens it gives alone; a's next request for one of its prefixes
    loads it from the tier, with the same tokens."""
    prompts_a = [[(i * 53 + j) % 250 + 1 for j in range(100)] for i in range(4)]
    prompts_b = [[(i * 29 + j) % 250 + 3 for j in range(100)] for i in range(4)]
    alone = LLM(str(tiny), **OPTIONS)
    ref_a = [o.outputs[0].token_ids for o in alone.generate(prompts_a, GREEDY)]
    ref_b = [o.outputs[0].token_ids for o in alone.generate(prompts_b, GREEDY)]
    a = LLM(str(tiny), kv_memory="elastic", engine_name="a", cpu_offload_gib=0.01, **OPTIONS)
    b = LLM(str(tiny), kv_memory="elastic", engine_name="b", **OPTIONS)
    ledger = Ledger.for_device("cpu")
    try:
        assert [o.outputs[0].token_ids for o in a.generate(prompts_a, GREEDY)] == ref_a
        a.engine.kv_storage.settle()
        before = a.engine.kv_storage.stats()
        assert before.cached_blocks >= 4 * 6  # a holds its prompts as prefix cache
        # the device total: b's four requests together (8 blocks each, and the null
        # block) fit only if a gives back most of its cache
        block = before.page_bytes // a.engine.elastic.sizing.blocks_per_page
        ledger.set_total_limit(33 * block + before.held_bytes // 3)
        steps_a = a.engine.stats.steps
        outs_b = b.generate(prompts_b, GREEDY)
        assert [o.outputs[0].token_ids for o in outs_b] == ref_b
        assert all(o.outputs[0].finish_reason == "length" for o in outs_b)
        assert b.engine.num_preemptions == 0  # it waited for a's memory, recomputed nothing
        after = a.engine.kv_storage.stats()
        assert a.engine.stats.steps == steps_a  # a was idle throughout
        assert after.held_bytes < before.held_bytes * 0.6
        assert after.reclaims >= 1 and after.reclaimed_bytes >= before.held_bytes * 0.4
        assert ledger.read().engines["a"].reclaimed_bytes == after.reclaimed_bytes
        # demoted, not dropped: a's next request for its first prompt reloads it
        loaded = a.engine.snapshot().offload["cpu"].bytes_loaded
        assert [o.outputs[0].token_ids for o in a.generate(prompts_a[:1], GREEDY)] == ref_a[:1]
        assert a.engine.snapshot().offload["cpu"].bytes_loaded > loaded
    finally:
        a.engine.shutdown()
        b.engine.shutdown()


def test_a_serving_engine_gives_back_on_its_loop_between_steps(tiny):
    """While an engine loop runs (``kvmem serve``'s), memory another engine asks for goes
    back on the loop's thread, at a step boundary: the memory thread only wakes it. Once
    the loop has stopped, the thread that took the wake-up gives back itself, under the
    step lock."""
    from kvmem.engine.async_engine import AsyncLLMEngine

    prompts = [[(i * 31 + j) % 250 + 1 for j in range(100)] for i in range(4)]
    a = LLM(str(tiny), kv_memory="elastic", engine_name="looped", **OPTIONS)
    ledger = Ledger.for_device("cpu")
    looped = AsyncLLMEngine(a.engine)
    threads: list[str] = []
    answered = threading.Event()
    storage = a.engine.kv_storage
    give_back = storage.give_back

    def recorded(nbytes, evict=None):
        threads.append(threading.current_thread().name)
        answered.set()
        return give_back(nbytes, evict=evict)

    storage.give_back = recorded
    try:
        a.generate(prompts, GREEDY)  # cached prefixes: memory a can give
        storage.settle()
        held = storage.stats().held_bytes
        ledger.set_total_limit(held + storage.geometry.page_bytes)
        asker = ledger.register("asker")
        looped.start()
        assert not asker.try_acquire(held // 2)
        assert answered.wait(10)
        assert threads == ["kvmem-engine"]  # the loop's thread
        looped.shutdown()
        answered.clear()
        asker.release(asker.held_bytes)
        assert not asker.try_acquire(held)
        assert answered.wait(10)
        assert threads[1] == "kvmem-wake"  # no loop: the wake-up's thread, under the lock
        asker.close()
    finally:
        looped.shutdown()
        a.engine.shutdown()
