"""Sampler and SamplingParams: greedy, temperature, top-k, top-p, seeds, validation."""

from __future__ import annotations

import pytest
import torch

from kvmem.engine.errors import InvalidRequestError
from kvmem.engine.sampler import Sampler, filter_top_k_top_p
from kvmem.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

LOGITS = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]))


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> list[int]:
    sampler = Sampler(seed)
    return [sampler(LOGITS, [params], [None]).token_ids[0] for _ in range(n)]


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    greedy = SamplingParams(temperature=0)
    assert Sampler()(logits, [greedy, greedy], [None, None]).token_ids == [1, 0]


def test_top_k_keeps_only_k_most_likely():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_k=1))) == {1}


def test_top_p_keeps_smallest_prefix_reaching_p():
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5))) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.75))) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.9))) == {1, 2, 3}
    sorted_logits, ids = filter_top_k_top_p(LOGITS[0].clone(), top_k=-1, top_p=0.75)
    assert ids.tolist()[:2] == [1, 2] and torch.isinf(sorted_logits[2:]).all()


def test_temperature_follows_distribution_and_sharpens():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0), n=4000)),
                            minlength=4) / 4000
    assert torch.allclose(counts, LOGITS.exp()[0], atol=0.04)
    cold = draws(SamplingParams(temperature=0.1), n=400)
    assert cold.count(1) > 390  # 0.5 vs 0.3 at T=0.1: about 166x more likely


def test_a_batch_of_temperature_only_rows_is_drawn_at_once(monkeypatch):
    """Rows that only scale by a temperature are drawn together (exponential race), each
    from its own temperature's distribution; the row-at-a-time path is not taken."""
    def one_row(*args, **kwargs):
        raise AssertionError("a temperature-only row went through the row-at-a-time path")

    monkeypatch.setattr(Sampler, "_sample_row", one_row)
    n = 4000
    logits = LOGITS.expand(2 * n, 4)
    params = [SamplingParams(temperature=1.0)] * n + [SamplingParams(temperature=0.5)] * n
    tokens = torch.tensor(Sampler(0)(logits, params, [None] * (2 * n)).token_ids)
    for rows, temperature in ((tokens[:n], 1.0), (tokens[n:], 0.5)):
        expected = (LOGITS[0] / temperature).softmax(-1)
        assert torch.allclose(torch.bincount(rows, minlength=4) / n, expected, atol=0.03)


def test_per_request_generator_is_independent_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    g = gen()
    alone = [Sampler(1)(logits[1:2], [params], [g]).token_ids[0] for _ in range(5)]
    g = gen()
    hot = SamplingParams(temperature=1.0)
    batched = [Sampler(2)(logits, [hot, params, hot], [None, g, None]).token_ids[1]
               for _ in range(5)]
    assert batched == alone


def test_shared_generator_follows_engine_seed():
    a = draws(SamplingParams(temperature=1.0), n=30, seed=3)
    assert a == draws(SamplingParams(temperature=1.0), n=30, seed=3)
    assert a != draws(SamplingParams(temperature=1.0), n=30, seed=4)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -3), ("max_tokens", 0), ("max_tokens", 2.5), ("seed", "x"), ("stop", [""]),
    ("stop_token_ids", [-1]), ("temperature", True), ("seed", 2**64), ("seed", -2**63 - 1),
])
def test_bad_values_raise_with_the_parameter_named(field, value):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_seed_range_is_what_torch_generators_accept():
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    for seed in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises((ValueError, RuntimeError)):
            torch.Generator().manual_seed(seed)


def test_stop_accepts_one_string_and_greedy_flag():
    params = SamplingParams(stop="###", temperature=0.0)
    assert params.stop == ["###"] and params.greedy
    assert not SamplingParams(temperature=0.7).greedy


# -- logits processors against transformers' on the same logits ----------------------------
VOCAB = 50


def random_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    from kvmem.engine.sampler import apply_penalties

    prompt, output = [3, 7, 7, 20], [7, 41, 3]
    logits = random_logits()
    for penalty in (1.3, 0.7):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([prompt + output]), logits.clone()[None])[0]
        got = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=penalty),
                              prompt, output)
        assert torch.allclose(got, expected)
        assert not torch.equal(got, logits)


def test_logit_bias_matches_transformers_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor

    from kvmem.engine.sampler import apply_logit_bias

    bias = {4: 5.5, 9: -100.0, 30: 0.25}
    logits = random_logits(1)
    expected = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(
        torch.tensor([[1, 2]]), logits.clone()[None])[0]
    got = apply_logit_bias(logits.clone(), bias)
    assert torch.allclose(got, expected)


def test_presence_and_frequency_penalties_follow_openai_definition():
    from kvmem.engine.sampler import apply_penalties

    prompt, output = [5, 6], [6, 8, 8, 8, 11]
    logits = random_logits(2)
    got = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5,
                                                         frequency_penalty=0.3), prompt, output)
    expected = logits.clone()
    for token in set(output):  # mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        expected[token] -= output.count(token) * 0.3 + 0.5
    assert torch.allclose(got, expected)
    assert got[5] == logits[5]  # prompt tokens are not penalised


def test_min_p_matches_transformers_after_temperature():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    from kvmem.engine.sampler import apply_min_p

    logits = random_logits(3)
    for min_p, temperature in ((0.1, 1.0), (0.05, 0.7), (0.5, 1.5)):
        scaled = TemperatureLogitsWarper(temperature)(None, logits.clone()[None])
        expected = MinPLogitsWarper(min_p)(None, scaled)[0]
        got = apply_min_p(logits.clone() / temperature, min_p)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_sampler_draws_only_min_p_survivors():
    allowed = {1, 2}  # probs .5 and .3 reach 0.5 x .5; .15 and .05 do not
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.5))) == allowed


def test_penalties_change_greedy_choice_and_leave_logits_alone():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    before = logits.clone()
    greedy = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert Sampler()(logits, [greedy], [None], [([0], [1])]).token_ids == [2]
    assert Sampler()(logits, [SamplingParams(temperature=0, logit_bias={3: 5})], [None],
                     [([0], [])]).token_ids == [3]
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="histories"):
        Sampler()(logits, [greedy], [None])


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("min_p", 1.5), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("logprobs", 21),
    ("prompt_logprobs", -1), ("logprobs", True)])
def test_new_fields_are_validated(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_extreme_penalty_and_temperature_still_sample():
    """A repetition penalty of 1e-200 or a temperature just above greedy overflows the
    logits to inf; the sampler must still draw a token (the most likely survivor)."""
    logits = torch.tensor([[50.0, 3.0e37, 2.9e37, -1.0]])
    for params in (SamplingParams(temperature=1.0, repetition_penalty=1e-200, seed=0),
                   SamplingParams(temperature=2e-5, seed=0)):
        token = Sampler()(logits, [params], [None], [([1, 2], [])]).token_ids[0]
        assert token in (1, 2)
