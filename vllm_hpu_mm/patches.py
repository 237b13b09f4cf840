"""The register of patches to vLLM's or torch's functions (``PATCHES``).

Each entry says why it exists, what it changes and when it can go. Patches are
applied by ``apply_patches()`` from the platform plugin entry point (vLLM
resolves the platform in every process that uses it, engine or not), the
general plugin entry point and the worker's ``init_device`` (never at import),
only where their condition holds, and each at most once.

Not every change the plugin makes to code or state it does not own is here.
These live beside the code they serve, each with its reason written there:

- ``models/compat.py``: ``sys.modules`` entries for transformers' torchvision
  image processors (Pixtral, Qwen2-VL, Gemma 3) pointed at their PIL twins
  when torchvision does not import, before vLLM imports its model modules;
  likewise ``transformers.models.qwen3_vl.Qwen3VLVideoProcessor`` bound to the
  plugin's torchvision-free class (``models/qwen_video.py``).
- ``worker/graphs.py``: in graph mode each decoder layer's ``forward`` is
  replaced by a call of its compiled region, its attention layers'
  ``layer_name`` by a per-position alias, and the forward context's
  ``no_compile_layers`` by the step's own copy (``LayerRegion``,
  ``_own_layer_table``); Dynamo's recompile limits are raised and
  ``TORCHINDUCTOR_CACHE_DIR`` is set to ``hpu_mm.warmup.compile_cache_dir``.
- ``device.py``: on Gaudi, ``HABANA_VISIBLE_MODULES`` narrowed to the local
  worker's module (``select_card``) and Dynamo disabled in lazy mode
  (``claim_device``).
- ``platform_config.py``: ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for HPU
  workers (an explicit choice is kept).
- ``serving/__init__.py``: ``VLLM_MEDIA_CONNECTOR`` defaults to the plugin's
  connector; ``__init__.py``: ``PROMETHEUS_MULTIPROC_DIR`` when unset.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hpu_mm import device as dev

logger = logging.getLogger("vllm.hpu_mm.patches")


@dataclass(frozen=True, slots=True)
class Patch:
    name: str
    why: str
    until: str  # when it can be removed
    applies: Callable[[], bool]
    apply: Callable[[], None]


def _noop(*args: object, **kwargs: object) -> None:
    return None


def _empty_cache_noop(*args: object, **kwargs: object) -> None:
    # Distinct from _noop: torch.compile keys a handler on synchronize's identity.
    return None


def _accelerator_noop() -> None:
    torch.accelerator.synchronize = _noop  # type: ignore[assignment]
    torch.accelerator.empty_cache = _empty_cache_noop  # type: ignore[assignment]
    torch.accelerator.empty_host_cache = _noop  # type: ignore[assignment]


def _request_mm_hashes(prompt: object) -> list[str]:
    """The multimodal item hashes of a rendered request (``mm_hashes``: per
    modality, a list of strings), empty for anything else."""
    hashes = prompt.get("mm_hashes") if isinstance(prompt, dict) else None
    if not isinstance(hashes, dict):
        return []
    return [h for per in hashes.values() for h in per or () if isinstance(h, str)]


def _forget_refused_items() -> None:
    """Wrap ``InputProcessor.process_inputs``: when it refuses a request whose
    images the renderer already processed, queue their hashes for removal from
    the renderer's front-end cache (the renderer's own call for cache drift)."""
    import functools

    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs

    @functools.wraps(original)
    def process_inputs(self: Any, request_id: str, prompt: Any, *args: Any, **kw: Any):  # type: ignore[no-untyped-def]
        try:
            return original(self, request_id, prompt, *args, **kw)
        except Exception:
            hashes = _request_mm_hashes(prompt)
            if hashes:
                self.renderer.queue_mm_cache_invalidations(hashes)
            raise

    InputProcessor.process_inputs = process_inputs  # type: ignore[method-assign]


def _accelerator_hpu() -> None:
    torch.accelerator.empty_cache = _empty_cache_noop  # type: ignore[assignment]
    torch.accelerator.empty_host_cache = _noop  # type: ignore[assignment]


def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's ``v1/sample/ops/logprobs.py`` helper, uncompiled: per row of ``x
    [N, V]``, how many entries are >= ``values [N, 1]`` (the rank of a token)."""
    return (x >= values).sum(-1)


