"""The runner's multimodal part: encode each item once, merge by row maps.

Per step:

1. ``run_encoders``: the items the scheduler schedules for encoding
   (``scheduled_encoder_inputs``) that are not cached yet are batched by
   modality, padded to an items-per-batch bucket (compiled once per bucket
   in graph mode, prepared at warmup) and run through the model's
   ``embed_multimodal``. An item whose chunk spans several steps is encoded
   once.
2. ``store``: each output (``[num_embeds, hidden]``, embedding-row index
   space) is copied into the encoder store (``worker.encoder_store``), one
   preallocated device tensor, under the item's identifier until the scheduler
   frees it (``free_encoder_mm_hashes``).
3. ``attach_maps``: per modality, the step's placeholder map (store rows to
   token rows, built by ``multimodal.placeholders`` and padded to the step's
   token rows) goes into the attention metadata (``mm_maps``).
4. ``merge``: per pass, the compiled merge (``worker.merge``) reads the pass's
   maps from its metadata and writes the text embeddings and the mapped
   encoder rows: one ``index_copy_`` per modality, inside the graph.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.multimodal.utils import group_and_batch_mm_kwargs

from vllm_hpu_mm import metrics
from vllm_hpu_mm.attention.metadata import HpuMMAttentionMetadata
from vllm_hpu_mm.bucketing.buckets import exponential, smallest_fit
from vllm_hpu_mm.multimodal.placeholders import (
    RequestChunk,
    build_placeholder_maps,
    flat_source_rows,
)
from vllm_hpu_mm.worker.buffers import DeviceBuffers
from vllm_hpu_mm.worker.encoder_store import EncoderStore
from vllm_hpu_mm.worker.graphs import GraphRunner
from vllm_hpu_mm.worker.merge import MergeMap, merge_map, merge_rows, to_device
from vllm_hpu_mm.worker.requests import RequestTable
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
        *,
        hidden: int,
        store_rows: int,
        modalities: tuple[str, ...] = ("image",),
        dynamic_resolution: bool = False,
        patch_buckets: tuple[int, ...] = (),
        buffers: DeviceBuffers | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.hidden = hidden
        self.modalities = modalities
        # Deep-stack models (Qwen3-VL): encoder rows are [main | L levels] wide;
        # the merge puts the main part in the embeddings and hands the levels
        # to the model per pass (``_feed_deepstack``).
        self.deepstack_levels = (
            int(getattr(model, "deepstack_num_level", 0))
            if getattr(model, "use_deepstack", False)
            else 0
        )
        self.store = EncoderStore(
            store_rows,
            hidden * (1 + self.deepstack_levels),
            model_dtype(model),
            device,
        )
        self.encoder = EncoderRunner(
            model, graphs, max_items, dynamic_resolution, patch_buckets
        )
        self._put = (
            to_device(device) if buffers is None else buffers.put
        )  # map tensors to the device
        self._merge = merge_rows
        if graphs.mode == "compile":
            self._merge = torch.compile(
                merge_rows, backend=graphs.counter, dynamic=graphs.dynamic
            )
        self.counts_metrics = metrics.counts_items_here()

    def on_new_requests(self, new_reqs: list[Any]) -> None:
        count = sum(len(r.mm_features or []) for r in new_reqs)
        if count and self.counts_metrics:
            metrics.MM_ITEMS.inc(count)

    def run_encoders(self, scheduler_output: Any, requests: RequestTable) -> None:
        self.store.free(list(scheduler_output.free_encoder_mm_hashes or []))
        pending: dict[str, tuple[str, Any]] = {}
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            features = requests[req_id].mm_features
            for i in indices:
                f = features[i]
                if f.data is None or f.identifier in self.store:
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
            self.store.put(key, out)
        if self.counts_metrics:
            metrics.ENCODER_RUNS.inc(len(keys))

    def attach_maps(
        self, md: HpuMMAttentionMetadata, chunks: list[RequestChunk]
    ) -> None:
        """Write the step's placeholder maps (store rows to token rows, one per
        modality, padded to the step's token rows) into its metadata."""
        rows = md.num_decodes + md.num_prefill_tokens
        host = build_placeholder_maps(
            chunks, scratch_row=rows, modalities=self.modalities
        )
        md.mm_maps = {
            modality: merge_map(
                f"mm.{modality}",
                flat_source_rows(m, {k: self.store.first_row(k) for k in m.item_keys}),
                m.dst_row,
                rows,
                self._put,
            )
            for modality, m in host.items()
        }

    def merge(
        self, input_ids: torch.Tensor, maps: dict[str, MergeMap], eager: bool = False
    ) -> torch.Tensor:
        """[T, hidden] input embeddings of one pass (``maps`` from its
        metadata), through the compiled merge unless ``eager``."""
        merge = merge_rows if eager else self._merge
        embeds, extra = merge(
            self.model.embed_input_ids(input_ids),
            self.store.rows,
            tuple(m.src for m in maps.values()),
            tuple(m.dst for m in maps.values()),
        )
        if extra is not None and any(m.num_real for m in maps.values()):
            self._feed_deepstack(extra)
        return embeds

    def _feed_deepstack(self, extra: torch.Tensor) -> None:
        """Hand the pass's deep-stack features [T, L * H] to the model (Qwen3-VL
        reads them in its forward from a buffer its own ``embed_input_ids``
        would fill, and clears it after)."""
        t = extra.shape[0]
        levels = extra.view(t, self.deepstack_levels, self.hidden).transpose(0, 1)
        self.model._set_deepstack_input_embeds(levels)


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
