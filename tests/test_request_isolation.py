"""One request's failure is that request's alone (issue: a top_p of 1e-46 failed every
running request).

Each stage of a step that works on one request's data (its logit bias, penalties,
sampling, logprobs, stop strings, detokenizing, its n > 1 fork, its tier load) gets a
fault that fires only for a request carrying that stage's marker, a valid but unusual
parameter. While several streams run, one marked request per stage is sent: each fails
alone with a 500 naming its stage, every stream ends with exactly the tokens it has when
nothing else runs, and ``/metrics`` counts one failed request per stage. The sampling
fault is the original one: the row's probabilities become NaN and ``torch.multinomial``
itself raises.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from tiny_models import make_tiny_checkpoint

from kvmem.engine.errors import FAILURE_STAGES
from kvmem.engine.sampling_params import SamplingParams

MODEL = "tiny"
MARK = 0.0123  # the marker value of the float parameters
# stage -> the body fields of a request whose stage fails (each valid on its own)
BAD = {
    "sampling": {"temperature": 0.7, "min_p": MARK},
    "logit_bias": {"temperature": 0, "logit_bias": {"7": MARK}},
    "penalties": {"temperature": 0, "presence_penalty": MARK},
    "logprobs": {"temperature": 0, "logprobs": 7},
    "stop": {"temperature": 0, "stop": ["<never seen>"]},
    "detokenize": {"temperature": 0, "prompt": [300, 301, 302, 303]},
    "fork": {"temperature": 0.7, "n": 2, "seed": 4321},
    "tier_load": {"temperature": 0, "seed": 5432},
}
# Greedy and seeded streams whose tokens must not change (token ids come back as
# "token_id:N" logprob tokens).
STREAMS = [
    {"prompt": "the first stream", "temperature": 0},
    {"prompt": "a second, seeded one", "temperature": 0.8, "seed": 11},
    {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], "temperature": 0},
]
STREAM_TOKENS = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("isolation"), "llama",
                                max_position_embeddings=1024)


def inject_faults(monkeypatch, engine) -> None:
    """A fault in each stage, firing only for the request that carries its marker."""
    from kvmem.engine import model_runner, sampler
    from kvmem.engine.output_processor import OutputProcessor
    from kvmem.engine.sample_groups import SampleGroup
    from kvmem.tiers.connector import OffloadConnector

    def when(marked, original, error="injected fault"):
        def wrapper(*args, **kwargs):
            if marked(*args, **kwargs):
                raise RuntimeError(error)
            return original(*args, **kwargs)
        return wrapper

    min_p = sampler.apply_min_p
    monkeypatch.setattr(sampler, "apply_min_p", lambda row, p: row.fill_(float("nan"))
                        if p == MARK else min_p(row, p))  # multinomial raises on NaN
    monkeypatch.setattr(sampler, "apply_logit_bias", when(
        lambda row, bias: MARK in bias.values(), sampler.apply_logit_bias))
    monkeypatch.setattr(sampler, "apply_penalties", when(
        lambda row, params, *_: params.presence_penalty == MARK, sampler.apply_penalties))
    monkeypatch.setattr(model_runner, "position_logprobs", when(
        lambda logits, ids, num_top: 7 in num_top, model_runner.position_logprobs))
    monkeypatch.setattr(OutputProcessor, "_check_stop_strings", when(
        lambda self, request, n: "<never seen>" in request.sampling_params.stop,
        OutputProcessor._check_stop_strings))
    monkeypatch.setattr(SampleGroup, "make_children", when(
        lambda self: self.parent.sampling_params.seed == 4321, SampleGroup.make_children))
    monkeypatch.setattr(OffloadConnector, "start_load", when(
        lambda self, request, hit: request.sampling_params.seed == 5432,
        OffloadConnector.start_load))
    tokenizer = engine.tokenizer
    detokenizer = tokenizer.detokenizer

    def marked_detokenizer(prompt_ids=None, **kwargs):
        state = detokenizer(prompt_ids, **kwargs)
        if prompt_ids and prompt_ids[0] == 300:
            state.step = when(lambda token: True, state.step)
        return state

    monkeypatch.setattr(tokenizer, "detokenizer", marked_detokenizer)
    step = type(engine).step

    def slow_step(self):  # streams long enough to overlap every failing request
        time.sleep(0.002)
        return step(self)

    monkeypatch.setattr(type(engine), "step", slow_step)


@pytest.fixture(scope="module")
def served(model_dir):
    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    engine = LLMEngine(EngineConfig(model=str(model_dir), served_model_name=MODEL,
                                    max_model_len=512, kv_cache_memory_bytes=8 << 20,
                                    cpu_offload_gib=0.01))
    with pytest.MonkeyPatch.context() as monkeypatch:
        inject_faults(monkeypatch, engine)
        with TestClient(create_app(AsyncLLMEngine(engine))) as client:
            yield client


def stream(http: TestClient, body: dict) -> tuple[list[int], str | None, float]:
    """A streamed completion's token ids, finish reason and the time its last event came."""
    body = {"model": MODEL, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **body}
    tokens, finish = [], None
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            tokens += [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            finish = choice["finish_reason"] or finish
    return tokens, finish, time.monotonic()


def run_streams(http: TestClient, during=None) -> list[tuple[list[int], str | None, float]]:
    """Every stream at once; ``during()`` runs once each has its first tokens."""
    results: list = [None] * len(STREAMS)

    def one(i: int) -> None:
        results[i] = stream(http, STREAMS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    if during is not None:
        time.sleep(0.3)  # the streams are under way
        during()
    for t in threads:
        t.join(120)
    return results


def failed_counts(http: TestClient) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'kvmem_requests_failed_total\{model_name="tiny",stage="(\w+)"\} ([\d.]+)', text)}


