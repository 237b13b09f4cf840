"""How many images Mllama's cross-attention cache holds, and who may use them.

Each cached image (a *slot*) keeps every cross-attention layer's K and V of
the image: ``2 x layers x rows x kv heads x head dim`` elements, ``rows`` the
vision encoder's padded rows (``max_num_tiles x rows_per_tile``). At
Llama-3.2-11B-Vision shapes in bfloat16 that is about 211 MB a slot, so one
slot per possible image (``max_num_seqs x images per prompt``) does not fit a
card. The cache is a byte budget instead (``hpu_mm.memory.
cross_attention_cache_gib``): as many slots as fit in it, never more than the
old one-per-possible-image count.

``SlotLedger`` is the scheduler's side of the budget: a request is admitted
only if the distinct images of the requests it holds plus its own fit in the
slots. The worker's slots (``worker.cross_attention.ImageSlots``) then always
find a slot: they hold only what the ledger holds, and evict idle images
(least recently used first) to make room.

Pure Python over ints and strings: nothing from torch or vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GIB = 2**30
SLOTS_KEY = "cross_attention_slots"  # vLLM's ec_manager_config.manager_config


def rows_per_tile(num_patches: int) -> int:
    """Rows a tile occupies in the encoder: patches + CLS, padded to 8 (as
    ``models.mllama.vision.rows_per_tile``)."""
    return num_patches + (8 - num_patches % 8) % 8


@dataclass(frozen=True, slots=True)
class CrossCacheGeometry:
    """The shape of one cached image, on one tensor-parallel rank."""

    layers: int  # cross-attention layers
    rows: int  # cache rows of an image: max tiles x padded rows of a tile
    kv_heads: int  # KV heads of this rank (the model's / tensor parallel size)
    head_dim: int
    dtype_bytes: int  # 2 for bfloat16, 4 for float32

    @property
    def slot_bytes(self) -> int:
        """Bytes of one image slot over all cross-attention layers, K and V."""
        return (
            2 * self.layers * self.rows * self.kv_heads * self.head_dim
        ) * self.dtype_bytes

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, dtype_bytes: int, tensor_parallel: int = 1
    ) -> CrossCacheGeometry:
        text, vision = hf_config.text_config, hf_config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        return cls(
            layers=len(text.cross_attention_layers),
            rows=int(vision.max_num_tiles) * rows_per_tile(patches),
            kv_heads=kv_heads // tensor_parallel,
            head_dim=int(text.hidden_size) // heads,
            dtype_bytes=dtype_bytes,
        )


@dataclass(frozen=True, slots=True)
class CrossCachePlan:
    """The cache's size, decided once at start-up from the config."""

    geometry: CrossCacheGeometry
    wanted: int  # one slot per possible image: max_num_seqs x images per prompt
    slots: int  # what the budget allows: min(wanted, budget // slot), at least 1
    budget_bytes: int

    @property
    def bytes(self) -> int:
        return self.slots * self.geometry.slot_bytes

    @property
    def wanted_bytes(self) -> int:
        """What one slot per possible image (the old sizing) would allocate."""
        return self.wanted * self.geometry.slot_bytes

    def describe(self) -> str:
        g = self.geometry
        return (
            f"{self.slots} image slots x {g.slot_bytes / 2**20:.1f} MiB "
            f"({g.layers} layers x K,V x {g.rows} rows x {g.kv_heads} KV heads x "
            f"{g.head_dim}) = {self.bytes / GIB:.2f} GiB of the "
            f"{self.budget_bytes / GIB:.2f} GiB budget; one slot per possible "
            f"image would be {self.wanted} slots, {self.wanted_bytes / GIB:.2f} GiB"
        )


def plan_cross_cache(
    geometry: CrossCacheGeometry,
    max_num_seqs: int,
    images_per_prompt: int,
    budget_bytes: int,
) -> CrossCachePlan:
    """As many slots as the budget holds, never more than one per possible
    image (``max_num_seqs x images_per_prompt``), and at least one."""
    wanted = max(1, max_num_seqs * images_per_prompt)
    fits = budget_bytes // geometry.slot_bytes
    return CrossCachePlan(
        geometry=geometry,
        wanted=wanted,
        slots=max(1, min(wanted, fits)),
        budget_bytes=budget_bytes,
    )


class SlotLedger:
    """The scheduler's count of the slots its requests hold, by image key.

    A request holds one slot per distinct image (a request or two requests
    with the same image share its slot). ``admit`` takes the request's slots
    if the images held by all admitted requests still fit, else refuses and
    changes nothing; ``release`` gives them back (finished, aborted or
    preempted). Idle images the worker keeps cached are not counted: the
    worker evicts them when it needs their slots."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cross-attention cache needs >= 1 slot, got {capacity}")
        self.capacity = capacity
        self.held: dict[str, frozenset[str]] = {}  # request -> its image keys
        self.refs: Counter[str] = Counter()  # image key -> requests holding it

    def needed(self, keys: Iterable[str]) -> int:
        """Slots a request with these images needs beyond what is held now."""
        return len(set(keys) - self.refs.keys())

    def admit(self, req_id: str, keys: Iterable[str]) -> bool:
        if req_id in self.held:
            return True
        images = frozenset(keys)
        if len(self.refs) + self.needed(images) > self.capacity:
            return False
        self.held[req_id] = images
        self.refs.update(images)
        return True

    def release(self, req_id: str) -> None:
        for key in self.held.pop(req_id, ()):
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key]

    @property
    def used(self) -> int:
        return len(self.refs)
