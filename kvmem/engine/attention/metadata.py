"""What one forward step tells the attention backend about its batch.

The tokens of all sequences in a step are packed into one flat dimension ``T``;
``query_start_loc`` marks where each sequence's new tokens start. Each KV group has
its own block table and slot mapping (hybrid models keep sliding-window layers in
other blocks than full-attention layers).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StateMetadata:
    """Where each sequence keeps its linear-attention state, per state group (the
    ``kvmem.spec.state_groups`` after the attention groups)."""

    read: list[torch.Tensor]  # per state group: int64 [B], the state's block; -1: zeros
    write: list[torch.Tensor]  # per state group: int64 [B], the block the new state goes to


@dataclass
class PaddedTable:
    ids: np.ndarray  # int32 [B, width]: each row's block ids, then 0 (the null block)
    lens: np.ndarray  # int64 [B]: each row's own length


def padded_table(rows: Sequence[Sequence[int]]) -> PaddedTable:
    """Rows of block ids as one 0-padded array (at least one column), built in numpy: a
    full batch's tables hold tens of thousands of ids, and a Python list per row padded
    and then converted element by element took most of a decode step's input time."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(lens.sum())
    ids = np.zeros((len(rows), max(int(lens.max(initial=0)), 1)), dtype=np.int32)
    if total:
        starts = np.cumsum(lens) - lens
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=total)
        ids[np.repeat(np.arange(len(rows)), lens), np.arange(total) - np.repeat(starts, lens)] \
            = flat
    return PaddedTable(ids, lens)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative count of new tokens per sequence
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new)
    max_query_len: int
    max_seq_len: int
    block_tables: list[torch.Tensor]  # per KV group: int32 [B, max_blocks], 0-padded (null block)
    slot_mappings: list[torch.Tensor]  # per KV group: int64 [T]; -1: do not write
    block_size: int
    query_lens: list[int] = field(default_factory=list)  # host copies, filled when left empty
    seq_lens_cpu: list[int] = field(default_factory=list)
    states: StateMetadata | None = None  # linear-attention hybrids only
    # what a backend derives from this step once and reuses in every layer (gather
    # indices, masks), keyed by the backend's own keys; a new step brings a new object
    step_cache: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.seq_lens_cpu:
            self.seq_lens_cpu = [int(n) for n in self.seq_lens.tolist()]
        if not self.query_lens:
            starts = [int(n) for n in self.query_start_loc.tolist()]
            self.query_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence adds exactly one token (the batched decode path)."""
        return self.max_query_len == 1

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[Sequence[int]]], block_size: int,
              device: str | torch.device = "cpu") -> AttentionMetadata:
        """Metadata from plain lists: ``block_tables[g][b]`` is sequence b's block ids in group g.

        Slot mappings are derived: the new tokens of sequence b sit at positions
        ``seq_lens[b] - query_lens[b] .. seq_lens[b] - 1``.
        """
        if len(query_lens) != len(seq_lens):
            raise ValueError("query_lens and seq_lens differ in length")
        q_lens = np.asarray(query_lens, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(q_lens)))
        token_seq = np.repeat(np.arange(len(q_lens)), q_lens)  # each new token's sequence
        # each new token's position: its sequence's cached length plus its index in the step
        positions = np.repeat(np.asarray(seq_lens, dtype=np.int64) - q_lens - starts[:-1],
                              q_lens) + np.arange(len(token_seq))
        block_index, offset = np.divmod(positions, block_size)
        tables, slots = [], []
        for group in block_tables:
            table = padded_table(group)
            if len(token_seq) and not (block_index < table.lens[token_seq]).all():
                raise IndexError("a new token's position lies past its sequence's block table")
            slot = table.ids[token_seq, block_index].astype(np.int64) * block_size + offset
            tables.append(torch.from_numpy(table.ids).to(device))
            slots.append(torch.from_numpy(slot).to(device))
        return cls(
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_tables=tables,
            slot_mappings=slots,
            block_size=block_size,
            query_lens=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
