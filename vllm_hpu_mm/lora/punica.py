"""The punica wrapper of the plugin: every LoRA slot applied by two GEMMs and a
mask, so each call has one shape per token count (Gaudi's static graphs).

vLLM's CPU wrapper (``punica_cpu``) runs the SGMV path: it groups tokens by
adapter with ``torch.unique_consecutive`` and loops over the groups, so the
shapes (and, under a graph, the code) depend on the batch's adapter layout.
The official Gaudi plugin (vllm-gaudi, ``PunicaWrapperHPU`` over
``vllm_hpu_extension.ops.dispatch_bgmv_linear``) instead multiplies the input
by the A weights of every slot at once, masks the ranks of the slots each
token does not use, and multiplies by the B weights of every slot: the shapes
are fixed by the slots (``max_loras``) and the padded rank (``max_lora_rank``),
and the adapter layout is data. This wrapper does the same in plain PyTorch.

The index space: ``update_metadata`` receives vLLM's ``LoRAMapping`` in the
runner's padded step row layout (one entry per token row, ``0`` for no adapter
and for padding rows) and its prompt mapping in logits-row order. Each pass of
a step (``worker.inputs.step_passes``) calls ``select_rows(start, stop)``,
which copies the slots of its rows to the front of the device buffers; the ops
read ``buffer[: x.size(0)]``, so a symbolic token count stays symbolic.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

NO_SLOT = -1  # a token row served by the base model


def slots_of(ids: Any, lora_index_to_id: list[int | None]) -> np.ndarray:
    """LoRA ids (``0``: none) -> slot indices (``NO_SLOT``: none), int64."""
    slot_of = {i: s for s, i in enumerate(lora_index_to_id) if i is not None}
    ids = np.asarray(ids, np.int64)
    out = np.full(ids.shape, NO_SLOT, np.int64)
    for lora_id in np.unique(ids[ids > 0]):
        if int(lora_id) not in slot_of:
            raise KeyError(f"LoRA id {int(lora_id)} is in no slot: {lora_index_to_id}")
        out[ids == lora_id] = slot_of[int(lora_id)]
    return out


def masked_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``x @ A[s].T @ B[s].T`` for each row's slot ``s`` (zero where none).

    x: [T, in]; a: [L, 1, R, in]; b: [L, 1, out, R]; slots: [T] in
    [-1, L). Returns [T, out] in the dtype of ``x``. The scale is folded into
    B by vLLM when an adapter is loaded."""
    num_slots, _, rank, width = a.shape
    out = b.shape[2]
    dtype = x.dtype
    # [T, L*R]: every slot's shrink, then zero the ranks of the others.
    shrunk = x @ a.reshape(num_slots * rank, width).to(dtype).t()
    own = slots.unsqueeze(1) == torch.arange(num_slots, device=x.device)  # [T, L]
    mask = own.to(dtype).repeat_interleave(rank, dim=1)  # [T, L*R]
    # [L*R, out]: B of every slot, rank-major per slot as ``shrunk`` is.
    expand = b.reshape(num_slots, out, rank).transpose(1, 2).reshape(-1, out)
    return (shrunk * mask) @ expand.to(dtype)


