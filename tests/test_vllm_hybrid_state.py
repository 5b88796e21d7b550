"""kvmem's vLLM integration on linear-attention hybrids: a tiny Qwen3-Next (Gated DeltaNet
3 : 1 full attention) and a tiny Nemotron-H (Mamba2, MLP and attention layers), random
weights in bfloat16, whose caches are per-token attention blocks beside per-request states
(vLLM's ``MambaSpec`` groups, in pages of the attention page's size).

Engine-free, in vLLM 0.32's and 0.33's code (one script per venv): the budget plugin on
the workers' real specs (a state layer first) hands vLLM the plan's per-rank budgets at
tp 2 and pp 2, and vLLM then allocates the plan's blocks; elastic KV memory counts each
pipeline stage's bytes per block as vLLM allocates them on an uneven split; KvmemConnector
refuses a state group in one line.

Live in vLLM-CPU 0.32 (each start 60 to 130 s here; the model directories and engines are
shared by the module):

- KvmemConnector on the Qwen3-Next stops at start with the one line, before any token;
- elastic KV memory on the Qwen3-Next beside an attention-only Llama, both on one ledger
  under one total: the hybrid gives plain vLLM's greedy tokens, every block of its state
  groups in use lies on a mapped page, and both keep to the total;
- the budget plugin (``proportional``) at tp 2 on the Qwen3-Next and, with elastic KV
  memory, at pp 2 (7 + 5 layers) on the Nemotron-H: every rank's logged budget, blocks and
  tokens are the plan's, and the ledger counts each stage's bytes per block as allocated.

vLLM-CPU 0.32 itself cannot generate with this Nemotron-H with prefix caching on (its
Mamba2 prefill in the "align" state mode fails with an IndexError, without kvmem): it runs
without prefix caching.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import vllm_cpu

from kvmem.integrations.vllm import kv_transfer_config
from tests.tiny_models import (
    make_config_checkpoint,
    make_tiny_checkpoint,
    tiny_nemotron_h,
    tiny_qwen3_next,
)

pytestmark = [pytest.mark.vllm]
LIVE = [pytest.mark.slow]

MAX_LEN, BLOCK, BATCHED, SEQS = 1000, 32, 512, 8
LOGPROBS = 5  # the top logprobs each live run records per token
KV_BYTES = 4 << 20  # per worker: a few requests of max_model_len


def qwen3_next() -> dict:
    # vLLM CPU's Gated DeltaNet kernel takes heads of 64 or more
    return {**tiny_qwen3_next(8, "bfloat16"), "linear_key_head_dim": 64,
            "linear_value_head_dim": 64}


SHAPES = {"qwen3_next": qwen3_next, "nemotron_h": lambda: tiny_nemotron_h("bfloat16", 1)}
TOKENS = {"bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 256}


def case(shape: str, tp: int, stages: list[list[int]], prefix_caching: bool = True) -> dict:
    config = {**SHAPES[shape](), **TOKENS}
    kinds = ({"M": "linear", "*": "full"}.get(c, "none") for c in
             config.get("hybrid_override_pattern", ""))
    if shape == "qwen3_next":
        kinds = ("full" if (i + 1) % 4 == 0 else "linear" for i in range(8))
    return {"id": f"{shape}-tp{tp}-pp{len(stages)}-{prefix_caching}", "shape": shape,
            "config": config, "dtype": "bfloat16", "layers": list(kinds), "tp": tp,
            "stages": stages, "prefix_caching": prefix_caching, "device": "cpu",
            "kv_dtype": "auto", "block_size": BLOCK, "max_model_len": MAX_LEN,
            "batched": BATCHED, "memory": [KV_BYTES] * (tp * len(stages))}


CASES = [case("qwen3_next", 2, [list(range(8))]),
         case("qwen3_next", 1, [list(range(4)), list(range(4, 8))], prefix_caching=False),
         case("nemotron_h", 1, [list(range(7)), list(range(7, 12))]),
         case("nemotron_h", 2, [list(range(6)), list(range(6, 12))])]

ENGINE_FREE = r"""
import dataclasses, functools, json, os, sys
from pathlib import Path

