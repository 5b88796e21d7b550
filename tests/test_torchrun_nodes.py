"""``kvmem serve`` across two nodes under torchrun: the command docs/parallel.md gives
("Multi-node with torchrun"), run as two node agents on this machine (``--nnodes 2``, c10d
rendezvous, gloo), each agent starting one rank.

Per layout (tp 2, pp 2): greedy tokens over HTTP equal a one-process engine's on the same
tiny model; then a node is killed (its agent and its rank, SIGKILL) and the survivor must
stop within its stated bound with one line naming the lost rank: rank 0, idle, finds a
silent heartbeat within ``SILENCE_S``; rank 0, asked for a step, names the dead rank at
once; a worker whose rank 0 is gone finds its connection closed; rank 0, stopped by its
agent because the rendezvous lived on the dead node, names the dead rank too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from serve_process import LISTENING, free_port
from tiny_models import make_tiny_checkpoint

from kvmem.engine.distributed.heartbeat import HEARTBEAT_S, SILENCE_S
from kvmem.engine.llm import LLM
from kvmem.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 90))]
MAX_TOKENS = 8
START_S = 180  # two agents, a rendezvous and two model loads on two shared cores
SERVE = ["--port", "0", "--served-model-name", "m", "--kv-cache-memory-bytes", "4MiB",
         "--max-model-len", "256"]


def number_tokens(model_dir: Path) -> None:
    """Give every token id a word of its own (``t17``), so that a completion's text, all
    HTTP gives of a parallel engine's output, names its token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    special = {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>"}
    tokenizer = Tokenizer(models.WordLevel(
        vocab={special.get(i, f"t{i}"): i for i in range(size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(special.values()))
    tokenizer.save(str(model_dir / "tokenizer.json"))


def token_ids(text: str) -> list[int]:
    return [int(word.removeprefix("t")) for word in text.split()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("torchrun"), "llama", **TINY)
    number_tokens(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    llm = LLM(str(model_dir), kv_cache_memory_bytes="4MiB", max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = [out.outputs[0] for out in llm.generate(PROMPTS, params)]
    assert [token_ids(o.text) for o in outputs] == [list(o.token_ids) for o in outputs]
    return [list(o.token_ids) for o in outputs]


class Node:
    """One torchrun agent (its own session) and the kvmem rank it starts."""

    def __init__(self, index: int, model_dir: Path, log: Path, rdzv_port: int,
                 layout: list[str], rdzv_host: bool) -> None:
        self.index, self.log = index, log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", f"kvmem-{rdzv_port}",
               "--rdzv-conf", f"is_host={int(rdzv_host)}",
               # the rendezvous ranks nodes by (address, pid): an address each, as two
               # machines have, so that node 0 is rank 0 even where pids wrap around
               "--local-addr", f"127.0.0.{index + 1}",
               "-m", "kvmem", "serve", str(model_dir), *layout, *SERVE]
        with log.open("w") as out:
            self.agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                                          start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def rank(self) -> psutil.Process:
        """The kvmem process the agent started (torchrun gives it a session of its own)."""
        return psutil.Process(self.agent.pid).children()[0]

    def kill(self) -> None:
        """The node dies: its rank and its agent, at once."""
        with contextlib.suppress(psutil.Error, IndexError):
            self.rank().kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agent.pid, signal.SIGKILL)

    def processes(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            agent = psutil.Process(self.agent.pid)
            return [agent, *agent.children(recursive=True)]
        return []


class TwoNodes:
    """Two agents of one job; ``serving`` is the node whose rank 0 serves HTTP."""

    def __init__(self, model_dir: Path, tmp_path: Path, layout: list[str],
                 rdzv_host: int = 0) -> None:
        rdzv = free_port()
        self.nodes: list[Node] = []
        try:
            for index in (0, 1):  # node 0 first: the older agent, it gets rank 0
                self.nodes.append(Node(index, model_dir, tmp_path / f"node{index}.log", rdzv,
                                       layout, rdzv_host=index == rdzv_host))
                time.sleep(0.5)
            deadline = time.monotonic() + START_S
            self.serving, self.base = self._listening(deadline)
            self.other = self.nodes[1 - self.serving.index]
            self.rank0, self.rank1 = self.serving.rank(), self.other.rank()
            self._healthy(deadline)
        except BaseException:  # a job that never came up leaves nothing running
            self.close()
            raise

    def _healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.serving.agent.poll() is None:
            with contextlib.suppress(httpx.TransportError):  # bound, not yet accepting
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError("no /health 200:\n" + self.logs())

    def _listening(self, deadline: float) -> tuple[Node, str]:
        # c10d ignores --node-rank: the node that sorts first (here the older agent) has rank 0
        while time.monotonic() < deadline:
            for node in self.nodes:
                line = next((x for x in node.text().splitlines() if x.startswith(LISTENING)),
                            None)
                if line is not None:
                    return node, line.removeprefix(LISTENING).strip()
            if any(n.agent.poll() is not None for n in self.nodes):
                break
            time.sleep(0.2)
        raise AssertionError("rank 0 never listened:\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- node {n.index}\n{n.text()[-4000:]}" for n in self.nodes)

    def completions(self) -> list[list[int]]:
        """Greedy completions' token ids (read from the text: a parallel engine gives no
        logprobs)."""
        texts = []
        for prompt in PROMPTS:
            body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(f"{self.base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
            texts.append(token_ids(r.json()["choices"][0]["text"]))
        return texts

    def close(self) -> None:
        ranks = [getattr(self, name, None) for name in ("rank0", "rank1")]  # outlive agents
        procs = [p for n in self.nodes for p in n.processes()] + [r for r in ranks if r]
        for node in self.nodes:
            node.kill()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)


def ended_within(proc: psutil.Process, bound_s: float) -> float:
    """Seconds until ``proc`` ended; fails past ``bound_s``."""
    start = time.monotonic()
    try:
        proc.wait(timeout=bound_s)
    except psutil.TimeoutExpired:
        raise AssertionError(f"pid {proc.pid} still running after {bound_s:.0f} s") from None
    return time.monotonic() - start


def errors(node: Node) -> list[str]:
    """kvmem's error lines in a node's log."""
    return [x for x in node.text().splitlines() if x.startswith("kvmem: error: ")]


@pytest.fixture
def two_nodes(model_dir, tmp_path):
    started: list[TwoNodes] = []

    def start(*layout: str, rdzv_host: int = 0) -> TwoNodes:
        started.append(TwoNodes(model_dir, tmp_path, list(layout), rdzv_host))
        return started[-1]

    yield start
    for job in started:
        job.close()


def test_tp2_tokens_then_an_idle_rank0_finds_its_peer_node_gone(two_nodes, reference):
    job = two_nodes("-tp", "2")
    assert job.completions() == reference, job.logs()
    job.other.kill()
    # no request comes: only the heartbeat can tell
    took = ended_within(job.rank0, SILENCE_S + HEARTBEAT_S + 15)
    assert took >= SILENCE_S - 1, job.logs()  # not before the stated silence
    gone = errors(job.serving)
    assert len(gone) == 1, job.logs()
    assert gone[0].startswith("kvmem: error: rank 1 (pp stage 0, tp rank 1) on "), gone
    assert f"(pid {job.rank1.pid}) is gone: no heartbeat for " in gone[0], gone
    assert f"(exitcode: 2) local_rank: 0 (pid: {job.rank0.pid})" in job.serving.text()
    assert job.serving.agent.wait(timeout=30) != 0  # the node's agent ends with its rank


def test_pp2_tokens_then_a_worker_finds_rank0s_node_gone(two_nodes, reference):
    job = two_nodes("-pp", "2")
    assert job.completions() == reference, job.logs()
    job.serving.kill()
    ended_within(job.rank1, 5)  # its wait for the next step fails as the connection closes
    gone = errors(job.other)
    assert len(gone) == 1, job.logs()
    assert gone[0].startswith("kvmem: error: rank 1 (pp stage 1, tp rank 0): rank 0 at "), gone
    assert gone[0].endswith(" is gone (its connection closed while this rank waited for a "
                            "step); stopping"), gone
    assert job.other.agent.wait(timeout=30) != 0


def test_tp2_a_request_after_a_node_dies_is_refused_at_once(two_nodes):
    job = two_nodes("-tp", "2")
    job.other.kill()
    time.sleep(0.5)
    start = time.monotonic()
    r = httpx.post(f"{job.base}/v1/completions", timeout=30,
                   json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4})
    assert time.monotonic() - start < 10
    assert r.status_code == 503, r.text
    assert "rank 1 (pp stage 0, tp rank 1) on " in r.json()["error"]["message"], r.text
    ended_within(job.rank0, 15)
    gone = errors(job.serving)
    assert len(gone) == 1 and " is gone: no heartbeat for " in gone[0], job.logs()


def test_pp2_rank0_stopped_by_its_agent_names_the_lost_node(two_nodes):
    """The rendezvous lives on node 1, rank 0 on node 0: node 1 dies, node 0's agent loses
    the rendezvous and stops rank 0 (SIGTERM) within a second; rank 0 must not read that
    as a clean stop but name the rank whose heartbeat stopped."""
    job = two_nodes("-pp", "2", rdzv_host=1)
    assert job.serving is job.nodes[0], job.logs()  # the older agent got rank 0
    job.other.kill()
    ended_within(job.rank0, 15)
    gone = errors(job.serving)
    assert len(gone) == 1, job.logs()
    assert gone[0].startswith("kvmem: error: rank 1 (pp stage 1, tp rank 0) on "), gone
    assert " is gone: no heartbeat for " in gone[0], gone
