"""The runner's cross-attention part (Mllama): encode each image once, cache its K/V.

When a request arrives, every one of its images is encoded (vision encoder +
projector, batched and padded to an images-per-batch bucket, compiled once per
bucket in graph mode) and each cross-attention layer's K/V of the image is stored
in a slot of the cross-attention cache. Images are keyed by vLLM's item hash: a
second request with the same image (or a resumed one) reuses the slot, and
unreferenced slots stay filled until they are needed (least recently used first),
so a repeated image is not encoded again. The cache has as many slots as
``hpu_mm.memory.cross_attention_cache_gib`` holds (``models.mllama.
cache_budget``); vLLM's scheduler admits a request only when its images fit
(``models.mllama.scheduling``), so a new image always finds a free or idle slot.

Nothing is copied between the vision layers and the cache: eagerly the encoder
writes into one preallocated ``encoder_states`` buffer sized for the largest
bucket (a bucket of ``n`` images uses its first ``n`` rows, a view); in graph
mode the compiled encoder produces it as its graph's output. The projector
reads it whole, padding rows included, and the cache keeps the padded rows
(``tiles * rows_per_tile`` per image; the kernels never read the padding rows).
The encoder's inputs are copied into preallocated bucket inputs (cast to the
model's dtype on the way); padding entries keep earlier, valid inputs.

Per step, ``metadata`` says which slots and tiles each token row reads, following
transformers' rule: a token reads the latest group of consecutive images at or
before it (a group of adjacent ``<|image|>`` tokens reads on to the end); a token
before the request's first image reads every row of every image of the request,
padding tiles included, and its cross-attention MLP output is zeroed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.multimodal.utils import group_and_batch_mm_kwargs

from hpu_kernels.cross_attention import CrossRequest, new_cross_cache
from vllm_hpu_mm import metrics
from vllm_hpu_mm.attention.cross import CrossAttentionMetadata
from vllm_hpu_mm.bucketing.buckets import exponential, smallest_fit
from vllm_hpu_mm.models.mllama.cache_budget import SLOTS_KEY, CrossCacheGeometry
from vllm_hpu_mm.worker.graphs import GraphRunner
from vllm_hpu_mm.worker.inputs import StepBatch
from vllm_hpu_mm.worker.requests import RequestState

logger = logging.getLogger("vllm.hpu_mm.cross_attention")

NULL_SLOT = 0


@dataclass(frozen=True, slots=True)
class RequestImage:
    key: str  # vLLM's item hash
    offset: int  # position of the image's <|image|> token (its placeholder's last)
    num_tiles: int  # real tiles; the rest of the max tiles are padding


class ImageSlots:
    """Cache slots by image key, reference-counted, evicting the least recently
    used unreferenced slot when a new image needs one. Slot 0 is never handed out."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity, 0, -1))
        self.slot: dict[str, int] = {}
        self.refs: dict[str, int] = {}
        self.idle: OrderedDict[str, None] = OrderedDict()  # unreferenced, LRU first

    def acquire(self, key: str) -> tuple[int, bool]:
        """(slot, True if the image must be encoded into it)."""
        if key in self.slot:
            self.refs[key] += 1
            self.idle.pop(key, None)
            return self.slot[key], False
        if not self.free:
            if not self.idle:
                raise RuntimeError(
                    f"cross-attention cache full: each of its {len(self.slot)} "
                    "slots holds an image of a running request (the scheduler's "
                    "SlotLedger admits only requests whose images fit)"
                )
            old, _ = self.idle.popitem(last=False)
            self.free.append(self.slot.pop(old))
            del self.refs[old]
        slot = self.free.pop()
        self.slot[key], self.refs[key] = slot, 1
        return slot, True

    def release(self, key: str) -> None:
        if self.refs.get(key, 0) <= 0:
            raise RuntimeError(f"image {key!r} released more often than acquired")
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.idle[key] = None

    def forget(self, key: str) -> None:
        """Drop an image whose encoding failed: its slot holds nothing valid."""
        self.idle.pop(key, None)
        self.refs.pop(key, None)
        self.free.append(self.slot.pop(key))

    def drop_idle(self) -> list[str]:
        """Free every slot no running request holds; the images dropped."""
        dropped = list(self.idle)
        for key in dropped:
            self.forget(key)
        return dropped

    def __len__(self) -> int:
        return len(self.slot)


def image_groups(offsets: list[int]) -> list[tuple[int, float]]:
    """[start, end) positions whose tokens read each image (end inf: to the end).

    An image is read from its own token up to the next image's token; images
    whose tokens are adjacent form a group that is read until the group after.
    """
    n = len(offsets)
    ends: list[float] = [float(offsets[i + 1]) for i in range(n - 1)] + [float("inf")]
    for i in range(n - 2, -1, -1):
        if offsets[i] == ends[i] - 1:  # the next image follows at once
            ends[i] = ends[i + 1]
    return [(offsets[i], ends[i]) for i in range(n)]


