"""Random weights for a model given by its config alone (``--load-format dummy``).

Sizing, profiling and speed runs need a model's shape, not its trained values: a
directory with ``config.json`` and ``tokenizer.json`` is enough, and nothing the size of
the weights is read or copied. Matrices are drawn from N(0, 0.02) (the usual
``initializer_range``), norm scales set to one and biases to zero, on the model's own device, from a
seeded generator, so that a run is repeatable and activations stay in range.
"""

from __future__ import annotations

import torch

DUMMY_STD = 0.02


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter of ``model`` in place, then lay the weights out as loading
    does (``process_weights_after_loading``)."""
    generator: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
            continue
        if param.dim() < 2:  # norm scales
            param.fill_(1.0)
            continue
        gen = generator.get(param.device)
        if gen is None:
            gen = generator[param.device] = torch.Generator(param.device).manual_seed(seed)
        # drawn in float32 and cast: bf16 normal_ on some devices lacks a generator path
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        values.normal_(0.0, DUMMY_STD, generator=gen)
        param.copy_(values)
    model.process_weights_after_loading()
