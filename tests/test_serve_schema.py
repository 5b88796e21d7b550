"""Property-based requests from the server's own OpenAPI schema (schemathesis), in-process
over ASGI against a tiny random model: valid and invalid bodies for every operation, a few
examples each with a fixed seed. Whatever the body, the answer is never a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from tiny_models import make_tiny_checkpoint

MODEL = "tiny"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("schema"), "llama")
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), served_model_name=MODEL, max_model_len=64,
        kv_cache_memory_bytes=1 << 20)))
    return create_app(engine)


EXAMPLES = 10  # per operation and mode: a bounded run, ~20 s in all on a small machine
SEED = 12


def served_model(case):
    """Valid bodies name the served model, so they get past the 404 to the engine."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def test_no_request_gets_a_server_error(app):
    """Every operation the schema lists (new routes included, with no change here), with
    bodies that fit its schema and bodies that do not."""
    api_schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/v1/models", "/health", "/metrics"}
    calls = []
    for operation in operations:
        takes_input = any(len(getattr(operation, part)) for part in (
            "body", "query", "path_parameters", "headers", "cookies"))
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * takes_input
        for mode in modes:
            cases = operation.as_strategy(generation_mode=mode)
            if mode == GenerationMode.POSITIVE:
                cases = cases.map(served_model)

            @given(case=cases)
            @hypothesis_seed(SEED)
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            def run(case) -> None:
                response = case.call_and_validate(checks=[not_a_server_error])
                calls.append(response.status_code)
                if response.status_code >= 400 and case.operation.path.startswith("/v1/"):
                    error = response.json()["error"]  # every error has the OpenAI shape
                    assert set(error) == {"message", "type", "param", "code"}

            run()
    assert len(calls) >= len(operations) and all(code < 500 for code in calls)
    assert any(code == 200 for code in calls) and any(400 <= code < 500 for code in calls)