def tile_mask(
    images: list[RequestImage], positions: np.ndarray, tiles: int
) -> tuple[np.ndarray, np.ndarray]:
    """([P, M, tiles] bool tiles read, [P] bool row masked out) for the positions."""
    m = len(images)
    groups = image_groups([im.offset for im in images])
    start = np.array([g[0] for g in groups], np.float64)
    end = np.array([g[1] for g in groups], np.float64)
    pos = positions.astype(np.float64)[:, None]
    reads = (pos >= start) & (pos < end)  # [P, M]
    real_tiles = (
        np.arange(tiles)[None, :] < np.array([im.num_tiles for im in images])[:, None]
    )
    mask = reads[:, :, None] & real_tiles[None, :, :]
    masked_out = ~reads.any(axis=1)
    mask[masked_out] = True  # before the first image: every row of every image
    return mask.reshape(len(positions), m, tiles), np.asarray(masked_out)


def cross_request(
    start: int,
    slots: list[int],
    mask: np.ndarray,
    rows: int,
    patches: int,
    device: torch.device,
) -> CrossRequest:
    """A prefill request for ``cross_attention_requests``: the cache rows it
    reads (the real rows of every tile of each of its images in ``slots``,
    padding tiles too, which its rows before the first image read) and its
    ``[rows, keys]`` mask from ``mask`` ([q, images, tiles], ``tile_mask``),
    None where every row reads every key. ``rows``: cache rows of an image
    (tiles x padded rows); ``patches``: real rows of a tile."""
    q, n, tiles = mask.shape
    padded = rows // tiles
    tile_rows = (np.arange(tiles)[:, None] * padded + np.arange(patches)).reshape(-1)
    key_rows = (np.asarray(slots, np.int64)[:, None] * rows + tile_rows).reshape(-1)
    wide = np.repeat(mask.reshape(q, n * tiles), patches, axis=1)
    return CrossRequest(
        start=start,
        length=q,
        key_rows=torch.from_numpy(key_rows).to(device),
        mask=None if wide.all() else torch.from_numpy(wide).to(device),
    )


