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
    return [sampler(LOGITS, [params], [None])[0] for _ in range(n)]


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    greedy = SamplingParams(temperature=0)
    assert Sampler()(logits, [greedy, greedy], [None, None]) == [1, 0]


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


def test_per_request_generator_is_independent_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    g = gen()
    alone = [Sampler(1)(logits[1:2], [params], [g])[0] for _ in range(5)]
    g = gen()
    hot = SamplingParams(temperature=1.0)
    batched = [Sampler(2)(logits, [hot, params, hot], [None, g, None])[1] for _ in range(5)]
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