def get_masked_input_and_mask(
    input_: torch.Tensor,
    org_vocab_start_index: int,
    org_vocab_end_index: int,
    num_org_vocab_padding: int,
    added_vocab_start_index: int,
    added_vocab_end_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's vocab-parallel embedding helper, uncompiled: token ids local to
    this rank's shard (0 outside it) and the mask of ids outside it."""
    org_mask = (input_ >= org_vocab_start_index) & (input_ < org_vocab_end_index)
    added_mask = (input_ >= added_vocab_start_index) & (input_ < added_vocab_end_index)
    added_offset = (
        added_vocab_start_index
        - (org_vocab_end_index - org_vocab_start_index)
        - num_org_vocab_padding
    )
    valid_offset = (org_vocab_start_index * org_mask) + (added_offset * added_mask)
    vocab_mask = org_mask | added_mask
    return vocab_mask * (input_ - valid_offset), ~vocab_mask


_SAMPLER = "vllm.v1.sample.sampler"
# vLLM's compiled helpers as they were before ``_uncompiled_helpers`` replaced
# them (name -> function), for tests that compare the two.
REPLACED_HELPERS: dict[str, Any] = {}


def _uncompiled_helpers() -> None:
    import vllm.model_executor.layers.vocab_parallel_embedding as embedding
    import vllm.v1.sample.ops.logprobs as logprobs
    import vllm.v1.sample.sampler as sampler

    REPLACED_HELPERS.setdefault(
        "batched_count_greater_than", logprobs.batched_count_greater_than
    )
    REPLACED_HELPERS.setdefault(
        "get_masked_input_and_mask", embedding.get_masked_input_and_mask
    )

    logprobs.batched_count_greater_than = batched_count_greater_than  # type: ignore[assignment]
    sampler.batched_count_greater_than = batched_count_greater_than  # type: ignore[attr-defined]
    embedding.get_masked_input_and_mask = get_masked_input_and_mask  # type: ignore[assignment]


_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"


def _moe_runner_calls_the_layer() -> None:
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    REPLACED_HELPERS.setdefault(
        "MoERunner._select_forward", moe_runner.MoERunner._select_forward
    )

    def select_forward(self: Any) -> Callable[..., Any]:
        if self._shared_experts is None:
            return moe_runner._moe_forward
        return moe_runner._moe_forward_shared

    moe_runner.MoERunner._select_forward = select_forward  # type: ignore[method-assign]


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="torch.accelerator no-ops on the CPU fallback",
        why=(
            "vLLM 0.33 calls torch.accelerator.empty_cache() in its model "
            "loader (model_loader/base_loader.py) and empty_host_cache() at "
            "shutdown for every non-CPU platform enum "
            "(cleanup_dist_env_and_memory); both raise 'Cannot access "
            "accelerator device' on a host without one"
        ),
        until="vLLM guards its torch.accelerator calls by platform",
        applies=lambda: dev.device_kind() == "cpu",
        apply=_accelerator_noop,
    ),
    Patch(
        name="torch.accelerator cache release skipped on HPU",
        why=(
            "vLLM 0.33 calls torch.accelerator.empty_cache() after loading "
            "weights (model_loader/base_loader.py) and empty_cache() / "
            "empty_host_cache() at shutdown (distributed/parallel_state.py); "
            "Habana's allocator is not a c10::DeviceAllocator, so on Gaudi "
            "software 1.24 empty_cache raises 'Allocator for hpu is not a "
            "DeviceAllocator' (HabanaAI/vllm-fork #2250) and empty_host_cache "
            "has no HPU hook; the official plugin replaces both with no-ops "
            "(vllm-gaudi patches.py)"
        ),
        until="the Habana bridge's allocator implements c10::DeviceAllocator",
        applies=lambda: dev.device_kind() == "hpu",
        apply=_accelerator_hpu,
    ),
    Patch(
        name="vLLM's symbolic-shape compiled helpers run eagerly on HPU",
        why=(
            "the sampler marks the logprobs batch unbacked (mark_unbacked) and "
            "calls batched_count_greater_than, which vLLM compiles with "
            "simple_compile_backend (v1/sample/ops/logprobs.py); under TP > 1 "
            "the vocab-parallel embedding calls get_masked_input_and_mask, "
            "compiled with dynamic=True. hpu_backend compiles static shapes "
            "only ('TypeError: Cannot convert symbols to int', vllm-gaudi "
            "patches.py, which replaces the helpers with plain functions); "
            "applied once vLLM's sampler is imported (in the worker, before "
            "init_device), so that registering the platform stays light"
        ),
        until="vLLM compiles these helpers with static shapes on HPU",
        applies=lambda: dev.device_kind() == "hpu" and _SAMPLER in sys.modules,
        apply=_uncompiled_helpers,
    ),
    Patch(
        name="vLLM's MoE runner calls the experts directly on HPU",
        why=(
            "on a platform other than the CPU and TPU, vLLM's MoERunner enters "
            "every FusedMoE layer through torch.ops.vllm.moe_forward, a custom "
            "op with mutates_args=['hidden_states'] "
            "(fused_moe/runner/moe_runner.py _select_forward); hpu_backend "
            "lowers through AOTAutograd, which turns it into "
            "auto_functionalized_v2, a higher-order op Habana's graph compiler "
            "does not implement, so warmup of any MoE model failed. The runner "
            "then calls the layer's forward directly, as vLLM does on the CPU "
            "and TPU, and the experts are traced into the graph (the official "
            "plugin replaces MoERunner.forward for the same end, vllm-gaudi "
            "ops/hpu_fused_moe.py); applied once vLLM's MoE runner is imported "
            "(in the worker, before the model is built)"
        ),
        until="vLLM lets a platform choose the direct call (as for the CPU)",
        applies=lambda: dev.device_kind() == "hpu" and _MOE_RUNNER in sys.modules,
        apply=_moe_runner_calls_the_layer,
    ),
)

# The serving path's patches: applied by ``serving.install`` (from the
# platform's check_and_update_config, in the process that takes requests), not
# while vLLM resolves the platform (vLLM's engine modules would be imported
# half-way through vllm.distributed's own import).
SERVING_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="a refused request's images leave vLLM's front-end cache",
        why=(
            "the renderer marks a request's processed images as held by the "
            "engine before InputProcessor.process_inputs validates the request "
            "(the platform's validate_request, vLLM's prompt-length checks); a "
            "refused request never reaches the engine, so the next request with "
            "the same image was sent without its data and failed with a 500 "
            "(multimodal cache miss)"
        ),
        until="vLLM rolls its sender cache back when process_inputs raises",
        applies=lambda: True,
        apply=_forget_refused_items,
    ),
)

_applied: set[str] = set()


def apply_patches(patches: tuple[Patch, ...] = PATCHES) -> None:
    for patch in patches:
        if patch.name in _applied or not patch.applies():
            continue
        patch.apply()
        _applied.add(patch.name)
        logger.info("vllm-hpu-mm patch applied: %s (%s)", patch.name, patch.why)


def apply_serving_patches() -> None:
    apply_patches(SERVING_PATCHES)
