"""The runner's multimodal part: encode each item once, merge by row maps.

Per step:

1. ``run_encoders``: the items the scheduler schedules for encoding
   (``scheduled_encoder_inputs``) that are not cached yet are batched by
   modality, padded to an items-per-batch bucket (compiled once per bucket
   in graph mode, prepared at warmup) and run through the model's
   ``embed_multimodal``; each output
   (``[num_embeds, hidden]``, embedding-row index space) is cached under the
   item's identifier until the scheduler frees it (``free_encoder_mm_hashes``).
   An item whose chunk spans several steps is encoded once.
2. ``embed``: the text embeddings of the step's token rows, then, per
   modality, one ``index_copy_`` of encoder rows into the token rows their
   placeholders occupy in this chunk (``multimodal.placeholders`` builds the
   row maps, padded to a power of two; padding entries write a scratch row
   past the end that nothing reads).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from vllm.multimodal.utils import group_and_batch_mm_kwargs

from vllm_hpu_mm import metrics
from vllm_hpu_mm.bucketing.buckets import exponential, smallest_fit
from vllm_hpu_mm.multimodal.placeholders import (
    ItemPlacement,
    PlaceholderMap,
    RequestChunk,
    build_placeholder_maps,
    flat_source_rows,
)
from vllm_hpu_mm.worker.graphs import GraphRunner
from vllm_hpu_mm.worker.inputs import StepBatch
from vllm_hpu_mm.worker.requests import RequestState, RequestTable
from vllm_hpu_mm.worker.vision_buckets import PatchBucketEncoder, supports_patch_buckets

logger = logging.getLogger("vllm.hpu_mm.multimodal")


def _slice_items(
    kwargs: dict[str, Any], num_items: int, start: int, n: int
) -> dict[str, Any]:
    """Items [start, start+n) of a batch (per-item tensors have dim 0 = items)."""
    if start == 0 and n == num_items:
        return kwargs
    return {
        k: v[start : start + n]
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == num_items
        else v
        for k, v in kwargs.items()
    }


def encoder_input(value: Any, dtype: torch.dtype) -> Any:
    """An encoder input in the form warmup compiled the encoder for: floating
    tensors in the model dtype (processors hand out float32 pixel values; a
    compiled encoder guards on dtype and would compile each bucket again on
    its first real request), integer and bool tensors as they are."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating parameters (its compute dtype); the
    default dtype for a model without any."""
    floating = (p.dtype for p in model.parameters() if p.is_floating_point())
    return next(floating, torch.get_default_dtype())


def next_pow2(n: int) -> int:
    """Static length of a placeholder map with n entries (0 stays 0)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


class EncoderCache:
    """Encoder outputs by item identifier, on the device.

    It has no bound of its own: vLLM's scheduler (``EncoderCacheManager``)
    decides what stays cached, sized in embedding rows, and skips encoding an
    item it believes is cached. So an entry stays until the scheduler frees it
    (``free_encoder_mm_hashes``), or until both sides are reset together
    (``reset_encoder_cache``).
    """

    def __init__(self) -> None:
        self.outputs: dict[str, torch.Tensor] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.outputs

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self.outputs[key]
        except KeyError:
            raise RuntimeError(
                f"encoder output of item {key!r} is needed by this step but was "
                "never computed or was already freed"
            ) from None

    def put(self, key: str, output: torch.Tensor) -> None:
        self.outputs[key] = output
        metrics.ENCODER_CACHE_ITEMS.set(len(self.outputs))

    def free(self, keys: list[str]) -> None:
        for key in keys:
            self.outputs.pop(key, None)
        metrics.ENCODER_CACHE_ITEMS.set(len(self.outputs))

    def clear(self) -> int:
        """Drop every output (the scheduler's side is reset with it); how many."""
        dropped = len(self.outputs)
        self.outputs.clear()
        metrics.ENCODER_CACHE_ITEMS.set(0)
        return dropped


def pad_items(kwargs: dict[str, Any], num_items: int, size: int) -> dict[str, Any]:
    """Pad every per-item tensor (leading dim == num_items) to ``size`` items
    by repeating the last item: real values, so the encoder stays finite."""
    if size == num_items:
        return kwargs
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if (
            isinstance(value, torch.Tensor)
            and value.dim()
            and value.shape[0] == num_items
        ):
            extra = value[-1:].expand(size - num_items, *value.shape[1:])
            value = torch.cat([value, extra])
        out[name] = value
    return out