def _bucket_inputs(
    vision: Any, size: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The encoder's inputs for ``size`` images, allocated once: entries past a
    batch's images are padding, holding earlier images or these valid defaults."""
    side, tiles = vision.tile_size, vision.tiles
    return {
        # [size, tiles, 3, side, side], in the model's dtype
        "pixel_values": torch.zeros(
            size, tiles, 3, side, side, dtype=dtype, device=device
        ),
        "aspect_ratio_ids": torch.ones(size, dtype=torch.int64, device=device),
        "aspect_ratio_mask": torch.ones(size, tiles, dtype=torch.int64, device=device),
    }


def configured_slots(vllm_config: Any) -> int:
    """The cache's image slots, as the platform sized them for the scheduler
    (``platform_config._size_cross_attention_cache``): both must agree."""
    ec = getattr(vllm_config, "ec_manager_config", None)
    slots = (getattr(ec, "manager_config", None) or {}).get(SLOTS_KEY)
    if slots is None:
        raise RuntimeError(
            "Mllama's cross-attention cache has no size: the platform's "
            f"check_and_update_config sets ec_manager_config.manager_config"
            f"[{SLOTS_KEY!r}] (got {ec!r})"
        )
    return int(slots)


def _check_slot_bytes(vllm_config: Any, allocated: int) -> None:
    """Warn when a slot's bytes differ from the sizing function's (the budget
    would then be counted wrong)."""
    mc = vllm_config.model_config
    sized = CrossCacheGeometry.from_hf_config(
        mc.hf_config,
        mc.dtype.itemsize,
        vllm_config.parallel_config.tensor_parallel_size,
    ).slot_bytes
    if sized != allocated:
        logger.warning(
            "Cross-attention cache: a slot takes %d bytes, the budget counted %d",
            allocated,
            sized,
        )


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class CrossAttentionInputs:
    def __init__(
        self,
        model: Any,
        vllm_config: Any,
        device: torch.device,
        graphs: GraphRunner,
        max_images_per_prompt: int,
    ) -> None:
        self.model = model
        self.device = device
        vision = model.vision
        self.tiles = vision.tiles
        self.patches = vision.num_patches  # real rows of a tile
        self.rows = vision.tiles * vision.padded  # cache rows of an image
        self.max_images = max_images_per_prompt
        capacity = configured_slots(vllm_config)
        self.capacity = capacity
        self.slots = ImageSlots(capacity)
        dtype = vllm_config.model_config.dtype
        for layer in model.cross_attention_layers():
            # K and V allocated apart, written in place (``CrossCache``)
            layer.cache = new_cross_cache(
                capacity + 1, self.rows, layer.num_kv_heads, layer.head_dim,
                dtype, device,
            )  # fmt: skip
        self.item_buckets = exponential(1, max(1, min(8, capacity)))
        most = self.item_buckets[-1]
        self.inputs = _bucket_inputs(vision, most, device, dtype)
        # Eager: the buffer the encoder fills. Graph mode: the graph makes it.
        self.encoder_states: torch.Tensor | None = None
        self._encode = model.encode_images
        # Where the decoder's graphs take a symbolic token count (the CPU and
        # CUDA), the encoder's takes a symbolic image count: a step's images
        # are encoded as they are, not padded to the next bucket (3 -> 4,
        # 5 -> 8), and warmup compiles two graphs (one image; any more).
        self.symbolic_items = graphs.plan.symbolic_tokens
        # The dynamic plan off Gaudi: the prefill rows attend request by
        # request, to their own images' rows only; the static plan keeps the
        # flat layout (a request's key count is a shape: a graph each).
        self.per_request = graphs.plan.per_request_cross
        if graphs.mode != "compile":
            self.encoder_states = vision.new_states(most, device, dtype)
        else:
            self._encode = torch.compile(
                model.encode_images,
                backend=graphs.counter,
                dynamic=None if self.symbolic_items else False,
            )
        # Every rank encodes every image: one of them counts the runs.
        self.counts_metrics = metrics.counts_items_here()
        self.images: dict[str, list[RequestImage]] = {}  # request -> its images
        self.num_tiles: dict[str, int] = {}  # image key -> its real tiles
        cache_bytes = sum(
            layer.cache.nbytes() for layer in model.cross_attention_layers()
        )
        _check_slot_bytes(vllm_config, cache_bytes // (capacity + 1))
        cache_mib = cache_bytes / 2**20
        logger.info(
            "Cross-attention cache: %d image slots x %d rows, %.1f MiB; "
            "encoder_states %s",
            capacity,
            self.rows,
            cache_mib,
            "made by the compiled encoder"
            if self.encoder_states is None
            else f"buffer {tuple(self.encoder_states.shape)}",
        )

    # ---- requests come and go ------------------------------------------------------
    def update(self, scheduler_output: Any, requests: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._release(req_id)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._release(req_id)
        pending: dict[str, tuple[int, Any]] = {}
        arriving = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        arriving += [r for r in cached.req_ids if r in cached.resumed_req_ids]
        for req_id in arriving:
            if req_id in self.images:
                continue
            state: RequestState = requests[req_id]
            feats = sorted(
                (f for f in state.mm_features if f.modality == "image"),
                key=lambda f: f.mm_position.offset,
            )
            if len(feats) > self.max_images:
                raise ValueError(
                    f"request {req_id}: {len(feats)} images, the plugin's "
                    f"cross-attention cache holds {self.max_images} per request"
                )
            images = []
            for f in feats:
                slot, new = self.slots.acquire(f.identifier)
                if f.data is not None:
                    self.num_tiles[f.identifier] = int(f.data["num_tiles"].data)
                if new:
                    if f.data is None:
                        self.slots.forget(f.identifier)
                        raise RuntimeError(
                            f"request {req_id}: image {f.identifier} is neither "
                            "cached nor sent with its pixels"
                        )
                    pending[f.identifier] = (slot, f.data)
                pos = f.mm_position.offset + f.mm_position.length - 1
                images.append(
                    RequestImage(f.identifier, pos, self.num_tiles[f.identifier])
                )
            self.images[req_id] = images
        if pending:
            self._encode_pending(pending)
        if self.counts_metrics:
            metrics.ENCODER_CACHE_ITEMS.set(len(self.slots))

    def reset(self) -> int:
        """Forget the cached images no running request holds (stale after a
        weight update), so they are encoded again; how many were dropped."""
        dropped = self.slots.drop_idle()
        for key in dropped:
            self.num_tiles.pop(key, None)
        metrics.ENCODER_CACHE_ITEMS.set(len(self.slots))
        return len(dropped)

    def _release(self, req_id: str) -> None:
        for im in self.images.pop(req_id, ()):
            self.slots.release(im.key)

    def _encode_pending(self, pending: dict[str, tuple[int, Any]]) -> None:
        keys = list(pending)
        try:
            items = [("image", pending[k][1]) for k in keys]
            done = 0
            for _, num, kwargs in group_and_batch_mm_kwargs(items, device=self.device):
                step = self.item_buckets[-1]
                for start in range(0, num, step):
                    n = min(step, num - start)
                    batch_keys = keys[done : done + n]
                    slots = [pending[k][0] for k in batch_keys]
                    self.encode(
                        {k: v[start : start + n] for k, v in kwargs.items()},  # type: ignore[misc]
                        slots,
                    )
                    done += n
        except BaseException:
            for k in keys:
                self.slots.forget(k)
            raise
        if self.counts_metrics:
            metrics.ENCODER_RUNS.inc(len(keys))

    def encode(self, kwargs: dict[str, torch.Tensor], slots: list[int]) -> None:
        """Encode n images (padded to their bucket) into their cache slots."""
        n = len(slots)
        size = n if self.symbolic_items else smallest_fit(n, self.item_buckets) or n
        for name, buf in self.inputs.items():
            buf[:n].copy_(kwargs[name])  # host or device, any dtype -> the buffer's
        states = self._run_encoder(size)
        slot_ids = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.model.write_cross_kv(states[:n], slot_ids)

    def _run_encoder(self, size: int) -> torch.Tensor:
        """[size, tiles * padded rows, text hidden] of the first ``size`` inputs."""
        i = self.inputs
        buf = None if self.encoder_states is None else self.encoder_states[:size]
        return self._encode(
            i["pixel_values"][:size],
            i["aspect_ratio_ids"][:size],
            i["aspect_ratio_mask"][:size],
            buf,
        )

    def warm_up(self) -> int:
        """Run every images-per-batch bucket once (a symbolic image count:
        one image, then two, which make the two graphs that serve every
        count). Returns the number of shapes run."""
        sizes = self.item_buckets[:2] if self.symbolic_items else self.item_buckets
        for size in sizes:
            self._run_encoder(size)
        return len(sizes)

    # ---- per step ------------------------------------------------------------------
    def metadata(
        self, batch: StepBatch, states: list[RequestState]
    ) -> CrossAttentionMetadata:
        shape = batch.shape
        n_dec_pad, n_pre_pad = shape.num_decodes, shape.num_prefill_tokens
        tiles, m = self.tiles, self.max_images
        dec_slots = np.zeros((n_dec_pad, m), np.int64)
        dec_mask = np.zeros((n_dec_pad, m, tiles), bool)
        active = np.zeros(shape.num_tokens, np.float32)
        mlp_scale = np.ones(shape.num_tokens, np.float32)
        pre_cols: list[int] = []
        pre_rows: list[tuple[int, int, np.ndarray]] = []  # (row, first col, mask)
        for i, (state, q, row) in enumerate(
            zip(states, batch.query_lens, batch.row_starts, strict=True)
        ):
            images = self.images.get(state.req_id)
            if not images:
                continue
            q, row = int(q), int(row)
            positions = state.num_computed_tokens + np.arange(q)
            mask, masked_out = tile_mask(images, positions, tiles)
            active[row : row + q] = 1.0
            mlp_scale[row : row + q] = np.where(masked_out, 0.0, 1.0)
            slots = [self.slots.slot[im.key] for im in images]
            if row < n_dec_pad and q == 1 and i < n_dec_pad:
                dec_slots[row, : len(slots)] = slots
                dec_mask[row, : len(slots)] = mask[0]
            else:
                pre_rows.append((row - n_dec_pad, len(pre_cols), mask))
                pre_cols.extend(slots)
        requests: list[CrossRequest] | None = None
        if self.per_request:  # the flat layout stays empty
            requests = [
                cross_request(
                    r,
                    pre_cols[c : c + m.shape[1]],
                    m,
                    self.rows,
                    self.patches,
                    self.device,
                )
                for r, c, m in pre_rows
            ]
            pre_cols, pre_rows = [], []
        n = _next_pow2(len(pre_cols)) if pre_cols else 0
        pre_slots = np.zeros(n, np.int64)
        pre_slots[: len(pre_cols)] = pre_cols
        pre_mask = np.zeros((n_pre_pad, n, tiles), bool)
        for r, c, mask in pre_rows:
            pre_mask[r : r + mask.shape[0], c : c + mask.shape[1]] = mask

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        return CrossAttentionMetadata(
            dec_slots=t(dec_slots),
            dec_tile_mask=t(dec_mask),
            pre_slots=t(pre_slots),
            pre_tile_mask=t(pre_mask),
            # [T, 1] with the strides of a fresh [T, 1] tensor: compiled code
            # guards on strides, size-1 dims included (numpy's [:, None] has
            # stride 0 there), and warmup builds these with torch.zeros.
            active=t(active).unsqueeze(1),
            mlp_scale=t(mlp_scale).unsqueeze(1),
            patches=self.patches,
            pre_requests=requests,
        )
