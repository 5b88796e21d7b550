"""Run inside a vLLM venv by tests/test_plan_vllm_backends.py: vLLM's own CUDA attention
backends' kernel block sizes, and the block size vLLM's platform picks for sets of them.

For each backend the test names (``AttentionBackendEnum`` names), its class is imported
and asked ``get_supported_kernel_block_sizes()`` (no config is current, so no condition
that needs a GPU applies). A class whose module does not import on the CPU build (it
needs FlashInfer, FlashAttention's CUDA extensions or CUDA itself) is read from its
source file instead: the list literal its ``get_supported_kernel_block_sizes`` returns,
in the backend's class or a base class of its module (the first such return: the one
taken without a config, e.g. before FlashInfer's large pages). Each size is printed as its base (an
exact ``n`` or ``MultipleOf(n)`` both give ``n``, as vLLM's ``supports_block_size``
takes them), with how it was read.

For each set of importable backends, ``Platform._preferred_block_size_for_backends``
(the block size without ``--block-size``) is printed; for each GPU and model kind, the
order in which vLLM tries its CUDA backends (``_get_backend_priorities``).

Prints one line ``KVMEM_BACKENDS {json}``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import traceback

# backends outside AttentionBackendEnum: the layer picks them itself
OWN_PATHS = {"DEEPSEEK_V32_INDEXER":
             "vllm.v1.attention.backends.mla.indexer.DeepseekV32IndexerBackend"}


def enum_path(name: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return OWN_PATHS.get(name) or AttentionBackendEnum[name].value


def imported_sizes(path: str) -> list[int]:
    from vllm.v1.attention.backend import MultipleOf

    module, _, cls = path.rpartition(".")
    backend = getattr(importlib.import_module(module), cls)
    return [s.base if isinstance(s, MultipleOf) else s
            for s in backend.get_supported_kernel_block_sizes()]


def source_sizes(path: str, name: str) -> list[int]:
    """The literal list ``get_supported_kernel_block_sizes`` returns in the module's class
    named ``name`` (by its ``get_name``), or the class the enum's path names."""
    module, _, cls_name = path.rpartition(".")
    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    cls = classes[cls_name]
    for c in classes.values():  # the method may be on a base class of the module
        methods = {f.name: f for f in c.body if isinstance(f, ast.FunctionDef)}
        if "get_supported_kernel_block_sizes" in methods and (
                c is cls or c.name in {b.id for b in cls.bases if isinstance(b, ast.Name)}):
            returns = sorted((n for n in ast.walk(methods["get_supported_kernel_block_sizes"])
                              if isinstance(n, ast.Return)), key=lambda n: n.lineno)
            if not returns or not isinstance(returns[0].value, ast.List):
                raise ValueError(f"{name}: its sizes are not a list literal")
            # the first return is the one without a config (FlashInfer's large pages, on
            # Blackwell with TRT-LLM attention, come after it)
            return [ast.literal_eval(e) if isinstance(e, ast.Constant)
                    else ast.literal_eval(e.args[0]) for e in returns[0].value.elts]
    raise ValueError(f"{name}: no get_supported_kernel_block_sizes in {module}")


def preferred(names: list[str]) -> int:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import Platform

    classes = []
    for name in names:
        module, _, cls = enum_path(name).rpartition(".")
        classes.append(getattr(importlib.import_module(module), cls))
    return Platform._preferred_block_size_for_backends(classes, 16, VllmConfig())


def priorities(cases: list[dict]) -> list[list[str]]:
    """``_get_backend_priorities`` of vllm/platforms/cuda.py for each case. The module
    imports vLLM's CUDA extension first, which the CPU build lacks: an empty module
    stands in for it (the function reads no extension)."""
    import types

    sys.modules.setdefault("vllm._C_stable_libtorch",
                           types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.platforms.cuda import _get_backend_priorities
    from vllm.platforms.interface import DeviceCapability

    return [[b.name for b in _get_backend_priorities(
        c["mla"], DeviceCapability(c["major"], 0), num_heads=c["heads"],
        kv_cache_dtype="fp8" if c["quantized_kv"] else "auto", head_size=c["head_size"])]
        for c in cases]


def main() -> None:
    tests_dir, names, sets = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    orders = json.loads(sys.argv[4])
    sys.path.insert(0, tests_dir)
    import vllm
    from vllm_kv_rules import cpu_platform

    cpu_platform()
    backends = {}
    for name in names:
        try:
            path = enum_path(name)
        except (KeyError, ValueError):  # not a backend of this release
            backends[name] = {"missing": True}
            continue
        try:
            backends[name] = {"sizes": imported_sizes(path), "read": "imported"}
        except Exception as e:  # noqa: BLE001 - its module needs a GPU's libraries
            try:
                backends[name] = {"sizes": source_sizes(path, name), "read": "source",
                                  "import_error": f"{type(e).__name__}: {e}"[:200]}
            except Exception:  # noqa: BLE001 - reported to the test
                backends[name] = {"traceback": traceback.format_exc()}
    chosen = []
    for names_ in sets:
        try:
            chosen.append({"backends": names_, "block_size": preferred(names_)})
        except Exception:  # noqa: BLE001 - reported to the test
            chosen.append({"backends": names_, "traceback": traceback.format_exc()})
    print("KVMEM_BACKENDS " + json.dumps({"vllm": vllm.__version__, "backends": backends,
                                          "preferred": chosen,
                                          "priorities": priorities(orders)}), flush=True)


if __name__ == "__main__":
    main()
