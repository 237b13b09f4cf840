"""Mllama's cross-attention cache is a byte budget, not a slot per possible image.

- the sizing function (``plan_cross_cache`` through the platform's
  ``cross_cache_plan``) at Llama-3.2-11B-Vision shapes in bfloat16: vLLM's
  default ``max_num_seqs`` (256) and the deploy manifests' (128, Gaudi 2: 64)
  fit the default budget, where one slot per possible image took 54-108 GB;
- the scheduler's ``SlotLedger`` admits a request only when its distinct images
  fit beside the held ones, and the worker's ``ImageSlots`` of the same
  capacity, acquiring only what the ledger admitted, always find a slot
  (evicting idle images, least recently used first);
- ``CrossSlotEncoderCacheManager`` on vLLM's own ``Request``: admission by
  image hash, release on ``free``;
- the platform hands the slot count to the scheduler and the worker, and
  lowers the per-prompt image limit to it (a 400 in the API server);
- the memory profile's cross-attention reads follow the step, not the slots.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import MllamaConfig

from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.models.mllama.cache_budget import (
    GIB,
    CrossCacheGeometry,
    SlotLedger,
    plan_cross_cache,
    rows_per_tile,
)
from vllm_hpu_mm.platform_config import cross_cache_plan
from vllm_hpu_mm.worker.cross_attention import ImageSlots

# Llama-3.2-11B-Vision-Instruct's config.json, the fields the cache depends on.
ELEVEN_B = MllamaConfig(
    text_config={
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 40,
        "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
    },
    vision_config={"image_size": 560, "patch_size": 14, "max_num_tiles": 4},
)
ELEVEN_B.architectures = ["MllamaForConditionalGeneration"]


def vllm_config(max_num_seqs: int, images: int = 2, tp: int = 1) -> Any:
    """The parts of vLLM's config the sizing reads (plain data)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=ELEVEN_B,
            dtype=torch.bfloat16,
            multimodal_config=SimpleNamespace(
                limit_per_prompt={"image": SimpleNamespace(count=images)}
            ),
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def test_11b_slot_is_211_mb_in_bfloat16() -> None:
    g = CrossCacheGeometry.from_hf_config(ELEVEN_B, dtype_bytes=2)
    assert (g.layers, g.rows, g.kv_heads, g.head_dim) == (8, 6432, 8, 128)
    assert g.slot_bytes == 2 * 8 * 6432 * 8 * 128 * 2 == 210_763_776
    assert rows_per_tile(1601) == 1608


@pytest.mark.parametrize(
    ("max_num_seqs", "old_gb"),
    [(256, 107.9), (128, 54.0), (64, 27.0)],
    ids=["vllm_default_256", "deploy_gaudi3_128", "deploy_gaudi2_64"],
)
def test_11b_cache_fits_a_few_gib_at_any_max_num_seqs(
    max_num_seqs: int, old_gb: float
) -> None:
    plan = cross_cache_plan(HpuMMConfig(), vllm_config(max_num_seqs))
    assert plan.wanted == max_num_seqs * 2
    assert plan.wanted_bytes / 1e9 == pytest.approx(old_gb, abs=0.1)  # before
    assert plan.slots == 20  # after: 4 GiB / 211 MB
    assert plan.bytes <= 4 * GIB
    print(plan.describe())


def test_tensor_parallel_splits_the_kv_heads_so_more_images_fit() -> None:
    plan = cross_cache_plan(HpuMMConfig(), vllm_config(256, tp=2))
    assert plan.geometry.kv_heads == 4
    assert plan.slots == 40


def test_budget_never_exceeds_one_slot_per_possible_image_and_keeps_one() -> None:
    g = CrossCacheGeometry(layers=2, rows=96, kv_heads=2, head_dim=16, dtype_bytes=4)
    assert plan_cross_cache(g, 4, 2, budget_bytes=10 * GIB).slots == 8
    assert plan_cross_cache(g, 4, 2, budget_bytes=0).slots == 1
    assert plan_cross_cache(g, 4, 2, budget_bytes=3 * g.slot_bytes + 1).slots == 3


def test_other_models_have_no_plan() -> None:
    vc = vllm_config(8)
    vc.model_config.hf_config = SimpleNamespace(architectures=["LlavaForCausalLM"])
    assert cross_cache_plan(HpuMMConfig(), vc) is None


# ---- admission ---------------------------------------------------------------------


def test_ledger_admits_what_fits_and_shares_repeated_images() -> None:
    ledger = SlotLedger(3)
    assert ledger.admit("r1", ["a", "b"])
    assert ledger.admit("r2", ["b", "b"])  # shares b: no new slot
    assert ledger.used == 2
    assert not ledger.admit("r3", ["c", "d"])  # 2 held + 2 new > 3
    assert ledger.used == 2 and "r3" not in ledger.held  # refused: unchanged
    assert ledger.admit("r4", ["c"])
    assert ledger.admit("r4", ["c"])  # already holding: idempotent
    ledger.release("r1")
    assert ledger.used == 2  # b still held by r2
    assert not ledger.admit("r3", ["c", "d", "e"])
    ledger.release("r2")
    assert ledger.admit("r3", ["c", "d", "e"])
    ledger.release("r3")
    ledger.release("r3")  # a second release changes nothing
    assert ledger.refs == {"c": 1}