if __name__ == "__main__":
    tests_dir, tokenizer, cases_file = sys.argv[1:4]
    sys.path.insert(0, tests_dir)
    from vllm_kv_rules import Rules, cpu_platform
    cpu_platform()
    import vllm
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm_hybrid_rules import align_block_size, engine_config, layer_specs, name

    from kvmem.errors import ConfigError
    from kvmem.integrations.vllm.connector.layout import group_rules
    from kvmem.integrations.vllm.elastic.hybrid import planned_rank_block_bytes
    from kvmem.integrations.vllm.plugin.budget import plan_deployment, with_kvmem_budgets

    results = []
    for case in json.loads(Path(cases_file).read_text()):
        os.environ["VLLM_PP_LAYER_PARTITION"] = ",".join(str(len(s)) for s in case["stages"])
        config = engine_config(tokenizer, case, Path(cases_file).parent)
        config.scheduler_config.max_num_seqs = 8
        align_block_size(config, "cpu")
        by_layer = layer_specs(config, case)
        if case["shape"] == "qwen3_next":  # as vLLM's GatedDeltaNet layer declares it
            by_layer = {i: dataclasses.replace(s, mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
                        if type(s).__name__ == "MambaSpec" else s for i, s in by_layer.items()}
        # every worker in rank order: its stage's layers
        specs = [{name(i): by_layer[i] for i in stage if i in by_layer}
                 for stage in case["stages"] for _ in range(case["tp"])]
        rules = Rules(config)
        handed = []
        real = rules.planning.get_kv_cache_configs

        @functools.wraps(real)
        def recorder(*args, **kwargs):
            handed.append(list(args[2]))
            return real(*args, **kwargs)

        more = (rules.global_groups(config, specs),) if rules.builder is not None else ()
        configs = with_kvmem_budgets(recorder, "proportional")(config, specs, case["memory"],
                                                               *more)
        plan = plan_deployment(config, specs, case["memory"], "proportional")
        allocated = [sum(t.size for t in c.kv_cache_tensors) // c.num_blocks for c in configs]
        try:
            group_rules(configs[0])
            refusal = None
        except ConfigError as exc:
            refusal = str(exc)
        results.append({
            "handed": handed[0],
            "planned_budgets": [r.kv_budget_bytes for r in plan.ranks],
            "num_blocks": [c.num_blocks for c in configs],
            "planned_blocks": [r.num_blocks for r in plan.ranks],
            "allocated_block_bytes": allocated,
            "elastic_block_bytes": planned_rank_block_bytes(config, configs[0], allocated[0]),
            "refusal": refusal,
        })
    print("KVMEM_HYBRID_INTEGRATION " + json.dumps({"vllm": vllm.__version__,
                                                    "cases": results}), flush=True)
"""


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def engine_free(request, tmp_path_factory) -> dict:
    cases_file = tmp_path_factory.mktemp("hybrid") / "cases.json"
    cases_file.write_text(json.dumps(CASES))
    return vllm_cpu.run_for_json(ENGINE_FREE, "KVMEM_HYBRID_INTEGRATION",
                                 str(vllm_cpu.REPO / "tests"), str(vllm_cpu.model_dir()),
                                 str(cases_file), series=request.param, timeout=600)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["id"] for c in CASES])
def test_budget_plugin_hands_vllm_the_planned_budgets(engine_free, index):
    """The plugin reads the attention layers' block size and dtype (a state layer comes
    first) and Nemotron-H's layer count (its config writes only its layer list); vLLM then
    allocates the plan's blocks on every rank."""
    got = engine_free["cases"][index]
    assert got["handed"] == got["planned_budgets"]
    assert got["num_blocks"] == got["planned_blocks"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["id"] for c in CASES])
