"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) over per-request states kept in
the engine's state-group blocks.

A layer keeps, per request, a causal-conv state (the last ``kernel - 1`` inputs of its
q/k/v channels) and a recurrent state ``S`` of ``(value heads, v_dim, k_dim)``, vLLM's
layout (``LinearState.shapes``). Both live in one block of the layer's state group: a
view of the layer's slot tensor, whose page the engine sizes to hold them
(``kvmem.spec.state_groups``). A step reads each sequence's state from the block
``StateMetadata.read`` names (or starts from zeros) and writes the state after its new
tokens into ``StateMetadata.write``; under prefix caching these are different blocks
once a sequence crosses a block boundary, so the state at every boundary stays behind
as a checkpoint.

The recurrence here is the torch reference, token by token: per token and value head,
``S = S * exp(g)``, ``S += k (beta (v - S k))^T`` and ``o = S q``, with q and k
L2-normalised and q scaled by ``k_dim ** -0.5``. On a GPU the same step is what vLLM
runs with flash-linear-attention's Triton kernels (``chunk_gated_delta_rule`` for
prefill, ``fused_recurrent_gated_delta_rule`` for decode) and the ``causal_conv1d``
kernels; this module does not use them.

Tensor parallel ranks hold whole key-head groups: ``in_proj_qkvz`` and ``in_proj_ba``
are laid out per key head in the checkpoint, so a rank's rows are contiguous; the conv
weight's q, k and v channels are split each, as vLLM splits them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvmem.engine.attention.metadata import AttentionMetadata
from kvmem.engine.models.decoder import ParallelConfig
from kvmem.engine.models.layers import ColumnParallelLinear, RowParallelLinear, _copy, _param


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Outputs ``[B, L, H, V]`` of the recurrence over ``L`` tokens of ``B`` sequences,
    updating ``state`` ``[B, H, V, K]`` (fp32) in place.

    ``q``, ``k``: ``[B, L, H, K]`` (normalised and scaled), ``v``: ``[B, L, H, V]``,
    ``g`` (log decay) and ``beta``: ``[B, L, H]``; all fp32.
    """
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state.mul_(g[:, t].exp()[..., None, None])
        k_t = k[:, t, :, None, :]
        delta = (v[:, t] - (state * k_t).sum(-1)) * beta[:, t, :, None]
        state.add_(delta[..., None] * k_t)
        out[:, t] = (state * q[:, t, :, None, :]).sum(-1)
    return out


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal convolution of ``x`` ``[B, L, C]`` continuing from
    ``conv_state`` ``[B, kernel - 1, C]``; returns ``(output, the next conv state)``."""
    window = torch.cat([conv_state, x], dim=1)  # [B, kernel - 1 + L, C]
    kernel = weight.shape[-1]
    frames = window.unfold(1, kernel, 1)  # [B, L, C, kernel]
    out = (frames * weight).sum(-1)
    return F.silu(out), window[:, window.shape[1] - (kernel - 1):]


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)``, per value head, in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), lambda p, w, shard_id=None: _copy(p, w))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer of a tensor-parallel rank."""

    def __init__(self, config: dict[str, Any], state_group: int, parallel: ParallelConfig,
                 *, fused: bool = True) -> None:
        """``fused``: Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` (laid out per key
        head); else Qwen3.5's ``in_proj_qkv`` (q, k, v one after another), ``in_proj_z``,
        ``in_proj_b`` and ``in_proj_a``."""
        super().__init__()
        tp, rank = parallel.tp_size, parallel.tp_rank
        hidden = config["hidden_size"]
        kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
        if kh % tp:
            raise ValueError(f"{kh} linear-attention key heads do not split over {tp} ranks")
        self.kd, self.vd = config["linear_key_head_dim"], config["linear_value_head_dim"]
        self.kh, self.vh = kh // tp, vh // tp
        self.per_key_head = vh // kh  # value heads each key head serves
        self.kernel = config.get("linear_conv_kernel_dim", 4)
        self.key_dim, self.value_dim = self.kh * self.kd, self.vh * self.vd
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.state_group = state_group
        self.tp_rank = rank
        self.fused = fused
        if fused:
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden, 2 * kh * self.kd + 2 * vh * self.vd, False, **parallel.kw)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * vh, False, **parallel.kw)
        else:
            self.in_proj_qkv = ColumnParallelLinear(hidden, (2 * kh * self.kd + vh * self.vd),
                                                    False, **parallel.kw)
            self.in_proj_qkv.weight.weight_loader = self._load_qkv_rows
            self.in_proj_z = ColumnParallelLinear(hidden, vh * self.vd, False, **parallel.kw)
            self.in_proj_b = ColumnParallelLinear(hidden, vh, False, **parallel.kw)
            self.in_proj_a = ColumnParallelLinear(hidden, vh, False, **parallel.kw)
        self.conv1d = nn.Module()  # the checkpoint's name: linear_attn.conv1d.weight
        self.conv1d.weight = _param((self.conv_dim, self.kernel), self._load_qkv_rows)
        self.A_log = _param((self.vh,), self._load_heads)
        self.dt_bias = _param((self.vh,), self._load_heads)
        self.norm = GatedRMSNorm(self.vd, config.get("rms_norm_eps", 1e-6))
        self.out_proj = RowParallelLinear(vh * self.vd, hidden, False, **parallel.kw)

    # -- weights ---------------------------------------------------------------------
    def _load_qkv_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """The rank's q, k and v rows of a tensor whose rows are all q, all k, then all v
        channels: the conv weight ``[conv_dim, 1, kernel]``, Qwen3.5's ``in_proj_qkv``."""
        loaded = loaded.reshape(loaded.shape[0], -1)
        tp = loaded.shape[0] // self.conv_dim
        parts = [self.key_dim, self.key_dim, self.value_dim]
        start, rows = 0, []
        for size in parts:
            rows.append(loaded.narrow(0, start + self.tp_rank * size, size))
            start += size * tp
        _copy(param, torch.cat(rows))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded.narrow(0, self.tp_rank * self.vh, self.vh))

    # -- state -----------------------------------------------------------------------
    def state_views(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [blocks, kernel - 1, conv_dim], ssm [blocks, heads, v_dim, k_dim])``: the
        layer's state tensors inside its slot tensor's pages."""
        flat = page.view(page.shape[0], -1)
        conv_n = (self.kernel - 1) * self.conv_dim
        ssm_n = self.vh * self.vd * self.kd
        if flat.shape[1] < conv_n + ssm_n:
            raise ValueError(f"a KV page of {flat.shape[1]} values cannot hold a Gated "
                             f"DeltaNet state of {conv_n + ssm_n}")
        conv = flat[:, :conv_n].view(-1, self.kernel - 1, self.conv_dim)
        ssm = flat[:, conv_n:conv_n + ssm_n].view(-1, self.vh, self.vd, self.kd)
        return conv, ssm

    # -- forward ---------------------------------------------------------------------
    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q/k/v (as one conv input ``[T, conv_dim]``), z ``[T, vh, vd]``, b, a ``[T, vh]``."""
        t, kd, vd, n = x.shape[0], self.kd, self.vd, self.per_key_head
        if not self.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.vh, vd),
                    self.in_proj_b(x), self.in_proj_a(x))
        qkvz = self.in_proj_qkvz(x).view(t, self.kh, 2 * kd + 2 * n * vd)
        q, k, v, z = qkvz.split([kd, kd, n * vd, n * vd], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.kh, 2 * n).split([n, n], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.vh, vd), b.reshape(t, self.vh), a.reshape(t, self.vh)

    def _mix(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             conv_state: torch.Tensor, ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Core outputs ``[B, L, vh, vd]`` of ``B`` sequences of ``L`` tokens each; the
        conv state comes back, ``ssm`` (fp32) is updated in place."""
        bsz, length = mixed.shape[:2]
        # in fp32, as the conv kernels accumulate; the state keeps the inputs' values
        mixed, conv_state = causal_conv(mixed.float(), conv_state.float(),
                                        self.conv1d.weight.float())
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(bsz, length, self.kh, self.kd)) * self.kd ** -0.5
        k = l2norm(k.reshape(bsz, length, self.kh, self.kd))
        if self.per_key_head > 1:
            q = q.repeat_interleave(self.per_key_head, dim=2)
            k = k.repeat_interleave(self.per_key_head, dim=2)
        v = v.reshape(bsz, length, self.vh, self.vd)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return gated_delta_rule(q, k, v, g, beta, ssm), conv_state

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata, page: torch.Tensor
                ) -> torch.Tensor:
        mixed, z, b, a = self._split(x)
        states = metadata.states
        conv_all, ssm_all = self.state_views(page)
        lens = metadata.query_lens
        if states is None:  # a profiling pass: zero states, nothing kept
            read = write = torch.full((len(lens),), -1, dtype=torch.long, device=x.device)
        else:
            read, write = states.read[self.state_group], states.write[self.state_group]
        conv_state = conv_all[read.clamp(min=0)]
        ssm = ssm_all[read.clamp(min=0)].float()
        fresh = read < 0
        if bool(fresh.any()):
            conv_state[fresh] = 0
            ssm[fresh] = 0
        if metadata.is_decode_only:
            core, conv_state = self._mix(mixed[:, None], b[:, None], a[:, None], conv_state, ssm)
            core = core[:, 0]
        else:
            outs, new_conv, start = [], [], 0
            for i, length in enumerate(lens):
                end = start + length
                out, conv_i = self._mix(mixed[None, start:end], b[None, start:end],
                                        a[None, start:end], conv_state[i:i + 1], ssm[i:i + 1])
                outs.append(out[0])
                new_conv.append(conv_i)
                start = end
            core, conv_state = torch.cat(outs), torch.cat(new_conv)
        keep = write >= 0
        if bool(keep.all()):
            conv_all[write] = conv_state.to(conv_all.dtype)
            ssm_all[write] = ssm.to(ssm_all.dtype)
        elif bool(keep.any()):
            conv_all[write[keep]] = conv_state[keep].to(conv_all.dtype)
            ssm_all[write[keep]] = ssm[keep].to(ssm_all.dtype)
        core = self.norm(core.to(x.dtype), z)
        return self.out_proj(core.reshape(x.shape[0], -1))