def test_each_failing_request_fails_alone_while_streams_run(served):
    reference = run_streams(served)
    for tokens, finish, _ in reference:
        assert len(tokens) == STREAM_TOKENS and finish == "length"
    answers: dict[str, tuple[int, dict, float]] = {}

    def send(stage: str) -> None:
        body = {"model": MODEL, "prompt": f"request for {stage}", "max_tokens": 4, **BAD[stage]}
        response = served.post("/v1/completions", json=body)
        answers[stage] = (response.status_code, response.json(), time.monotonic())

    def send_all() -> None:
        senders = [threading.Thread(target=send, args=(s,)) for s in BAD]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)

    disturbed = run_streams(served, during=send_all)
    assert set(answers) == set(BAD)
    for stage, (status, body, _) in answers.items():
        assert status == 500, (stage, body)
        error = body["error"]
        assert error["code"] == "request_failed" and error["type"] == "server_error"
        assert error["message"].startswith(f"the request failed in {stage}: ")
        assert "\n" not in error["message"]
    # the streams were still running when the last failing request had its answer
    last_failure = max(at for _, _, at in answers.values())
    assert all(finished_at > last_failure for _, _, finished_at in disturbed)
    for (tokens, finish, _), (ref_tokens, _, _) in zip(disturbed, reference, strict=True):
        assert finish == "length" and tokens == ref_tokens
    counts = failed_counts(served)
    assert set(counts) == set(FAILURE_STAGES)
    assert {s: c for s, c in counts.items() if c} == {s: 1.0 for s in BAD}
    assert served.post("/v1/completions", json={"model": MODEL, "prompt": "still serving",
                                                "max_tokens": 2}).status_code == 200


def test_a_failing_stream_ends_with_its_error_event_and_done(served):
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 4, "stream": True,
            **BAD["penalties"]}
    with served.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_failed" and "penalties" in error["message"]


@pytest.mark.parametrize("top_p", [1e-46, 1e-320])
def test_top_p_that_is_zero_as_a_float32_is_a_400(served, top_p):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "top_p": top_p}
    response = served.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "top_p"


def test_a_top_p_too_large_for_a_float32_is_refused_like_any_other():
    from kvmem.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="top_p must be a number in"):
        SamplingParams(top_p=10**400)  # once a struct.error from the float32 conversion


def test_the_sampler_keeps_the_most_likely_token_whatever_top_p_rounds_to():
    """Past validation (a caller that builds SamplingParams and changes them), a top_p
    that is 0 in float32 keeps the most likely token instead of emptying the row."""
    from kvmem.engine.sampler import Sampler

    params = SamplingParams(temperature=1.0, top_p=0.5)
    params.top_p = 1e-46
    logits = torch.tensor([[0.1, 2.0, 0.3]])
    samples = Sampler()(logits, [params], [None])
    assert samples.token_ids == [1] and not samples.failures


def test_token_ids_the_model_does_not_have_are_refused_before_a_step(tmp_path):
    """A tokenizer larger than the model's vocabulary (here 200 embeddings for a 259-token
    tokenizer) turns text into ids the model's embedding cannot look up: a step with that
    request would fail for every request in it. Such a prompt is a 400, and so are more
    top logprobs than the vocabulary has, and stop token ids the model cannot produce."""
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.errors import InvalidRequestError
    from kvmem.engine.llm_engine import LLMEngine

    small = make_tiny_checkpoint(tmp_path, "llama", vocab_size=16, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=1)
    engine = LLMEngine(EngineConfig(model=str(small), max_model_len=64,
                                    kv_cache_memory_bytes=1 << 20))
    with pytest.raises(InvalidRequestError, match="beyond the model's vocabulary of 16") as e:
        engine.make_request("r1", "text", SamplingParams(max_tokens=2))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="at most the vocabulary size") as e:
        engine.make_request("r2", [3, 4, 5], SamplingParams(max_tokens=2, logprobs=17))
    assert e.value.param == "logprobs"
    with pytest.raises(InvalidRequestError, match="below the vocabulary size") as e:
        engine.make_request("r2", [3, 4, 5], SamplingParams(max_tokens=2, stop_token_ids=[16]))
    assert e.value.param == "stop_token_ids"
    engine.make_request("r2", [3, 4, 5], SamplingParams(max_tokens=2, stop_token_ids=[15]))
    engine.add_request("r3", [3, 4, 5], SamplingParams(max_tokens=2, logprobs=16))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert len(outputs[0].outputs[0].logprobs) == 2