class EncoderRunner:
    """The vision (or other) encoder, bucketed by items per batch and, in graph
    mode, compiled once per bucket through the same counting backend as the
    language model."""

    def __init__(
        self,
        model: Any,
        graphs: GraphRunner,
        max_items: int,
        dynamic_resolution: bool = False,
        patch_buckets: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.dtype = model_dtype(model)
        self.item_buckets = exponential(1, max(max_items, 1))
        # Dynamic resolution (Qwen2-VL family): the inputs are every item's
        # patches concatenated ([sum patches, C*T*P*P]) with one grid row per
        # item, so items are neither padded nor sliced here. A tower that takes
        # precomputed metadata (Qwen2.5-VL) runs on patch buckets
        # (``worker.vision_buckets``, compiled per bucket in graph mode);
        # another one runs eagerly: it computes its attention segments
        # (``cu_seqlens``), window order and rotary tables on the host from
        # each grid, so compiling it whole would specialise on every grid
        # (and Dynamo fails on its numpy-made ``cu_seqlens``).
        self.dynamic_resolution = dynamic_resolution
        self.compiled = graphs.mode == "compile" and not dynamic_resolution
        self.patches: PatchBucketEncoder | None = None
        if dynamic_resolution and patch_buckets and supports_patch_buckets(model):
            backend = graphs.counter if graphs.mode == "compile" else None
            self.patches = PatchBucketEncoder(model, patch_buckets, backend)
        self._encode = model.embed_multimodal
        if self.compiled:
            self._encode = torch.compile(
                model.embed_multimodal, backend=graphs.counter, dynamic=False
            )

    def bucket(self, num_items: int) -> int:
        if self.dynamic_resolution:
            return num_items
        fit = smallest_fit(num_items, self.item_buckets)
        return num_items if fit is None else fit

    def __call__(self, num_items: int, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        size = self.bucket(num_items)
        # Inputs batched from a request may be ordinary tensors while warmup's
        # are inference tensors; graph guards tell them apart, so normalise.
        kwargs = {
            k: v.clone() if isinstance(v, torch.Tensor) and not v.is_inference() else v
            for k, v in kwargs.items()
        }
        kwargs = {k: encoder_input(v, self.dtype) for k, v in kwargs.items()}
        if self.patches is not None:
            return self.patches(kwargs)
        outputs = self._encode(**pad_items(kwargs, num_items, size))
        if len(outputs) != size:
            raise RuntimeError(
                f"embed_multimodal returned {len(outputs)} outputs for {size} items"
            )
        return list(outputs[:num_items])


class MultimodalInputs:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        graphs: GraphRunner,
        max_items: int,
        dynamic_resolution: bool = False,
        patch_buckets: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache()
        self.encoder = EncoderRunner(
            model, graphs, max_items, dynamic_resolution, patch_buckets
        )
        # Deep-stack models (Qwen3-VL): the encoder rows are [main | L levels]
        # wide; ``embed`` merges the main part and leaves the levels here,
        # [L, num_tokens, H] (zero on text rows), for ``feed_deepstack``.
        self.deepstack: torch.Tensor | None = None
        self.counts_metrics = metrics.counts_items_here()

    def on_new_requests(self, new_reqs: list[Any]) -> None:
        count = sum(len(r.mm_features or []) for r in new_reqs)
        if count and self.counts_metrics:
            metrics.MM_ITEMS.inc(count)

    def run_encoders(self, scheduler_output: Any, requests: RequestTable) -> None:
        self.cache.free(list(scheduler_output.free_encoder_mm_hashes or []))
        pending: dict[str, tuple[str, Any]] = {}
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            features = requests[req_id].mm_features
            for i in indices:
                f = features[i]
                if f.data is None or f.identifier in self.cache:
                    continue  # covered by the prefix cache, or already encoded
                pending.setdefault(f.identifier, (f.modality, f.data))
        if not pending:
            return
        keys = sorted(pending, key=lambda k: pending[k][0])  # group by modality
        items = [pending[k] for k in keys]
        outputs: list[torch.Tensor] = []
        for _, num_items, kwargs in group_and_batch_mm_kwargs(
            items, device=self.device
        ):
            step = num_items if self.encoder.dynamic_resolution else 0
            step = step or self.encoder.item_buckets[-1]
            for start in range(0, num_items, step):
                n = min(step, num_items - start)
                outputs.extend(
                    self.encoder(n, _slice_items(kwargs, num_items, start, n))
                )
        for key, out in zip(keys, outputs, strict=True):
            self.cache.put(key, out)
        if self.counts_metrics:
            metrics.ENCODER_RUNS.inc(len(keys))

    def embed(
        self, batch: StepBatch, states: list[RequestState]
    ) -> tuple[torch.Tensor, dict[str, PlaceholderMap]]:
        """[num_tokens, hidden] input embeddings of the step, and its row maps."""
        num_tokens = batch.shape.num_tokens
        text = self.model.embed_input_ids(batch.input_ids)  # [T, H]
        chunks = [
            RequestChunk(
                chunk_start=s.num_computed_tokens,
                chunk_len=int(n),
                row_start=int(r),
                items=tuple(
                    ItemPlacement.from_range(f.identifier, f.modality, f.mm_position)
                    for f in s.mm_features
                ),
            )
            for s, n, r in zip(states, batch.query_lens, batch.row_starts, strict=True)
            if s.mm_features
        ]
        maps = build_placeholder_maps(chunks, scratch_row=num_tokens, pad_to=next_pow2)
        self.deepstack = None
        if not maps:
            return text, maps
        # One scratch row past the end takes the padding entries' writes.
        embeds = torch.cat([text, text.new_zeros(1, text.shape[1])])
        hidden = text.shape[1]
        deep: torch.Tensor | None = None
        for m in maps.values():
            outputs = [self.cache[k] for k in m.item_keys]
            offsets = np.cumsum([0] + [o.shape[0] for o in outputs[:-1]])
            src = flat_source_rows(m, dict(zip(m.item_keys, offsets, strict=True)))
            flat = torch.cat(outputs).to(embeds.dtype)
            rows = flat.index_select(0, torch.from_numpy(src).to(self.device))
            dst = torch.from_numpy(m.dst_row).to(self.device)
            if rows.shape[1] > hidden:  # deep-stack levels after the main rows
                if deep is None:
                    deep = rows.new_zeros(num_tokens + 1, rows.shape[1] - hidden)
                deep.index_copy_(0, dst, rows[:, hidden:])
                rows = rows[:, :hidden]
            embeds.index_copy_(0, dst, rows)
        if deep is not None:
            self.deepstack = (
                deep[:num_tokens].view(num_tokens, -1, hidden).transpose(0, 1)
            )
        return embeds[:num_tokens], maps

    def feed_deepstack(self, start: int, stop: int) -> None:
        """Hand token rows [start, stop) of the step's deep-stack features to
        the model before the pass over them (Qwen3-VL reads them in its
        forward from a buffer its own ``embed_input_ids`` would fill, and
        clears it after). Nothing when the step has none."""
        if self.deepstack is not None:
            self.model._set_deepstack_input_embeds(self.deepstack[:, start:stop])


def warm_up_encoder(runner: Any, vllm_config: Any) -> int:
    """Run every items-per-batch bucket of every active modality once, on the
    model's own dummy inputs. Returns the number of encoder shapes prepared."""
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    mm: MultimodalInputs = runner.mm
    if mm.encoder.patches is not None:
        if runner.graphs.mode != "compile":
            return 0
        return mm.encoder.patches.warm_up(mm.encoder.dtype)
    if not mm.encoder.compiled:
        return 0  # an eager encoder has nothing to prepare
    budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY)
    prepared = 0
    for modality in budget.mm_max_toks_per_item:
        for size in mm.encoder.item_buckets:
            dummy = budget.get_dummy_encoder_profile_inputs(modality, size)
            for _, n, kwargs in group_and_batch_mm_kwargs(dummy, device=mm.device):
                mm.encoder(n, kwargs)
            prepared += 1
    return prepared
