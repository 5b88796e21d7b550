"""Log-probabilities of chosen tokens and their most likely alternatives, from raw logits.

They come from the fp32 log-softmax of the model's logits before any logits processor,
penalty or temperature (vLLM's default ``raw_logprobs``): the model's own distribution,
which is what evaluation harnesses score. Only the rows that asked are computed.
"""

from __future__ import annotations

import torch

from kvmem.engine.outputs import PositionLogprobs


def position_logprobs(logits: torch.Tensor, token_ids: list[int],
                      num_top: list[int]) -> list[PositionLogprobs]:
    """Row i: the log-probability and rank of ``token_ids[i]`` and the ``num_top[i]`` most
    likely tokens, from ``logits`` ``[N, vocab]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, chosen_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = max(num_top, default=0)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for i, (token, value, rank) in enumerate(zip(token_ids, chosen[:, 0].tolist(),
                                                 ranks.tolist(), strict=True)):
        top = tuple(zip(top_ids[i][:num_top[i]], top_values[i][:num_top[i]], strict=True)) \
            if num_top[i] else ()
        out.append(PositionLogprobs(token, value, rank, top))
    return out
