"""The memory profile that sizes the KV cache: one step at the largest shapes.

``profile_peak_activation_bytes`` runs, inside one measurement:

1. the encoder at its largest items-per-batch bucket: LLaVA-style models on
   vLLM's own dummy items (``MultiModalBudget``), Mllama on zero tiles encoded
   into the cross-attention cache (the cache itself is allocated at load time,
   so it is already in use when the profile starts). The encoder's outputs
   stay alive while the body runs, as the encoder cache keeps them in a step;
2. the model body at the largest prefill bucket with real attention metadata:
   prefill requests whose last chunks fill the bucket and whose contexts reach
   ``max_model_len``, so the prefill mask and scores (``[T, K]``, K the context
   keys) are the largest a step makes. Their KV is written into a scratch KV
   cache of just the blocks they need (block 0 stays the null block), bound to
   the attention layers for the profile and dropped after it. Mllama's token
   rows also read the cross-attention cache: each request of the step reads
   the most images a request may carry, as serving lays them out (the cost
   follows the step, not the number of cache slots);
3. the logits head at the largest batch.

What is measured is the peak above what was allocated when the step began,
by a ``Meter``: on HPU/CUDA the device allocator's peak (``device.py``);
elsewhere ``LiveTensorBytes``, which follows every tensor the step allocates
(through a ``TorchDispatchMode``) until it is freed.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm.forward_context import set_forward_context
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.utils import bind_kv_cache_to_layers, clear_layer_kv_caches

from vllm_hpu_mm import device as dev
from vllm_hpu_mm.attention.metadata import StepShape, build_metadata
from vllm_hpu_mm.bucketing.buckets import smallest_fit
from vllm_hpu_mm.worker.kv_cache import kv_cache_specs, new_kv_cache
from vllm_hpu_mm.worker.pipeline import empty_intermediate

if TYPE_CHECKING:
    from vllm_hpu_mm.worker.cross_attention import CrossAttentionInputs
    from vllm_hpu_mm.worker.model_runner import HpuMMModelRunner

Meter = Callable[[Callable[[], object]], int]
"""Runs a callable; returns the peak bytes it allocated above its start."""


# ---- measuring ---------------------------------------------------------------------


@dataclass
class _Tally:
    live: int = 0
    peak: int = 0
    holders: dict[int, int] = field(default_factory=dict)  # address -> tensors
    nbytes: dict[int, int] = field(default_factory=dict)


# Stays in the package (issue 30 asked to move it out with the test tools): it is
# the CPU meter of the KV-cache-sizing profile (``default_meter`` -> ``tensor_meter``),
# run at every CPU engine start, where no allocator keeps a peak (torch's CPU
# allocator has no memory_stats). torch's nearest equivalent,
# torch.distributed._tools.mem_tracker.MemTracker, is private API.
class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated while the mode is on, and their
    peak while alive.

    Every op's output whose storage is not one of its inputs' is a new
    allocation of ``storage.nbytes()``; views and in-place results share the
    storage and add nothing. A storage counts as freed when the last tensor
    seen holding it is garbage collected (``weakref.finalize``).

    A mode is off while its handler runs, so what a custom op allocates inside
    would go unseen: an op made with ``torch.library.custom_op`` (such as
    ``hpu_mm::cross_attention``) runs its Python body here under a nested mode
    counting into the same tally; vLLM's attention op is called directly
    during the profile (``_direct_attention``); any other custom op counts its
    outputs only."""

    def __init__(self, tally: _Tally | None = None) -> None:
        super().__init__()
        self._tally = tally or _Tally()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` trace while the mode is on. Dynamo skips a
        frame it first meets under a mode that says False here, and marks the
        frame's code to be skipped for good (``ConvertFrameReturn``'s default
        strategy): a layer first called inside the memory profile would then
        run eagerly forever, and its graphs would never be built or counted."""
        return True

    @property
    def live(self) -> int:
        return self._tally.live

    @property
    def peak(self) -> int:
        return self._tally.peak

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        body = _custom_op_body(func)
        if body is None:
            out = func(*args, **(kwargs or {}))
        else:
            with LiveTensorBytes(self._tally):
                out = body(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        tally = self._tally
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        if key not in tally.holders:
            if key in inputs:
                return  # a view of (or written into) memory from before the step
            tally.holders[key], tally.nbytes[key] = 0, nbytes
            tally.live += nbytes
            tally.peak = max(tally.peak, tally.live)
        tally.holders[key] += 1
        weakref.finalize(t, _release, tally, key)


def _custom_op_body(func: Any) -> Callable[..., Any] | None:
    """The Python function behind a ``torch.library.custom_op`` (else None)."""
    if func.namespace in ("aten", "prim", "prims"):
        return None
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(func)
    return None if opdef is None else opdef._init_fn


@contextlib.contextmanager
def _direct_attention(layers: dict[str, Any]) -> Iterator[None]:
    """vLLM's attention layers call their backend directly, not through the
    opaque ``vllm::unified_attention_with_output`` op (same computation; eager
    only), so that a dispatch-mode meter sees what attention allocates."""
    changed = [
        layer
        for layer in layers.values()
        if getattr(layer, "use_direct_call", True) is False
    ]
    for layer in changed:
        layer.use_direct_call = True
    try:
        yield
    finally:
        for layer in changed:
            layer.use_direct_call = False


def _release(tally: _Tally, key: int) -> None:
    tally.holders[key] -= 1
    if tally.holders[key] == 0:
        del tally.holders[key]
        tally.live -= tally.nbytes.pop(key)


def tensor_meter(run: Callable[[], object]) -> int:
    """Peak bytes of the tensors ``run`` allocates (any device, no allocator)."""
    with LiveTensorBytes() as live:
        run()
    return live.peak


def device_meter(run: Callable[[], object]) -> int:
    """Peak bytes above the start, from the device allocator's statistics."""
    dev.synchronize()
    dev.reset_peak_memory()
    start = dev.allocated_memory_bytes()
    run()
    dev.synchronize()
    return max(dev.peak_memory_bytes() - start, 0)


def default_meter() -> Meter:
    return tensor_meter if dev.device_kind() == "cpu" else device_meter


# ---- the profiled step ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProfileShape:
    """The sizes of the profiled step."""

    num_tokens: int  # prefill token rows: the largest prefill bucket
    context_len: int  # context of each prefill request, this chunk included
    prefill_blocks: int  # context blocks of the step (padded to a block bucket)
    encoder_items: int  # items per encoder batch (0: no encoder)
    logits_rows: int  # rows of the logits head: the largest batch


def largest_shape(runner: HpuMMModelRunner) -> ProfileShape:
    """The largest step serving can run: largest token, block and batch
    buckets (vLLM's limits when bucketing is off), largest encoder bucket."""
    sc = runner.vllm_config.scheduler_config
    max_len = runner.model_config.max_model_len
    buckets = runner.shapes.buckets
    num_tokens = buckets.tokens[-1] if buckets else sc.max_num_batched_tokens
    blocks = _context_blocks(num_tokens, max_len, runner.block_size)
    if buckets is not None:
        blocks = smallest_fit(blocks, buckets.prefill_blocks) or blocks
    encoder_items = 0
    if runner.mm is not None:
        encoder_items = runner.mm.encoder.item_buckets[-1]
    elif runner.cross is not None:
        encoder_items = runner.cross.item_buckets[-1]
    return ProfileShape(
        num_tokens=num_tokens,
        context_len=max_len,
        prefill_blocks=blocks,
        encoder_items=encoder_items,
        logits_rows=buckets.batch[-1] if buckets else sc.max_num_seqs,
    )


def _query_lens(num_tokens: int, context_len: int) -> np.ndarray:
    """The step's tokens as requests of at most ``context_len`` new tokens."""
    n = math.ceil(num_tokens / context_len)
    q = np.full(n, num_tokens // n, np.int64)
    q[: num_tokens % n] += 1
    return q


def _context_blocks(num_tokens: int, context_len: int, block_size: int) -> int:
    requests = _query_lens(num_tokens, context_len).size
    return requests * math.ceil(max(context_len, 1) / block_size)


def _prefill_metadata(runner: HpuMMModelRunner, shape: ProfileShape) -> Any:
    """Metadata of prefill requests whose chunks end their ``context_len``
    contexts, laid out in scratch blocks 1.. (0 is the null block)."""
    bs = runner.block_size
    q = _query_lens(shape.num_tokens, shape.context_len)
    seq = np.maximum(q, shape.context_len)
    per_req = math.ceil(int(seq.max()) / bs)
    table = 1 + np.arange(q.size * per_req, dtype=np.int64).reshape(q.size, per_req)
    slots = [
        table[r, pos // bs] * bs + pos % bs
        for r in range(q.size)
        for pos in range(int(seq[r] - q[r]), int(seq[r]))
    ]
    real_blocks = int(np.ceil(seq / bs).sum())
    step = StepShape(
        num_decodes=0,
        decode_blocks=0,
        num_prefill_tokens=shape.num_tokens,
        prefill_blocks=max(shape.prefill_blocks, real_blocks),
    )
    md = build_metadata(
        q,
        seq,
        table,
        np.asarray(slots, np.int64),
        bs,
        step,
        runner.device,
        kind=runner.plan.attention_metadata,
    )
    return md, 1 + q.size * per_req


def _scratch_kv_cache(runner: HpuMMModelRunner, num_blocks: int) -> dict[str, Any]:
    """Zeroed caches of ``num_blocks`` blocks for the profile."""
    caches: dict[str, Any] = {}
    for name, spec in kv_cache_specs(runner.vllm_config).items():
        assert isinstance(spec, AttentionSpec)
        caches[name] = new_kv_cache(spec, num_blocks, runner.device)
    return caches


def _run_encoder(runner: HpuMMModelRunner, items: int) -> list[torch.Tensor]:
    """The encoder on ``items`` dummy items; its outputs (kept by the caller)."""
    if items == 0:
        return []
    if runner.cross is not None:
        _encode_cross_images(runner.cross, items)
        return []
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    mm = runner.mm
    assert mm is not None
    budget = MultiModalBudget(runner.vllm_config, MULTIMODAL_REGISTRY)
    outputs: list[torch.Tensor] = []
    for modality in budget.mm_max_toks_per_item:
        dummy = budget.get_dummy_encoder_profile_inputs(modality, items)
        for _, n, kwargs in group_and_batch_mm_kwargs(dummy, device=runner.device):
            outputs.extend(mm.encoder(n, kwargs))
    return outputs


def _encode_cross_images(cross: CrossAttentionInputs, items: int) -> None:
    """``items`` images of zero tiles through the vision encoder into the
    cross-attention cache's slots 1..items (unowned before serving starts)."""
    side = cross.model.vision.tile_size
    dtype, device = cross.inputs["pixel_values"].dtype, cross.device
    cross.encode(
        {
            "pixel_values": torch.zeros(
                items, cross.tiles, 3, side, side, dtype=dtype, device=device
            ),
            "aspect_ratio_ids": torch.ones(items, dtype=torch.int64, device=device),
            "aspect_ratio_mask": torch.ones(
                items, cross.tiles, dtype=torch.int64, device=device
            ),
        },
        list(range(1, items + 1)),
    )


def _cross_metadata(cross: CrossAttentionInputs, query_lens: np.ndarray) -> Any:
    """Every prefill request of the step reads the most images a request
    carries, every tile, laid out as serving lays it out: one request at a
    time off Gaudi, the flat ``[T, requests x images]`` columns on Gaudi. The
    cost follows the step's requests, not the cache's slots (a step's
    requests read only their own images)."""
    from vllm_hpu_mm.attention.cross import CrossAttentionMetadata
    from vllm_hpu_mm.worker.cross_attention import cross_request

    m, tiles, device = cross.max_images, cross.tiles, cross.device
    images = [1 + i % cross.capacity for i in range(m)]  # slots 1.., written above
    t = int(query_lens.sum())
    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
    requests = None
    cols = 0 if cross.per_request else _next_pow2(len(query_lens) * m)
    pre_slots = torch.zeros(cols, dtype=torch.int64, device=device)
    pre_mask = torch.zeros(t, cols, tiles, dtype=torch.bool, device=device)
    if cross.per_request:
        requests = [
            cross_request(
                int(start),
                images,
                np.ones((int(q), m, tiles), bool),
                cross.rows,
                cross.patches,
                device,
            )
            for start, q in zip(starts, query_lens, strict=True)
        ]
    else:
        for r, (start, q) in enumerate(zip(starts, query_lens, strict=True)):
            pre_slots[r * m : (r + 1) * m] = torch.tensor(images, device=device)
            pre_mask[start : start + q, r * m : (r + 1) * m] = True
    ones = torch.ones(t, 1, dtype=torch.float32, device=device)
    return CrossAttentionMetadata(
        dec_slots=torch.zeros(0, m, dtype=torch.int64, device=device),
        dec_tile_mask=torch.zeros(0, m, tiles, dtype=torch.bool, device=device),
        pre_slots=pre_slots,
        pre_tile_mask=pre_mask,
        active=ones,
        mlp_scale=ones.clone(),
        patches=cross.patches,
        pre_requests=requests,
    )


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _run_step(runner: HpuMMModelRunner, shape: ProfileShape, md: Any) -> None:
    model: Any = runner.get_model()
    t = shape.num_tokens
    ids = torch.zeros(t, dtype=torch.int64, device=runner.device)
    positions = torch.from_numpy(runner.zero_positions(t)).to(runner.device)
    kept = _run_encoder(runner, shape.encoder_items)
    embeds = None
    if runner.mm is not None:  # multimodal models run on merged embeddings
        runner.mm.attach_maps(md, [])
        embeds = runner.mm.merge(ids, md.mm_maps, eager=True)
    if runner.cross is not None:
        q = _query_lens(shape.num_tokens, shape.context_len)
        md.cross = _cross_metadata(runner.cross, q)
    with set_forward_context(md, runner.vllm_config, num_tokens=t):
        if not runner.stage.is_first:  # a later pipeline stage's input
            dtype: torch.dtype = runner.model_config.dtype  # type: ignore[assignment]
            hidden = model(
                input_ids=ids,
                positions=positions,
                intermediate_tensors=empty_intermediate(model, t, dtype, ids.device),
            )
        elif embeds is None:
            hidden = model(input_ids=ids, positions=positions)
        else:
            hidden = model(input_ids=None, positions=positions, inputs_embeds=embeds)
    if runner.stage.is_last:
        model.compute_logits(hidden[: shape.logits_rows])
    dev.mark_step()  # HPU lazy mode: run the accumulated graph inside the meter
    del kept


@torch.inference_mode()
def profile_peak_activation_bytes(
    runner: HpuMMModelRunner,
    meter: Meter | None = None,
    shape: ProfileShape | None = None,
) -> int:
    """Peak bytes of the profiled step (see the module docstring) above what
    was allocated before it; the scratch KV cache is not part of it."""
    shape = shape or largest_shape(runner)
    md, num_blocks = _prefill_metadata(runner, shape)
    caches = _scratch_kv_cache(runner, num_blocks)
    layers = runner.vllm_config.compilation_config.static_forward_context
    bind_kv_cache_to_layers(caches, layers)
    try:
        with _direct_attention(layers):
            return (meter or default_meter())(lambda: _run_step(runner, shape, md))
    finally:
        clear_layer_kv_caches(layers[name] for name in caches)
        del caches
        dev.empty_cache()
