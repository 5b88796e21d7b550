"""One vLLM worker's KV bytes as kvmem's tiers copy them: a block id is a row of each slot.

vLLM registers one tensor per attention layer, logically ``[B, H, N, C]`` (blocks, KV
heads, tokens, and a token's content: its key and value side by side, or an MLA latent),
laid out in memory in the order of the KV cache layout the engine resolved (``LBHNC``,
``LBNHC``, ``LHBNC``, the cross-layer ``BLHNC`` and ``BLNHC``, ``BHLNC``): several layers
may share one allocation, and KV cache groups overlay the same bytes (a block id belongs
to one group at a time). A manager block may also be split into kernel blocks (dimension
0 is then ``num_blocks * r``). Whatever the layout, block ``b`` of a layer is row ``b`` of
its view, so kvmem copies blocks through the views (``index_select`` / ``index_copy_``)
and every layout round-trips byte for byte, on the CPU and on CUDA; vLLM's kernels keep
their layout.

The slots are the distinct views: layers of different groups that alias the same bytes
are one slot, copied once. Specs other than attention are refused at start-up in one line:
per-request state (vLLM's ``MambaSpec``: Gated DeltaNet, Mamba2 and other linear-attention
layers of hybrid models) says why, since a reloaded prefix needs the state at its last
token, which the tiers do not keep. So is a tensor whose shape does not match its group's
blocks, and a model whose groups have different block sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvmem.errors import ConfigError

PREFIX = "KvmemConnector"


@dataclass(frozen=True)
class GroupRule:
    """Which blocks of a request a KV cache group keeps, by vLLM's rules for its spec.

    ``kind``: ``full`` (every block), ``sliding`` (the blocks of the last ``window``
    tokens) or ``chunked`` (the blocks of the current chunk of ``window`` tokens)."""

    kind: str
    window: int = 0

    def first_kept_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block vLLM keeps (earlier ones are its null block) once
        ``num_computed_tokens`` are computed; what ``get_num_skipped_tokens`` skips."""
        if self.kind == "sliding":
            skipped = max(0, num_computed_tokens - self.window + 1)
        elif self.kind == "chunked":
            skipped = num_computed_tokens // self.window * self.window
        else:
            skipped = 0
        return skipped // block_size

    def describe(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind}{self.window}"


def group_rule(spec: Any) -> GroupRule:
    """The rule of a vLLM KV cache spec; ConfigError for what kvmem cannot offload."""
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":  # layers of one type with different shapes
        rules = {group_rule(s) for s in spec.kv_cache_specs.values()}
        if len(rules) == 1:
            return rules.pop()
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec") and window:
        # vLLM also keeps the blocks of extra_retained_tokens below the window
        return GroupRule("sliding", int(window) + int(getattr(spec, "extra_retained_tokens",
                                                              0) or 0))
    if name == "ChunkedLocalAttentionSpec" and chunk:
        return GroupRule("chunked", int(chunk))
    if name in ("FullAttentionSpec", "MLAAttentionSpec") and not window and not chunk:
        return GroupRule("full")
    if name == "MambaSpec":
        raise ConfigError(state_refusal(spec))
    raise ConfigError(f"{PREFIX}: KV cache spec {name} cannot be offloaded (kvmem offloads "
                      "full, sliding-window, chunked local and MLA attention blocks)")


_STATE_LAYERS = {"GDN_ATTN": "Gated DeltaNet", "MAMBA2": "Mamba2", "MAMBA1": "Mamba",
                 "LINEAR": "linear attention", "SHORT_CONV": "short convolution"}


def state_refusal(spec: Any) -> str:
    """Why a model with per-request state layers (vLLM's ``MambaSpec``) is refused."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", "")
    layers = _STATE_LAYERS.get(kind, "recurrent")
    return (f"{PREFIX}: this model's {layers} layers keep a per-request state (vLLM's "
            "MambaSpec), whose pages the connector does not store: a prefix reloaded "
            "without the state at its last token would give wrong outputs, so the connector "
            "refuses hybrid linear-attention models (start vLLM without it)")


def group_rules(kv_cache_config: Any) -> tuple[list[GroupRule], int]:
    """Each group's rule and the one block size they share."""
    groups = kv_cache_config.kv_cache_groups
    rules = [group_rule(g.kv_cache_spec) for g in groups]  # a state group's refusal first
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        raise ConfigError(f"{PREFIX}: KV cache groups of different block sizes "
                          f"({sorted(sizes)}) are not supported")
    return rules, sizes.pop()


def block_rows(view: torch.Tensor, num_blocks: int, name: str = "") -> torch.Tensor:
    """``view`` with the manager block id as dimension 0 (kernel blocks of one manager
    block become dimension 1)."""
    if view.dim() < 2 or view.shape[0] % num_blocks:
        raise ConfigError(f"{PREFIX}: KV cache tensor of {name!r} has shape "
                          f"{tuple(view.shape)}; its first dimension is not a multiple of "
                          f"the {num_blocks} blocks (unknown KV cache layout)")
    split = view.shape[0] // num_blocks
    return view if split == 1 else view.unflatten(0, (num_blocks, split))


class WorkerKVLayout:
    """A worker's registered KV tensors as kvmem slot tensors (``slot_tensor(s)``, dimension
    0 the block id), whatever vLLM's layout; ``describe()`` names it for the disk tier."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any) -> None:
        self.rules, self.block_size = group_rules(kv_cache_config)
        num_blocks = kv_cache_config.num_blocks
        self.layout = str(getattr(kv_cache_config, "kv_cache_layout", None) or "default")
        slots: list[torch.Tensor] = []
        seen: set[tuple] = set()
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                view = kv_caches.get(name)
                if view is None:
                    raise ConfigError(f"{PREFIX}: no KV cache tensor for layer {name!r}")
                rows = block_rows(view, num_blocks, name)
                identity = (rows.data_ptr(), tuple(rows.shape), rows.stride(), rows.dtype)
                if identity not in seen:  # groups overlaying the same bytes: one slot
                    seen.add(identity)
                    slots.append(rows)
        if not slots:
            raise ConfigError(f"{PREFIX}: vLLM registered no KV cache tensors")
        self.slots = slots
        self.num_slots = len(slots)
        self.num_blocks = num_blocks
        self.group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self.slots[slot]

    def block_rows(self, view: torch.Tensor) -> torch.Tensor:
        """A registered view (or a copy of one) with the manager block id as dimension 0."""
        return block_rows(view, self.num_blocks)

    def describe(self) -> str:
        """What a stored block's bytes mean: a tier file of another description never
        loads here. The memory layout is not part of it: a block is copied in its logical
        order, so a file written under one layout loads into another."""
        shapes = ";".join(f"{tuple(t.shape[1:])}{str(t.dtype).removeprefix('torch.')}"
                          for t in self.slots)
        groups = " ".join(f"{rule.describe()}:{','.join(layers)}"
                          for rule, layers in zip(self.rules, self.group_layers, strict=True))
        return f"groups={groups} block={self.block_size} slots={shapes}"


def block_ids_per_group(block_ids: Sequence[Sequence[int]] | Sequence[int]
                        ) -> tuple[list[int], ...]:
    """vLLM's block ids of a request: one list per group (a single list is group 0's)."""
    if block_ids and isinstance(block_ids[0], int):
        return (list(block_ids),)  # type: ignore[arg-type]
    return tuple(list(ids) for ids in block_ids)  # type: ignore[union-attr]