class PunicaWrapperHPUMM(PunicaWrapperBase):
    """vLLM's punica interface with static shapes (see the module docstring)."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        max_batches: int,
        device: torch.device | str,
        **kwargs: Any,
    ) -> None:
        # Padded steps may hold more rows than the scheduler's token budget
        # (bucket padding; a mixed step's passes): room for twice as many.
        rows = 2 * max_num_batched_tokens + max_batches
        super().__init__(rows, max_batches, device)
        self.rows = rows
        self._token_lora_indices.fill_(NO_SLOT)
        self._sampler_indices.fill_(NO_SLOT)
        self._embeddings_indices.zero_()
        self._token_slots = np.zeros(0, np.int64)  # host, step row layout
        self.vocab_size = 0

    # ---- metadata -------------------------------------------------------------
    def update_metadata(
        self,
        mapping: Any,
        lora_index_to_id: list[int | None],
        max_loras: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> None:
        tokens = slots_of(mapping.index_mapping, lora_index_to_id)
        prompts = slots_of(mapping.prompt_mapping, lora_index_to_id)
        if max(len(tokens), len(prompts)) > self.rows:
            raise ValueError(
                f"LoRA mapping of {len(tokens)} token rows and {len(prompts)} "
                f"logits rows; the buffers hold {self.rows}"
            )
        self._token_slots = tokens
        self.vocab_size = vocab_size
        self.no_lora = not bool((tokens >= 0).any())
        self.is_prefill = False
        sampler = np.full(self.rows, NO_SLOT, np.int64)
        sampler[: len(prompts)] = prompts
        self._sampler_indices.copy_(torch.from_numpy(sampler))
        self.indices_len[:] = [len(tokens), len(prompts), len(prompts), len(tokens)]
        self.select_rows(0, len(tokens))

    def select_rows(self, start: int, stop: int) -> None:
        """Point the token buffers at step rows [start, stop) (one pass)."""
        slots = np.full(self.rows, NO_SLOT, np.int64)
        slots[: stop - start] = self._token_slots[start:stop]
        host = torch.from_numpy(slots)
        self._token_lora_indices.copy_(host)
        # VocabParallelEmbeddingWithLoRA reads the row offset of each token's
        # slot in its flattened [L * vocab, R] A table (slot 0 where none).
        self._embeddings_indices.copy_(host.clamp(min=0) * self.vocab_size)

    def _rows(self, buffer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return buffer[: x.size(0)]

    # ---- ops ------------------------------------------------------------------
    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """y[:, slice i] += scale * x @ A_i[s].T @ B_i[s].T, in place."""
        slots = self._rows(self._token_lora_indices, x)
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        offset = 0
        for a, b, size in zip(
            lora_a_stacked, lora_b_stacked, output_slices, strict=True
        ):
            delta = masked_lora(x2, a, b, slots)
            if scale != 1.0:
                delta = delta * scale
            y2[:, offset : offset + size] += delta.to(y.dtype)
            offset += size
        return y

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: Any,
        *,
        buffer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The logits head: rows are the logits rows (the prompt mapping)."""
        slots = self._rows(self._sampler_indices, x)
        delta = masked_lora(x.to(torch.float32), lora_a_stacked, lora_b_stacked, slots)
        vocab = min(y.shape[-1], delta.shape[-1])
        y[:, :vocab] += (delta[:, :vocab] * scale).to(y.dtype)
        return y

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """y += x @ B[s].T, x already the rows of each token's A table."""
        slots = self._rows(self._token_lora_indices, x)
        num_slots, _, out, rank = lora_b_stacked.shape
        own = slots.unsqueeze(1) == torch.arange(num_slots, device=x.device)
        # [T, L*R]: the token's A row under its own slot, zeros elsewhere.
        spread = (x.unsqueeze(1) * own.unsqueeze(2).to(x.dtype)).reshape(
            -1, num_slots * rank
        )
        expand = lora_b_stacked.reshape(num_slots, out, rank).transpose(1, 2)
        delta = spread @ expand.reshape(-1, out).to(x.dtype)
        if add_inputs:
            y += delta.to(y.dtype)
        else:
            y.copy_(delta.to(y.dtype))
        return y

    def add_shrink(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("vllm-hpu-mm: LoRA goes through add_lora_linear")

    def add_expand(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("vllm-hpu-mm: LoRA goes through add_lora_linear")

    def apply_lora_full_linear(self, *args: Any, **kwargs: Any) -> None:
        # Classification heads only; the plugin serves generation alone.
        raise NotImplementedError("vllm-hpu-mm: no LoRA classification heads")
