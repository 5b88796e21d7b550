"""A config.json's sizes are bounded before anything is built from them: a config naming
10^9 layers is one line, not a host out of memory; every catalog model is within bounds."""

import resource

import pytest

from kvmem.errors import ConfigError
from kvmem.spec import catalog, load_spec, spec_from_config
from kvmem.spec.bounds import BOUNDS, MAX_LAYERS
from kvmem.spec.catalog import catalog_config

_, LLAMA = catalog_config("meta-llama/Llama-3.1-8B-Instruct")


def test_a_billion_layers_is_one_line_and_no_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match=r"^config\.json: field 'num_hidden_layers' must be "
                                          r"at most 1,024, got 1000000000$"):
        spec_from_config({**LLAMA, "num_hidden_layers": 10**9}, "config.json")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024  # a list of 10^9 layers would be tens of GiB


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_every_bounded_field_names_itself(field):
    for value in (BOUNDS[field] + 1, 1e300, float("inf")):
        with pytest.raises(ConfigError, match=f"field '{field}' must be at most"):
            spec_from_config({**LLAMA, field: value}, "config.json")


def test_the_bounds_hold_inside_text_config():
    nested = {"model_type": "gemma3", "text_config": {**LLAMA, "vocab_size": 1 << 40}}
    with pytest.raises(ConfigError, match="field 'vocab_size' must be at most"):
        spec_from_config(nested, "config.json")


def test_a_per_layer_list_longer_than_the_bound_is_refused():
    types = ["full_attention"] * (MAX_LAYERS + 1)
    with pytest.raises(ConfigError, match="field 'layer_types' has 1,025 entries, at most"):
        spec_from_config({**LLAMA, "layer_types": types}, "config.json")


def test_the_deepest_model_allowed_loads_and_every_catalog_model_is_within_bounds():
    assert spec_from_config({**LLAMA, "num_hidden_layers": MAX_LAYERS}).num_layers == MAX_LAYERS
    for entry in catalog():
        load_spec(entry.hf_id)