def test_elastic_counts_each_stage_as_vllm_allocates_it(engine_free, index):
    """On 7 + 5 layers the Nemotron-H's stages hold the same KV tensors, so the same bytes
    per block: counted by layers, stage 1 would be 5/7 of stage 0."""
    got = engine_free["cases"][index]
    assert got["elastic_block_bytes"] == got["allocated_block_bytes"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["id"] for c in CASES])
def test_connector_refuses_state_groups_in_one_line(engine_free, index):
    layers = "Gated DeltaNet" if CASES[index]["shape"] == "qwen3_next" else "Mamba2"
    refusal = engine_free["cases"][index]["refusal"]
    assert refusal.startswith(f"KvmemConnector: this model's {layers} layers keep a "
                              "per-request state (vLLM's MambaSpec)")
    assert "\n" not in refusal


# ---------------------------------------------------------------------- live, vLLM-CPU 0.32
PROMPTS = [[(i * 7) % 250 for i in range(300)], [(i * 11 + 3) % 250 for i in range(300)],
           [(i * 7) % 250 for i in range(300)]]  # A, B, A


def qwen3_next_weights(root: Path) -> str:
    """The tiny Qwen3-Next with random weights from transformers (vLLM's dummy weights
    give every prompt one repeated token), initialised widely enough to vary its tokens."""
    import torch
    import transformers

    fields = {k: v for k, v in {**qwen3_next(), **TOKENS}.items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **fields, initializer_range=0.1)).to(torch.bfloat16).eval()
    out = root / "qwen3_next-weights"
    model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    return str(make_config_checkpoint(root, out.name, config))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Config-only checkpoints (vLLM's dummy weights) of both shapes, the Qwen3-Next with
    random weights, and a tiny Llama."""
    root = tmp_path_factory.mktemp("hybrids")
    out = {shape: str(make_config_checkpoint(root, shape, {**SHAPES[shape](), **TOKENS}))
           for shape in SHAPES}
    out["qwen3_next_weights"] = qwen3_next_weights(root)
    out["llama"] = str(make_tiny_checkpoint(root, "llama", hidden_size=128,  # heads of 32
                                            intermediate_size=256, max_position_embeddings=1024))
    return out


def engine(**extra) -> dict:
    # float32 SSM states on every CPU, as vLLM-CPU picks them itself only on AVX512-BF16
    # ones: the pages and block sizes below are then the same on all
    return vllm_cpu.fast_engine({"dtype": "bfloat16", "load_format": "dummy",
                                 "block_size": BLOCK, "max_model_len": MAX_LEN,
                                 "max_num_batched_tokens": BATCHED, "max_num_seqs": SEQS,
                                 "kv_cache_memory_bytes": KV_BYTES,
                                 "mamba_ssm_cache_dtype": "float32", **extra})


def llm_run(model: str, eng: dict, prompts: list, env: dict | None = None,
            threads_bind: str = "0|1") -> vllm_cpu.VllmRun:
    cfg = {"model": model, "engine": eng, "prompts": prompts, "max_tokens": 12,
           "logprobs": LOGPROBS}
    return vllm_cpu.run_script(vllm_cpu.LLM_SCRIPT, json.dumps(cfg), env=env, timeout=600,
                               threads_bind=threads_bind)


def result(run: vllm_cpu.VllmRun) -> dict:
    lines = [x for x in run.check().stdout.splitlines() if x.startswith("KVMEM_RESULT ")]
    assert len(lines) == 1, run.output[-6000:]
    return json.loads(lines[0].removeprefix("KVMEM_RESULT "))


@pytest.fixture(scope="module")
def plain_and_refused(models) -> tuple[dict, vllm_cpu.VllmRun]:
    """Plain vLLM's tokens on the Qwen3-Next, and its start with KvmemConnector; side by
    side, one core each."""
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(llm_run, models["qwen3_next_weights"], engine(load_format="auto"),
                            PROMPTS, None, "0")
        refused = pool.submit(llm_run, models["qwen3_next"], engine(
            kv_transfer_config=kv_transfer_config(cpu_offload_gib=0.1)), PROMPTS, None, "1")
        return result(plain.result()), refused.result()


@pytest.mark.slow
def test_connector_stops_a_gdn_hybrid_at_start_in_one_line(plain_and_refused):
    _, refused = plain_and_refused
    assert refused.returncode != 0
    assert "KVMEM_RESULT" not in refused.stdout  # no token came out
    line = ("kvmem.errors.ConfigError: KvmemConnector: this model's Gated DeltaNet layers "
            "keep a per-request state (vLLM's MambaSpec), whose pages the connector does not "
            "store: a prefix reloaded without the state at its last token would give wrong "
            "outputs, "
            "so the connector refuses hybrid linear-attention models (start vLLM without it)")
    assert line in refused.output.splitlines() or any(
        x.endswith(line) for x in refused.output.splitlines()), refused.output[-3000:]


TWO_ENGINES = r"""
import json, os, subprocess, sys, time
from pathlib import Path

""" + vllm_cpu.BARRIER + r"""
def unmapped(_worker, ids):
    # run in the worker: which of these block ids lie on no mapped page
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from kvmem.integrations.vllm.elastic.connector import KvmemElasticConnector
    group = get_kv_transfer_group()
    for c in [group, *getattr(group, "sub_connectors", [])]:
        if isinstance(c, KvmemElasticConnector) and c.worker_side is not None:
            return [i for i in ids if not c.worker_side.mapped[i]]
    raise AssertionError("no elastic connector")

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    role, other = cfg["role"], cfg["other"]
    from vllm import LLM, SamplingParams
    from kvmem.memory.ledger import Ledger
    llm = LLM(model=cfg["model"], **cfg["engine"])
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    groups = sched.kv_cache_config.kv_cache_groups
    state = [g for g, x in enumerate(groups) if type(x.kv_cache_spec).__name__ == "MambaSpec"]
    ledger = Ledger.for_device("cpu", os.environ["KVMEM_LEDGER_DIR"])
    barrier("ready")
    if role == "hybrid":
        subprocess.run([sys.executable, "-m", "kvmem", "limit", "--total", cfg["total"],
                        "--device", "cpu", "--ledger-dir", os.environ["KVMEM_LEDGER_DIR"]],
                       check=True, capture_output=True)
    barrier("limit")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=cfg["logprobs"])
    for i, p in enumerate(cfg["prompts"]):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    tokens, logprobs, preemptions, steps = {}, {}, {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
                logprobs[o.request_id] = [{str(t): v.logprob for t, v in d.items()}
                                          for d in o.outputs[0].logprobs]
        for rid, r in sched.requests.items():  # vLLM's ids: the caller's, then a suffix
            preemptions[rid.split("-")[0]] = r.num_preemptions
        in_use = [b for r in sched.running for g in state
                  for b in sched.kv_cache_manager.get_block_ids(r.request_id)[g] if b]
        entries = ledger.entries()
        steps.append({"state_blocks": len(in_use),
                      "unmapped": llm.collective_rpc(unmapped, args=(in_use,))[0],
                      "held": next(e for e in entries if e.name == role).mapped_bytes,
                      "all": sum(e.mapped_bytes for e in entries)})
    barrier("served")
    ids = [str(i) for i in range(len(cfg["prompts"]))]
    out = {"tokens": [tokens[i] for i in ids], "logprobs": [logprobs[i] for i in ids],
           "preemptions": [preemptions.get(i, 0) for i in ids], "steps": steps,
           "state_groups": len(state)}
    print("KVMEM_RESULT " + json.dumps(out), flush=True)
"""
# Both engines' KV under 3 MiB, each reserving 4 MiB: the hybrid's three requests alone
# want about 3.5 MiB (pages of 147,456 bytes: two of its 288-token attention blocks and two
# blocks of each of its three state groups per request), the Llama's about 1.1 MiB.
TOTAL = 3 << 20
HYBRID_PAGE = 147_456
STEP_OVERDRAFT = 12 * HYBRID_PAGE  # what one step of the hybrid may take past the room it read


@pytest.fixture(scope="module")
def shared_ledger(models, tmp_path_factory) -> dict[str, dict]:
    """The elastic Qwen3-Next and an elastic Llama on one ledger, one core each."""
    ledger, sync = tmp_path_factory.mktemp("ledger"), tmp_path_factory.mktemp("sync")
    runs = {}
    with ThreadPoolExecutor(2) as pool:
        for role, other, core in (("hybrid", "llama", "0"), ("llama", "hybrid", "1")):
            eng = engine(load_format="auto") if role == "hybrid" else engine(
                dtype="float32", load_format="auto", block_size=128)
            cfg = {"model": models["qwen3_next_weights" if role == "hybrid" else "llama"],
                   "engine": eng, "prompts": PROMPTS, "role": role, "other": other,
                   "sync": str(sync), "total": str(TOTAL), "logprobs": LOGPROBS}
            env = {"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_LEDGER_DIR": str(ledger),
                   "KVMEM_VLLM_ENGINE_NAME": role, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
            runs[role] = pool.submit(vllm_cpu.run_script, TWO_ENGINES, json.dumps(cfg),
                                     env=env, timeout=700, threads_bind=core)
        done = {role: run.result() for role, run in runs.items()}
    for role, run in done.items():  # the one that failed, not the one left waiting for it
        assert run.returncode == 0, f"{role}:\n{run.output[-6000:]}"
    return {role: result(run) for role, run in done.items()}


@pytest.mark.slow
def test_elastic_hybrid_gives_plain_vllms_tokens(shared_ledger, plain_and_refused):
    """Under the shared total the hybrid's requests may wait, be preempted and be computed
    again, which rounds its bf16 sums differently (this model's top two tokens are at
    times 0.016 apart): the runs agree as ``vllm_cpu.assert_greedy_runs_agree`` says."""
    plain, _ = plain_and_refused
    hybrid = shared_ledger["hybrid"]
    for i in range(len(PROMPTS)):
        vllm_cpu.assert_greedy_runs_agree(
            plain["tokens"][i], plain["logprobs"][i], hybrid["tokens"][i],
            hybrid["logprobs"][i], f"prompt {i}, preempted {hybrid['preemptions'][i]} times")
    assert plain["tokens"][0] == plain["tokens"][2]  # A twice: the same greedy tokens


@pytest.mark.slow
def test_state_blocks_in_use_lie_on_mapped_pages(shared_ledger):
    hybrid = shared_ledger["hybrid"]
    assert hybrid["state_groups"] == 3  # 6 Gated DeltaNet layers in groups of 2
    assert max(s["state_blocks"] for s in hybrid["steps"]) > 0
    assert all(s["unmapped"] == [] for s in hybrid["steps"])


@pytest.mark.slow
def test_a_hybrid_and_a_llama_keep_to_one_total(shared_ledger):
    steps = [s for side in shared_ledger.values() for s in side["steps"]]
    peaks = {role: max(s["held"] for s in side["steps"]) for role, side in shared_ledger.items()}
    assert all(s["held"] > 0 for s in steps)
    # together they filled the total (wanting more than it: see TOTAL), within a page
    assert sum(peaks.values()) >= TOTAL - HYBRID_PAGE, peaks
    # and kept to it, give or take an overdraft of one step's blocks (see
    # test_vllm_elastic's two engines)
    assert max(s["all"] for s in steps) <= TOTAL + STEP_OVERDRAFT, (peaks, steps)


def kvmem_plan(model: str, *args: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "kvmem", "plan", model, "--device", "cpu",
                          "--vllm-version", "0.32", "--block-size", str(BLOCK),
                          "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len",
                          str(MAX_LEN), "--max-num-batched-tokens", str(BATCHED),
                          "--max-num-seqs", str(SEQS), "--kv-budget", "proportional", "--json",
                          "--mamba-ssm-cache-dtype", "float32", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def assert_ranks_are_planned(run: vllm_cpu.VllmRun, planned: dict) -> None:
    """Each rank's line: the bytes it allocated (its one allocation, which the state and
    attention groups overlay), its blocks and vLLM's KV cache size, as planned."""
    ranks = vllm_cpu.LLMRun(run, [], []).kvmem_ranks()
    engine = planned["engine"]
    assert {rank: (r["bytes"], r["blocks"], r["tokens"]) for rank, r in ranks.items()} == {
        r["rank"]: (engine["num_blocks"] * r["bytes_per_block"], engine["num_blocks"],
                    engine["kv_cache_size_tokens"]) for r in planned["ranks"]}
    assert all(r["kv_budget_bytes"] >= engine["num_blocks"] * r["bytes_per_block"]
               for r in planned["ranks"])


