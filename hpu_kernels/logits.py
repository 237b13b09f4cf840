"""The language-model head with float32 logits where they decide the answer.

A bfloat16 head accumulates each logit in float32 (oneDNN on the CPU, the MME
on Gaudi) and then rounds it to bfloat16: at a logit of 16 to 32 the spacing is
0.125, so two tokens closer than that come out tied or a spacing apart, and
greedy decoding picks between them by rounding. ``refined_logits`` keeps the
head's one bfloat16 matmul and recomputes only the ``k`` largest logits of each
row in float32 from the same hidden state and weight rows (a gather of ``k``
weight rows and a ``k``-wide dot product per row: static shapes, no float32
copy of the weight).

Why that is exact where it matters: each rounded logit is within half a
spacing of its float32 value, so the float32 argmax is within one spacing of
the largest rounded logit; when fewer than ``k`` rounded logits lie within one
spacing of the largest, the ``k`` recomputed ones contain it, and greedy
decoding and the top-``k`` logprobs see float32 values. The rest of the row is
the rounded value upcast: its error reaches the log-softmax only through the
normalizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REFINED_TOP = 8


def refined_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    k: int = REFINED_TOP,
) -> torch.Tensor:
    """``hidden [T, H]`` (the model dtype) through ``weight [V, H]``: float32
    logits ``[T, V]``, the top ``k`` of each row computed in float32."""
    logits = F.linear(hidden, weight, bias)
    k = min(k, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices  # [T, k]
    rows = weight.index_select(0, top.reshape(-1)).view(*top.shape, -1)
    exact = torch.matmul(rows.float(), hidden.float().unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        exact = exact + bias.float().index_select(0, top.reshape(-1)).view_as(top)
    return logits.float().scatter(-1, top, exact)