def test_worker_slots_always_fit_what_the_ledger_admitted() -> None:
    """Random arrivals and finishes: the worker acquires a request's images
    only after the ledger admitted it, and releases at finish; with the same
    capacity it never runs out, and images seen again hit the cache."""
    rng = random.Random(0)
    capacity = 4
    ledger, worker = SlotLedger(capacity), ImageSlots(capacity)
    running: dict[str, list[str]] = {}
    waiting = 0
    hits = refused = 0
    for step in range(2000):
        if running and rng.random() < 0.45:
            req = rng.choice(sorted(running))
            for key in running.pop(req):
                worker.release(key)
            ledger.release(req)
            continue
        req = f"r{step}"
        keys = [f"img{rng.randrange(8)}" for _ in range(rng.randint(1, 3))]
        if not ledger.admit(req, keys):
            refused += 1
            waiting += 1
            continue
        running[req] = keys
        for key in keys:
            _, new = worker.acquire(key)  # never raises
            hits += not new
        assert len(worker) <= capacity
        assert set(worker.refs) - set(worker.idle) <= set(ledger.refs)
    assert refused > 0 and hits > 0


def _vllm_request(req_id: str, keys: list[str]) -> Any:
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    feats = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=key,
            mm_position=PlaceholderRange(offset=i, length=1),
        )
        for i, key in enumerate(keys)
    ]
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(len(keys) + 2)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=feats,
    )


def test_encoder_cache_manager_admits_by_image_hash_and_frees() -> None:
    from vllm_hpu_mm.models.mllama.scheduling import CrossSlotEncoderCacheManager

    manager = CrossSlotEncoderCacheManager(cache_size=0, cross_slots=2)
    r1, r2 = _vllm_request("r1", ["a", "b"]), _vllm_request("r2", ["c"])
    assert manager.admit_images(r1)
    assert not manager.admit_images(r2)
    manager.free(r1)  # finished, aborted or preempted
    assert manager.admit_images(r2)
    assert manager.admit_images(_vllm_request("text", []))  # no images: no slot


# ---- the platform's start-up step ----------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_platform_wires_the_slots_to_scheduler_worker_and_request_limit(
    async_scheduling: bool,
) -> None:
    """The slot count travels in vLLM's ``ec_manager_config`` to the scheduler's
    manager and the worker; a per-prompt image limit above it is lowered to it,
    so vLLM's own check refuses such a request with a 400 before processing."""
    from vllm.config import EncoderCacheManagerConfig
    from vllm.config.multimodal import ImageDummyOptions

    from vllm_hpu_mm.platform_config import _size_cross_attention_cache
    from vllm_hpu_mm.worker.cross_attention import configured_slots

    vc = vllm_config(4, images=4)
    vc.model_config.multimodal_config.limit_per_prompt["image"] = ImageDummyOptions(
        count=4
    )
    vc.scheduler_config.scheduler_cls = None
    vc.scheduler_config.async_scheduling = async_scheduling
    vc.ec_manager_config = EncoderCacheManagerConfig()
    slot = CrossCacheGeometry.from_hf_config(ELEVEN_B, 2).slot_bytes
    plugin = HpuMMConfig.model_validate(
        {"memory": {"cross_attention_cache_gib": 3.5 * slot / GIB}}
    )
    _size_cross_attention_cache(plugin, vc)
    assert configured_slots(vc) == 3
    assert vc.ec_manager_config.encoder_cache_manager_cls.endswith(
        "CrossSlotEncoderCacheManager"
    )
    want = "AsyncCrossSlotScheduler" if async_scheduling else "CrossSlotScheduler"
    assert vc.scheduler_config.scheduler_cls.rsplit(".", 1)[-1] == want
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(vc.scheduler_config.scheduler_cls)
    base = "AsyncScheduler" if async_scheduling else "Scheduler"
    assert base in [c.__name__ for c in cls.__mro__]
    assert vc.model_config.multimodal_config.limit_per_prompt["image"].count == 3
    _size_cross_attention_cache(plugin, vc)  # again, as another process does
    assert configured_slots(vc) == 3


# ---- the memory profile --------------------------------------------------------------


@pytest.mark.parametrize("per_request", [False, True], ids=["flat", "per_request"])
def test_profile_reads_follow_the_step_not_the_slots(per_request: bool) -> None:
    """The profiled step's cross-attention reads the same keys whatever the
    cache's slot count: each request reads the most images a request carries."""
    from vllm_hpu_mm.worker.profile import _cross_metadata

    def metadata(capacity: int) -> Any:
        cross = SimpleNamespace(
            max_images=2,
            tiles=4,
            rows=96,
            patches=17,
            device=torch.device("cpu"),
            capacity=capacity,
            per_request=per_request,
        )
        return _cross_metadata(cross, np.array([100, 28]))

    small, large = metadata(4), metadata(512)
    assert small.pre_slots.shape == large.pre_slots.shape
    assert small.pre_tile_mask.shape == large.pre_tile_mask.shape
    if per_request:
        assert small.pre_slots.numel() == 0
        assert [r.key_rows.numel() for r in large.pre_requests] == [2 * 4 * 17] * 2
    else:
        assert large.pre_slots.numel() == 4  # 2 requests x 2 images
        assert (
            large.pre_tile_mask[:100, :2].all()
            and not large.pre_tile_mask[:100, 2:].any()
        )