@pytest.mark.slow
@pytest.mark.extended  # the engine-free run checks the plugin at tp 2 on 0.32 and 0.33
def test_budget_plugin_at_tp2_on_the_gdn_hybrid(models):
    run = llm_run(models["qwen3_next"], engine(tensor_parallel_size=2), PROMPTS[:1],
                  env={"KVMEM_VLLM_KV_BUDGET": "proportional"})
    result(run)
    assert_ranks_are_planned(run, kvmem_plan(models["qwen3_next"], "--tp", "2"))


@pytest.mark.slow
def test_budget_plugin_and_elastic_at_uneven_pp2_on_the_mamba2_hybrid(models):
    """Without prefix caching (with it vLLM-CPU 0.32 cannot prefill this model): the ranks
    are the plan's, and the first step's message to the workers, which carries the bytes
    per block the ledger credits each rank with, matches what each allocated."""
    run = llm_run(models["nemotron_h"], engine(pipeline_parallel_size=2,
                                               enable_prefix_caching=False), PROMPTS[:1],
                  env={"KVMEM_VLLM_KV_BUDGET": "proportional", "KVMEM_VLLM_KV_MEMORY": "elastic",
                       "VLLM_PP_LAYER_PARTITION": "7,5"})
    assert len(result(run)["tokens"][0]) == 12
    assert_ranks_are_planned(run, kvmem_plan(models["nemotron_h"], "--pp", "2",
                                             "--layer-partition", "7,5",
                                             "--no-enable-prefix-caching"))
    assert "the ledger counts" not in run.output  # each stage credited as allocated


@pytest.fixture(scope="module")
def mamba2_without_prefix_caching(models) -> dict[str, dict]:
    """Plain vLLM and elastic KV memory on the Nemotron-H without prefix caching (vLLM's
    "none" state mode, where its CPU build can prefill it), side by side."""
    eng = engine(enable_prefix_caching=False)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(llm_run, models["nemotron_h"], eng, PROMPTS, None, "0")
        elastic = pool.submit(llm_run, models["nemotron_h"], eng, PROMPTS,
                              {"KVMEM_VLLM_KV_MEMORY": "elastic"}, "1")
        return {"plain": result(plain.result()), "elastic": result(elastic.result())}


@pytest.mark.slow
@pytest.mark.extended  # two more starts
def test_elastic_mamba2_hybrid_gives_plain_vllms_tokens(mamba2_without_prefix_caching):
    runs = mamba2_without_prefix_caching
    assert runs["elastic"]["tokens"] == runs["plain"]["tokens"]
    assert runs["plain"]["tokens"][0] != runs["plain"]["tokens"][1]

