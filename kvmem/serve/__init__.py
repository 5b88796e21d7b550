"""OpenAI-compatible HTTP serving for the kvmem engine.

>>> from kvmem.serve import create_app
>>> app = create_app(AsyncLLMEngine(LLMEngine(config)), api_key=None)
"""

from kvmem.serve.app import create_app

__all__ = ["create_app"]
