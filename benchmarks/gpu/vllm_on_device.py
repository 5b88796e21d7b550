"""vLLM 0.33.0's own Python code on the device, and kvmem's three vLLM pieces inside it.

    python benchmarks/gpu/vllm_on_device.py --device cuda --out DIR [--budget-s 150]
    python benchmarks/gpu/vllm_on_device.py --device cpu --out DIR --quick   # CPU shake-out

On a GPU the vLLM is the overlay in ``.vllmgpu/`` (``scripts/vllm-gpu-overlay.sh`` builds
it): vLLM 0.33.0's released wheel without its compiled code, over the device's own torch,
Triton and transformers, and the wheels of vLLM's other imports the device lacks
(installed into a temporary folder, each only where its distribution is absent). vLLM's
compiled extensions are built for torch 2.14 and are not carried; so the engine runs what
needs no compiled kernel: the Triton attention backend (which writes the KV cache with
its own Triton kernel), vLLM's torch-native custom ops (``custom_ops=["none"]``, and the
"native" implementations of its IR ops rms_norm and fused_add_rms_norm), eager mode, the
V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``: V2 maps host buffers through a compiled op).
The one module vLLM's CUDA platform imports unconditionally, ``vllm._C_stable_libtorch``,
is stood in for by a Python module registering torch versions of the few ``torch.ops._C``
ops this path looks up (``STAND_IN_OPS``); the report says which of them were called.
Without ``.vllmgpu/`` the script reports "overlay absent" and exits 0.

With ``--device cpu`` the engines are vLLM's CPU build (the 0.32 venv of
``scripts/vllm-cpu-venv.sh``, ``KVMEM_VLLM_VENV``) started as the tests start them: the
check logic, token comparisons and report, without the overlay.

Each engine runs in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine
core in that process), on the tests' tiny random-weight Llama (4 layers, 4 heads and 2 KV
heads of 64, fp32, weights from transformers), with a stated KV size. Every engine
generates greedily: four reference prompts together, then A, B, a short C, a reset of
vLLM's prefix cache, and A again. Checks:

0. vLLM as released: ``import vllm`` and its platform without any stand-in; where it stops
   (not a failure: the compiled code is not carried);
1. plain vLLM: starts and generates; its tokens are the reference (if it fails, the rest
   are not run);
2. the budget plugin (``KVMEM_VLLM_KV_BUDGET=proportional``): plain vLLM's tokens; the
   plugin's rank line gives the KV cache vLLM logs, that of plain vLLM;
3. ``KvmemConnector`` with a CPU tier: plain vLLM's tokens; the second A, after the
   reset, is served from the tier (its cached tokens beyond plain vLLM's);
4. elastic KV memory (``KVMEM_VLLM_KV_MEMORY=elastic``): plain vLLM's tokens, on the
   elastic reservation.

A failed check names the stage it stopped at (import, engine start, generate), the error,
and the last lines of the engine process's stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402 - puts the repository on sys.path

NAME = "vllm_on_device"
VLLM = "0.33.0"
ROOT = common.ROOT
OVERLAY = ROOT / ".vllmgpu"
TARBALL = OVERLAY / f"vllm-{VLLM}-py.tar.xz"
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64
STAND_IN_OPS = ("silu_and_mul", "rms_norm", "fused_add_rms_norm")
STDERR_LINES = 25
# C: a short request after B, whose steps see B's stores through; with its output it
# stays under one block, so nothing of it is stored and the reset after it can succeed
C_TOKENS = 4
# What reading vLLM 0.33's code could not settle without the device (the report lists them)
EXPECTED_STOPS = (
    "as released, vllm/platforms/cuda.py's `import vllm._C_stable_libtorch` "
    "(ModuleNotFoundError) when current_platform resolves to CUDA",
    "a torch API vLLM 0.33 uses that torch 2.11 lacks (0.33 pins torch 2.14; not checked "
    "against 2.11 here): AttributeError or ImportError at import or engine start",
    "a Triton kernel of 0.33 (unified attention, reshape_and_cache, slot mapping) that "
    "Triton 3.6 cannot compile: an error in the engine start's profile run",
    "a torch.ops._C op this path calls that the stand-in lacks: AttributeError "
    "\"'_OpNamespace' '_C' object has no attribute ...\"",
    "llguidance 1.7's wheel needs glibc 2.31 or later (imported at engine start by the "
    "structured-output module's annotations)",
)
PLUGIN_LINE = re.compile(r"kvmem: rank (\d+) \(pp stage \d+, tp rank \d+\): KV budget (\d+) "
                         r"bytes, (\d+) blocks, (\d+) tokens")
KV_SIZE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


# ----------------------------------------------------------------- the engine process
def install_stand_in() -> dict[str, int]:
    """Register torch versions of the ``torch.ops._C`` ops a Llama in eager mode looks up
    (``SiluAndMul`` fetches its op when built, even when its native forward is used) and
    put a module in place of ``vllm._C_stable_libtorch``. Returns the calls served."""
    import types

    import torch

    served = dict.fromkeys(STAND_IN_OPS, 0)

    def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
        served["silu_and_mul"] += 1
        d = x.shape[-1] // 2
        out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])

    def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return (y.to(x.dtype) * weight) if weight is not None else y.to(x.dtype)

    def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> None:
        served["rms_norm"] += 1
        out.copy_(rms(x, weight, eps))

    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                           weight: torch.Tensor | None, eps: float) -> None:
        served["fused_add_rms_norm"] += 1
        residual.add_(x)
        x.copy_(rms(residual, weight, eps))

    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("silu_and_mul(Tensor(a!) result, Tensor input) -> ()")
    lib.define("rms_norm(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()")
    lib.define("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, "
               "float epsilon) -> ()")
    for name, fn in (("silu_and_mul", silu_and_mul), ("rms_norm", rms_norm),
                     ("fused_add_rms_norm", fused_add_rms_norm)):
        lib.impl(name, fn, "CompositeExplicitAutograd")
    module = types.ModuleType("vllm._C_stable_libtorch")
    module.__doc__ = "torch versions of a few vLLM ops, in place of the compiled extension"
    module.library = lib  # registrations last as long as the library object
    sys.modules["vllm._C_stable_libtorch"] = module
    return served


def stage(name: str) -> None:
    print(f"KVMEM_STAGE {name}", flush=True)


def tail_of_exception() -> list[str]:
    import traceback

    return traceback.format_exc().strip().splitlines()[-STDERR_LINES:]


def probe() -> dict[str, Any]:
    """``import vllm`` as released (no stand-in): how far it gets."""
    steps = [("import vllm", "import vllm"),
             ("vllm.platforms.current_platform",
              "from vllm.platforms import current_platform; current_platform.device_type"),
             ("from vllm import LLM", "from vllm import LLM")]
    done = []
    for what, code in steps:
        stage(what)
        try:
            exec(code, {})  # noqa: S102 - fixed import statements
        except BaseException as e:  # noqa: BLE001 - where it stops is the finding
            return {"stopped_at": what, "error": f"{type(e).__name__}: {e}",
                    "traceback": tail_of_exception(), "done": done}
        done.append(what)
    import vllm

    return {"stopped_at": None, "done": done, "vllm": vllm.__version__}


def engine_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": cfg["model"], "dtype": "float32", "seed": 0, "enforce_eager": True,
        "max_model_len": cfg["max_model_len"], "max_num_seqs": 8,
        "max_num_batched_tokens": cfg["max_model_len"], "block_size": cfg["block_size"],
        "kv_cache_memory_bytes": cfg["kv_bytes"], "enable_prefix_caching": True}
    if cfg["device"].startswith("cuda"):
        from vllm.config.kernel import IrOpPriorityConfig, KernelConfig

        kw.update(gpu_memory_utilization=0.3, attention_backend="TRITON_ATTN",
                  compilation_config={"custom_ops": ["none"]},
                  kernel_config=KernelConfig(ir_op_priority=IrOpPriorityConfig(
                      rms_norm=["native"], fused_add_rms_norm=["native"])))
    if cfg["role"] == "connector":
        from kvmem.integrations.vllm import kv_transfer_config

        kw["kv_transfer_config"] = kv_transfer_config(cpu_offload_gib=0.25)
    return kw


def serve(cfg: dict[str, Any]) -> dict[str, Any]:
    """One engine: the reference batch, then A, B, C, a prefix-cache reset and A again."""
    out: dict[str, Any] = {"stage": "import"}
    served = None
    try:
        stage("import")
        if cfg["device"].startswith("cuda"):
            served = install_stand_in()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        out.update(vllm=vllm.__version__, vllm_file=vllm.__file__, torch=torch.__version__)
        out["stage"] = "engine start"
        stage("engine start")
        began = time.monotonic()
        llm = LLM(**engine_kwargs(cfg))
        out["start_s"] = round(time.monotonic() - began, 1)
        out["stage"] = "generate"
        stage("generate")
        def run(prompts: list[list[int]], max_tokens: int = cfg["max_tokens"]
                ) -> list[dict[str, Any]]:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                    for o in outs]

        began = time.monotonic()
        p = cfg["prompts"]
        out["reference"] = run(p["reference"])
        out["sequence"] = {"A": run([p["A"]])[0], "B": run([p["B"]])[0],
                           "C": run([p["C"]], C_TOKENS)[0]}
        out["reset"] = bool(llm.reset_prefix_cache())
        out["sequence"]["A again"] = run([p["A"]])[0]
        out["generate_s"] = round(time.monotonic() - began, 1)
        out["stage"] = "done"
    except BaseException as e:  # noqa: BLE001 - the stage and error are the result
        out.update(error=f"{type(e).__name__}: {str(e)[:500]}", traceback=tail_of_exception())
        import traceback

        traceback.print_exc()  # to stderr, whose tail the report keeps
    if served is not None:
        out["stand_in_calls"] = served
    return out


def child(args: argparse.Namespace) -> int:
    cfg = json.loads(Path(args.cfg).read_text())
    result = probe() if cfg["role"] == "probe" else serve(cfg)
    common.print_result(result)
    sys.stdout.flush()
    os._exit(0)  # an engine that failed half-way may hang at exit


# ----------------------------------------------------------------- the parent
def unpack_overlay(work: Path, report: common.Report) -> tuple[bool, str]:
    """vLLM's tree, kvmem's dist-info and the missing wheels into ``work/site``."""
    import importlib.metadata as md

    site = work / "site"
    marker = site / ".kvmem-overlay"
    stamp = f"{TARBALL.stat().st_size} {TARBALL.stat().st_mtime_ns}"
    if not (marker.is_file() and marker.read_text() == stamp):
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        with tarfile.open(TARBALL) as tar:
            tar.extractall(site, filter="data")
        shutil.copytree(OVERLAY / "kvmem-0.1.0.dist-info", site / "kvmem-0.1.0.dist-info")
        missing, present = [], []
        wheels = sorted((OVERLAY / "wheels").glob("*.whl")) + sorted((ROOT / ".whl").glob("*.whl"))
        for wheel in wheels:
            dist = wheel.name.split("-")[0]
            try:
                md.version(dist)
                present.append(dist)
            except md.PackageNotFoundError:
                missing.append(wheel)
        if missing:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                 "--no-compile", "--no-cache-dir", "--target", str(site)]
                + [str(w) for w in missing], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return False, "pip install of the carried wheels failed: " + " | ".join(
                    (done.stderr or done.stdout).strip().splitlines()[-5:])
        report.figure("wheels_installed", [w.name.split("-")[0] for w in missing])
        report.figure("wheels_already_present", present)
        marker.write_text(stamp)
    report.figure("overlay_site", str(site))
    return True, (f"vLLM {VLLM}'s Python code unpacked in {site}; installed "
                  f"{len(report.figures.get('wheels_installed', []))} carried wheels")


def engine_env(args: argparse.Namespace, role: str, work: Path) -> dict[str, str]:
    extra = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false"}
    if role == "plugin":
        extra["KVMEM_VLLM_KV_BUDGET"] = "proportional"
    if role == "elastic":
        ledger = work / "ledger"
        ledger.mkdir(exist_ok=True)
        extra.update(KVMEM_VLLM_KV_MEMORY="elastic", KVMEM_LEDGER_DIR=str(ledger),
                     KVMEM_VLLM_ENGINE_NAME="device-check")
    if args.device == "cpu":
        import vllm_cpu  # tests/: the tests' environment for vLLM's CPU build

        env = vllm_cpu.vllm_env(extra)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
        return env
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVMEM_VLLM_", "VLLM_"))}
    env.update(extra)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES") or (
        args.device.split(":")[1] if ":" in args.device else "0")
    paths = [str(work / "site"), str(ROOT), str(ROOT / "tests")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "")
                                                 .split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def engine_python(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        import vllm_cpu

        return str(vllm_cpu.venv_dir("0.32") / "bin" / "python")
    return sys.executable


class Engine:
    """One engine process, started now and waited for later; its output goes to files
    (several may run at once)."""

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any], work: Path) -> None:
        self.role = cfg["role"]
        path = work / f"{self.role}.json"
        path.write_text(json.dumps(cfg))
        logs = Path(args.out) / f"{NAME}-logs"  # beside the report: they come back with it
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / f"{self.role}.out", logs / f"{self.role}.err"
        argv = [engine_python(args), __file__, "--child", "--cfg", str(path), "--out",
                str(args.out), "--device", args.device]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, env=engine_env(args, self.role, work),
                                         cwd=str(ROOT), stdout=out, stderr=err,
                                         start_new_session=True)

    def finish(self, timeout: float) -> dict[str, Any]:
        """Its RESULT, the stage it reached and its output; killed past ``timeout``."""
        timed_out = False
        try:
            self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # and whatever it started
        self.proc.wait()
        stdout = self.out_path.read_text(errors="replace")
        stderr = self.err_path.read_text(errors="replace")
        stages = [x.split(" ", 1)[1] for x in stdout.splitlines()
                  if x.startswith("KVMEM_STAGE ")]
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        result = json.loads(line[len("RESULT "):]) if line else {}
        if not line:
            result["stage"] = stages[-1] if stages else "process start"
            result["error"] = (f"timed out after {timeout:.0f} s" if timed_out
                               else f"the process exited {self.proc.returncode} without a "
                                    "result")
        lines = stderr.strip().splitlines() or [
            x for x in stdout.strip().splitlines() if not x.startswith(("RESULT ", "KVMEM_"))]
        result["stderr_tail"] = [x[:400] for x in lines[-STDERR_LINES:]]
        result["output"] = stdout + stderr
        return result


def failure(role: str, r: dict[str, Any], report: common.Report) -> tuple[bool, str]:
    report.figure(f"{role}_failure", {k: r.get(k) for k in
                                      ("stage", "error", "traceback", "stderr_tail")})
    return False, (f"stopped at {r.get('stage')}: {r.get('error')} (stderr tail in "
                   f"figures.{role}_failure)")


def tokens_of(r: dict[str, Any]) -> dict[str, list[int]]:
    found = {f"ref{i}": x["tokens"] for i, x in enumerate(r["reference"])}
    found.update({k: v["tokens"] for k, v in r["sequence"].items()})
    return found


def compare(r: dict[str, Any], plain: dict[str, Any]) -> tuple[bool, str]:
    got, want = tokens_of(r), tokens_of(plain)
    bad = [k for k in want if got.get(k) != want[k]]
    if not bad:
        return True, f"greedy tokens of all {len(want)} requests equal plain vLLM's"
    k = bad[0]
    first = next((i for i, (a, b) in enumerate(zip(got[k], want[k], strict=False)) if a != b),
                 min(len(got[k]), len(want[k])))
    return False, (f"{len(bad)} of {len(want)} requests differ from plain vLLM (first: {k} "
                   f"at token {first}: {got[k][first:first + 4]} vs {want[k][first:first + 4]})")


def kv_tokens(output: str) -> int | None:
    m = KV_SIZE_LINE.findall(output)
    return int(m[-1].replace(",", "")) if m else None


def make_model(work: Path) -> str:
    try:
        from tiny_models import make_tiny_checkpoint

        return str(make_tiny_checkpoint(work, "llama", hidden_size=256, intermediate_size=512,
                                        num_attention_heads=4, num_key_value_heads=KV_HEADS,
                                        num_hidden_layers=LAYERS, max_position_embeddings=1024))
    except Exception:  # noqa: BLE001 - no transformers here: vLLM's dummy weights instead
        return common.tiny_llama(work)


def settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Prompts and a KV pool (in blocks of the device's size) where one A fits with B
    beside most of it, so that the tier or the reset is what brings A back."""
    cuda = args.device.startswith("cuda")
    block = 16 if cuda else 128
    max_tokens = 8 if args.quick else 16
    a_len = 320 if cuda else 384
    blocks = -(-(a_len + max_tokens) // block)
    pool = blocks + blocks // 2 + 2  # + the null block
    rng = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 250) for _ in range(n)]

    lengths = (20, 60, 130, 250)
    return {"model": model, "device": args.device, "max_model_len": 512, "block_size": block,
            "kv_bytes": pool * block * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4,
            "max_tokens": max_tokens,
            "prompts": {"reference": [prompt(n) for n in lengths], "A": prompt(a_len),
                        "B": prompt(a_len), "C": prompt(block // 2 - C_TOKENS)}}


def main() -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("--cfg", help=argparse.SUPPRESS)

    args = common.parse_args(__doc__, 150.0, extra)
    if args.child:
        return child(args)
    report = common.Report(NAME, f"vLLM {VLLM}'s Python code with kvmem inside", args)
    cuda = args.device.startswith("cuda")
    if cuda and not TARBALL.is_file():
        report.check("overlay", lambda: (None, "overlay absent: .vllmgpu/ was not carried "
                                               "(scripts/vllm-gpu-overlay.sh builds it)"))
        report.write()
        return 0
    work = Path(tempfile.gettempdir()) / f"kvmem-vllm-on-device-{os.getuid()}"
    work.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict[str, Any]] = {}

    if cuda:
        if not report.check("overlay unpacked", lambda: unpack_overlay(work, report),
                            needs_s=10):
            return report.write()
        report.notes.append(
            f"vLLM {VLLM}'s released Python code (no compiled extensions) over the device's "
            "torch; Triton attention, torch-native custom ops and IR ops, eager, V1 model "
            "runner; vllm._C_stable_libtorch stood in for by torch versions of "
            + ", ".join(STAND_IN_OPS) + ".")
        report.notes += [f"Expected to stop at: {x}" for x in EXPECTED_STOPS]
    else:
        report.notes.append("vLLM's CPU build (the tests' 0.32 venv), started as the tests "
                            "start it: the check logic, not the GPU path.")
    model = make_model(work)
    cfg = settings(args, model)
    report.figure("setup", {k: cfg[k] for k in ("max_model_len", "block_size", "kv_bytes",
                                                  "max_tokens")})
    report.notes.append(f"Model: the tests' tiny Llama ({LAYERS} layers, 4 heads and "
                        f"{KV_HEADS} KV heads of {HEAD_DIM}, fp32, random weights); KV "
                        f"{cfg['kv_bytes']:,} bytes, blocks of {cfg['block_size']}; greedy "
                        f"{cfg['max_tokens']} tokens: 4 prompts together, then A, B, C, "
                        "reset_prefix_cache, A.")

    started: dict[str, Engine] = {}

    def start(role: str) -> None:
        started[role] = Engine(args, {**cfg, "role": role}, work)

    def run(role: str, reserve_s: float) -> dict[str, Any]:
        """The engine's result: started now unless already running, given the budget left
        less ``reserve_s`` (what the checks after it need)."""
        if role not in started:
            start(role)
        r = found[role] = started.pop(role).finish(report.left_s() - reserve_s)
        return r

    def check_probe() -> tuple[bool | None, str]:
        r = run("probe", 110)
        report.figure("as_released", {k: r.get(k) for k in ("stopped_at", "error", "done",
                                                            "traceback")})
        if r.get("error") and "stopped_at" not in r:
            return None, f"the probe process ended: {r['error']}"
        if r.get("stopped_at") is None:
            return None, "imports as released, without the compiled extensions"
        return None, f"stops at {r['stopped_at']}: {r['error']}"

    def check_plain() -> tuple[bool, str]:
        r = run("plain", 45)
        if r.get("stage") != "done":
            return failure("plain", r, report)
        report.figure("plain", {"vllm": r.get("vllm"), "torch": r.get("torch"),
                                "start_s": r.get("start_s"), "generate_s": r.get("generate_s"),
                                "kv_cache_tokens": kv_tokens(r["output"]),
                                "reset": r["reset"], "stand_in_calls": r.get("stand_in_calls"),
                                "A_again_cached": r["sequence"]["A again"]["cached"]})
        return True, (f"vLLM {r.get('vllm')} on torch {r.get('torch')}: started in "
                      f"{r.get('start_s')} s, {len(tokens_of(r))} requests generated; KV "
                      f"cache {kv_tokens(r['output'])} tokens; stand-in op calls "
                      f"{r.get('stand_in_calls')}")

    def check_plugin() -> tuple[bool, str]:
        r = run("plugin", 0 if cuda else 30)
        if r.get("stage") != "done":
            return failure("plugin", r, report)
        ok, why = compare(r, found["plain"])
        lines = PLUGIN_LINE.findall(r["output"])
        logged, plain_logged = kv_tokens(r["output"]), kv_tokens(found["plain"]["output"])
        report.figure("plugin", {"rank_lines": lines, "kv_cache_tokens": logged})
        if not lines:
            return False, why + "; no kvmem rank line in vLLM's log"
        _, budget, blocks, tokens = (int(x) for x in lines[0])
        sized = tokens == logged == plain_logged and budget <= cfg["kv_bytes"]
        return ok and sized, (f"{why}; plugin: KV budget {budget:,} bytes, {blocks} blocks, "
                              f"{tokens} tokens; vLLM logs {logged} tokens (plain vLLM "
                              f"{plain_logged})")

    def check_connector() -> tuple[bool, str]:
        r = run("connector", 0 if cuda else 15)
        if r.get("stage") != "done":
            return failure("connector", r, report)
        ok, why = compare(r, found["plain"])
        mine = r["sequence"]["A again"]["cached"]
        theirs = found["plain"]["sequence"]["A again"]["cached"]
        report.figure("connector", {"A_again_cached": mine, "plain_A_again_cached": theirs,
                                    "reset": r["reset"]})
        reloaded = mine > theirs
        where = ("after a reset that emptied vLLM's prefix cache, so from the CPU tier"
                 if r["reset"] else "reset_prefix_cache refused (blocks held); B evicted "
                                    "most of A")
        return ok and reloaded, (f"{why}; A again: {mine} prompt tokens cached against plain "
                                 f"vLLM's {theirs} ({where})")

    def check_elastic() -> tuple[bool, str]:
        r = run("elastic", 0)
        if r.get("stage") != "done":
            return failure("elastic", r, report)
        ok, why = compare(r, found["plain"])
        reserved = re.findall(r"elastic KV memory: engine [^\n]*", r["output"])
        report.figure("elastic", {"log": reserved[:2]})
        return ok and bool(reserved), why + ("; " + reserved[0][:160] if reserved else
                                             "; no elastic KV memory line in vLLM's log")

    if cuda:
        report.check("vLLM as released (no compiled code)", check_probe, needs_s=10)
    if not report.check("plain vLLM", check_plain, needs_s=25):
        report.notes.append("Plain vLLM did not serve: the plugin, connector and elastic "
                            "checks were not run.")
        return report.write()
    if cuda:  # the three engines at once: each states its KV size, none profiles memory
        for role in ("plugin", "connector", "elastic"):
            start(role)
    report.check("plugin: proportional KV budget", check_plugin, needs_s=15)
    report.check("KvmemConnector: CPU tier reload", check_connector, needs_s=15)
    report.check("elastic KV memory", check_elastic, needs_s=15)
    for engine in started.values():  # a check not run leaves its engine: end it
        engine.finish(0)
    return report.write()


if __name__ == "__main__":
    raise SystemExit(main())
