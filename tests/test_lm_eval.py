"""Acceptance: lm-evaluation-harness's ``local-completions`` against ``kvmem serve`` gives
the same per-item log-likelihoods (within 0.02 nats), accuracy and generations as its
``hf`` model on the same checkpoint (the embedded SmolLM2, fp32), on a small local task:
32 multiple-choice items and 6 generate_until items (tests/data/lm_eval_task)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from serve_process import ServeProcess
from tiny_models import embedded_files

lm_eval = pytest.importorskip("lm_eval")  # the test extra installs it

DATA = Path(__file__).parent / "data" / "lm_eval_task"
TASKS = ["kvmem_mc", "kvmem_gen"]
NATS = 0.02


def write_tasks(directory: Path) -> None:
    common = {"dataset_path": "json", "test_split": "test"}
    mc = {**common, "task": "kvmem_mc",
          "dataset_kwargs": {"data_files": {"test": str(DATA / "mc.jsonl")}},
          "output_type": "multiple_choice", "doc_to_text": "{{question}}",
          "doc_to_choice": "{{choices}}", "doc_to_target": "label",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    gen = {**common, "task": "kvmem_gen",
           "dataset_kwargs": {"data_files": {"test": str(DATA / "gen.jsonl")}},
           "output_type": "generate_until", "doc_to_text": "{{prompt}}",
           "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False,
                                 "temperature": 0},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                            "higher_is_better": True}]}
    for spec in (mc, gen):  # YAML is a superset of JSON
        (directory / f"{spec['task']}.yaml").write_text(json.dumps(spec))


def evaluate(model: str, model_args: str, task_dir: Path, batch_size: int = 1) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                           task_manager=TaskManager(include_path=str(task_dir)),
                           log_samples=True, batch_size=batch_size, random_seed=0,
                           numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def per_item(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(directory)
    return directory


def test_local_completions_matches_hf(task_dir):
    path = str(embedded_files().path)
    reference = evaluate("hf", f"pretrained={path},dtype=float32,device=cpu", task_dir)
    server = ServeProcess(path, "--served-model-name", "smollm2", "--max-model-len", "512",
                          "--kv-cache-memory-bytes", "64MiB", "--log-level", "warning")
    try:
        served = evaluate("local-completions",
                          f"base_url={server.base}/v1/completions,model=smollm2,"
                          f"tokenizer={path},tokenizer_backend=huggingface,"
                          f"tokenized_requests=True,num_concurrent=1,max_retries=1", task_dir,
                          batch_size=16)  # 16 prompts per request
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, "".join(server.lines)
    ref_ll, got_ll = per_item(reference, "kvmem_mc"), per_item(served, "kvmem_mc")
    assert len(ref_ll) == len(got_ll) == 32
    worst = 0.0
    for ref_item, got_item in zip(ref_ll, got_ll, strict=True):
        for (ref_value, _), (got_value, _) in zip(ref_item, got_item, strict=True):
            worst = max(worst, abs(float(ref_value) - float(got_value)))
    assert worst < NATS, worst
    assert served["results"]["kvmem_mc"]["acc,none"] == reference["results"]["kvmem_mc"]["acc,none"]
    assert per_item(served, "kvmem_gen") == per_item(reference, "kvmem_gen")
    print(f"max |loglikelihood difference| {worst:.2e} nats; acc "
          f"{served['results']['kvmem_mc']['acc,none']:.3f}")
