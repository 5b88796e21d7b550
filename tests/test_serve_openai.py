"""The OpenAI fields beyond plain generation, through the official ``openai`` client against
the app in process: logprobs (completions and chat, streaming and not), echo with prompt
logprobs as evaluation harnesses ask for them, penalties, min_p and logit_bias."""

from __future__ import annotations

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from tiny_models import make_tiny_checkpoint

MODEL = "tiny"
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve_openai"), "llama")


@pytest.fixture(scope="module")
def http(model_dir):
    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), served_model_name=MODEL, max_model_len=128,
        kv_cache_memory_bytes=4 << 20)))
    with TestClient(create_app(engine)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                         max_retries=0)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs




GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


def test_completion_logprobs_match_transformers(client, hf_logprobs):
    prompt = [(i * 7) % 250 for i in range(30)]
    out = client.completions.create(prompt=prompt, max_tokens=5, logprobs=3, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    reference = hf_logprobs(prompt)  # the first generated token's distribution
    first = reference[-1]
    assert abs(lp.token_logprobs[0] - first.max().item()) < TOL  # greedy: the top token
    assert len(lp.top_logprobs[0]) in (3, 4)
    assert max(lp.top_logprobs[0].values()) == pytest.approx(first.max().item(), abs=TOL)
    assert sorted(lp.top_logprobs[0].values(), reverse=True)[:3] == pytest.approx(
        first.topk(3).values.tolist(), abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_echo_scores_the_prompt_like_lm_eval(client, hf_logprobs):
    """lm-eval's local-completions: token-id prompts, echo, logprobs 1, max_tokens 1 (or 0)."""
    prompts = [[(i * 5 + j) % 250 for i in range(20 + 3 * j)] for j in range(3)]
    for max_tokens in (1, 0):
        out = client.completions.create(prompt=prompts, max_tokens=max_tokens, logprobs=1,
                                        echo=True, model=MODEL, temperature=0, extra_body={
                                            "return_tokens_as_token_ids": True})
        for prompt, choice in zip(prompts, out.choices, strict=True):
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(prompt) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            reference = hf_logprobs(prompt)
            expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            assert lp.token_logprobs[1:len(prompt)] == pytest.approx(expected.tolist(), abs=TOL)
            assert lp.tokens[:len(prompt)] == [f"token_id:{t}" for t in prompt]
            for p, top in enumerate(lp.top_logprobs[1:len(prompt)]):
                best = int(reference[p].argmax())
                assert len(top) in (1, 2) and f"token_id:{prompt[p + 1]}" in top
                assert top[f"token_id:{best}"] == pytest.approx(reference[p, best].item(),
                                                                abs=TOL)
        if max_tokens == 0:
            assert out.usage.completion_tokens == 0
            assert all(c.finish_reason == "length" for c in out.choices)


def test_echo_text_and_streamed_logprobs(client):
    kw = dict(prompt="Hello", max_tokens=6, logprobs=2, echo=True, **GREEDY)
    full = client.completions.create(**kw).choices[0]
    assert full.text.startswith("Hello")
    chunks = list(client.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == full.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices[0].logprobs
               for v in c.choices[0].logprobs.text_offset]
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(full.logprobs.token_logprobs[1:])


def test_chat_logprobs_streaming_and_not(client):
    kw = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True,
              top_logprobs=2, **GREEDY)
    full = client.chat.completions.create(**kw).choices[0]
    content = full.logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content])
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_logprobs_bad_values_are_400(http):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for extra, param in (({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                         ({"max_tokens": 0}, "max_tokens")):
        response = http.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    response = http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    response = http.post("/v1/chat/completions", json={**chat, "logprobs": True,
                                                       "top_logprobs": 30})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def generated_ids(client, prompt: str, **extra) -> list[int]:
    """The generated token ids (logprob tokens as token_id:N), greedy unless ``extra`` says."""
    kw = {"model": MODEL, "temperature": 0, "max_tokens": 12, "logprobs": 0, **extra}
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    tokens = client.completions.create(prompt=prompt, extra_body=body, **kw) \
        .choices[0].logprobs.tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_penalties_min_p_and_logit_bias(client, http):
    prompt = "abc"
    echo = client.completions.create(prompt=prompt, max_tokens=1, logprobs=0, echo=True,
                                     model=MODEL, extra_body={"return_tokens_as_token_ids": True})
    prompt_ids = [int(t.removeprefix("token_id:")) for t in echo.choices[0].logprobs.tokens[:3]]
    plain = generated_ids(client, prompt)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    # a strong repetition penalty: greedy output avoids every token seen so far
    varied = generated_ids(client, prompt, extra_body={"repetition_penalty": 50.0})
    assert len(set(varied)) == len(varied) and not set(varied) & set(prompt_ids)
    # frequency/presence penalties count generated tokens only
    spread = generated_ids(client, prompt, frequency_penalty=2.0, presence_penalty=2.0)
    assert spread != plain and len(set(spread)) > len(set(plain))
    assert generated_ids(client, prompt, max_tokens=4, logit_bias={"120": 100}) == [120] * 4
    banned = {str(t): -100 for t in set(plain)}
    assert not set(generated_ids(client, prompt, logit_bias=banned)) & set(plain)
    # min_p = 1 keeps only the most likely token: sampling becomes greedy
    sampled = generated_ids(client, prompt, temperature=1.0, seed=1,
                            extra_body={"min_p": 1.0})
    assert sampled == plain
    assert generated_ids(client, prompt, temperature=1.0, seed=1) != plain
    # keys are token ids in decimal digits; int() would also read these three as 12, 10, 12
    for extra, param in (({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": {" 12": 1}}, "logit_bias"),
                         ({"logit_bias": {"1_0": 1}}, "logit_bias"),
                         ({"logit_bias": {"\uff11\uff12": 1}}, "logit_bias"),
                         ({"logit_bias": {"-1": 1}}, "logit_bias"),
                         ({"logit_bias": {"100000": 1}}, "logit_bias"),
                         ({"presence_penalty": 3}, "presence_penalty"),
                         ({"min_p": 2}, "min_p"),
                         ({"repetition_penalty": 0}, "repetition_penalty")):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
        assert response.status_code == 400, extra
        assert response.json()["error"]["param"] == param


def test_tokenize_detokenize_and_version(http, model_dir):
    from kvmem.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    out = http.post("/tokenize", json={"model": MODEL, "prompt": "héllo",
                                       "return_token_strs": True}).json()
    assert out["tokens"] == tok.encode("héllo") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 128 and len(out["token_strs"]) == out["count"]
    assert out["token_strs"] == [tok.id_to_token(t) for t in out["tokens"]]
    plain = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("hi", add_special_tokens=False)
    assert plain["token_strs"] is None
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {"prompt": text}
    assert http.get("/version").json()["version"]
    response = http.post("/tokenize", json={"model": "other", "prompt": "hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = http.post("/detokenize", json={"tokens": [10**6]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens.0"
    assert http.post("/tokenize", json={"model": MODEL}).status_code == 400
    # both: refused rather than silently tokenizing the messages
    response = http.post("/tokenize", json={"prompt": "hi", "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "not both" in error["message"]


def scrape(http) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# The vLLM series a vLLM Grafana dashboard reads, and how docs/serving.md renames kvmem's
VLLM_SERIES = [
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_inference_time_seconds_sum", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_time_per_output_token_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:request_success_total"]


def vllm_name(series: str) -> str:
    """The relabelling rules of docs/serving.md, in order (each regex matches whole names)."""
    import re

    renames = {"kvmem_preemptions_total": "vllm:num_preemptions_total",
               "kvmem_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
               "kvmem_requests_finished_total": "vllm:request_success_total"}
    name = series.split("{")[0]
    if name in renames:
        return renames[name]
    return re.sub(r"^kvmem_(.*)$", r"vllm:\1", name)


def test_latency_histograms_and_vllm_names(http, client):
    label = f'{{model_name="{MODEL}"}}'
    before = scrape(http)
    for n in (3, 5):
        client.completions.create(prompt="timing", max_tokens=n, **GREEDY)
    after = scrape(http)

    def delta(name: str) -> float:
        return after[f"kvmem_{name}{label}"] - before.get(f"kvmem_{name}{label}", 0.0)

    assert delta("time_to_first_token_seconds_count") == 2
    assert delta("inter_token_latency_seconds_count") == 2 + 4
    assert delta("request_time_per_output_token_seconds_count") == 2
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert delta(f"{name}_count") == 2, name
    assert delta("request_generation_tokens_sum") == 8
    assert delta("request_prompt_tokens_sum") == 2 * len("timing")
    assert 0 < delta("time_to_first_token_seconds_sum") <= delta("e2e_request_latency_seconds_sum")
    assert delta("request_prefill_time_seconds_sum") + delta("request_decode_time_seconds_sum") \
        == pytest.approx(delta("request_inference_time_seconds_sum"))
    inf = f'kvmem_e2e_request_latency_seconds_bucket{{le="+Inf",model_name="{MODEL}"}}'
    assert after[inf] == after[f"kvmem_e2e_request_latency_seconds_count{label}"]
    renamed = {vllm_name(series) for series in after}
    for series in VLLM_SERIES:
        assert series in renamed, series


def test_openapi_declares_responses_errors_and_media_types(http):
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) >= {"200", "400", "401", "404", "413", "503"}
        ok = responses["200"]["content"]
        assert ok["application/json"]["schema"] != {} and "text/event-stream" in ok
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
    assert paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"][
        "schema"]["$ref"].endswith("/ModelList")
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for path in ("/tokenize", "/detokenize"):
        assert "400" in paths[path]["post"]["responses"]
    schemas = spec["components"]["schemas"]
    assert {"CompletionResponse", "ChatCompletionResponse", "CompletionLogprobs",
            "ChatLogprobs", "TokenizeResponse", "ErrorResponse"} <= set(schemas)


def test_wrong_method_is_405_with_allow(http):
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"]


def test_n_samples_streaming_and_not(client, http):
    kw = dict(model=MODEL, temperature=1.0, seed=9, max_tokens=5,
              extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=["one", "two"], n=3, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == 6 * 5 and out.usage.prompt_tokens == 6
    texts = [c.text for c in out.choices]
    assert len(set(texts[:3])) > 1  # distinct seeds per sample
    again = client.completions.create(prompt=["one", "two"], n=3, **kw)
    assert [c.text for c in again.choices] == texts  # reproducible
    streamed: dict[int, str] = {}
    finishes = {}
    for chunk in client.completions.create(prompt="one", n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts[:3]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    chat_kw = dict(messages=[{"role": "user", "content": "Hi"}], n=2, logprobs=True, **kw)
    chat = client.chat.completions.create(**chat_kw)
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(len(c.logprobs.content) == 5 for c in chat.choices)
    chunks = list(client.chat.completions.create(stream=True, **chat_kw))
    content = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
    assert [content[0], content[1]] == [c.message.content for c in chat.choices]
    best = client.completions.create(prompt="one", n=2, best_of=4, logprobs=0, **kw)
    assert len(best.choices) == 2
    sums = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert sums == sorted(sums, reverse=True)
    for body, param in (({"n": 0}, "n"), ({"n": 1000}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
                        ({"best_of": 3, "stream": True}, "best_of")):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_min_tokens_and_the_fields_clients_send(client, http):
    """vLLM's ``min_tokens`` (``extra_body``, as the openai client sends it) holds back EOS
    (here made the greedy choice by a logit bias, 258): it used to answer 200 and do
    nothing. A field kvmem does not serve is a 400 naming it, not ignored; OpenAI's
    bookkeeping fields pass."""
    eos_first = dict(model=MODEL, temperature=0, max_tokens=8, logit_bias={"258": 100})
    assert client.completions.create(prompt=[5, 6, 7], **eos_first).usage.completion_tokens == 1
    out = client.completions.create(prompt=[5, 6, 7], **eos_first, extra_body={"min_tokens": 5})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], **eos_first, user="u1", store=False,
        metadata={"team": "a"}, service_tier="auto", extra_body={"min_tokens": 3})
    assert chat.usage.completion_tokens == 4
    for route, body in (("completions", {"prompt": "hi"}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for field, value in (("response_format", {"type": "json_object"}),
                             ("tools", []), ("max_token", 4), ("min_tokenz", 2)):
            response = http.post(f"/v1/{route}", json={"model": MODEL, **body, field: value})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == field, (route, field)
            assert error["message"] == (f"{field}: not a field kvmem serves (the fields are "
                                        "in /openapi.json)")
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                  "max_tokens": 2, "min_tokens": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens"
