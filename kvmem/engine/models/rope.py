"""Rotary position embeddings (default, linear and Llama 3 scaling), computed in fp32.

Reads both config styles: ``rope_theta`` + ``rope_scaling`` (checkpoints) and
``rope_parameters`` (configs written by recent transformers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvmem.errors import ConfigError


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    params = dict(config.get("rope_scaling") or {})
    if isinstance(config.get("rope_parameters"), dict):
        params.update(config["rope_parameters"])
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any],
                        max_position_embeddings: int | None) -> torch.Tensor:
    base = float(params["rope_theta"])
    dim = head_dim
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        original = float(params.get("original_max_position_embeddings")
                         or max_position_embeddings or 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = original / low, original / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"RoPE scaling type {kind!r} is not supported (default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, config: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope_parameters(config),
                                       config.get("max_position_embeddings"))
        # a plain attribute, not a buffer: ``model.to(bfloat16)`` must not round it
        self.inv_freq = inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, head_dim]`` for the token positions, in fp32."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]``."""
        dtype = x.dtype
        return (x * cos.to(dtype)).add_(rotate_half(x).mul_(sin.to(dtype)))
