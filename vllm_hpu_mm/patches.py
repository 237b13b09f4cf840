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
  when torchvision does not import, before vLLM imports its model modules.
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
from collections.abc import Callable
from dataclasses import dataclass

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
)

_applied: set[str] = set()


def apply_patches() -> None:
    for patch in PATCHES:
        if patch.name in _applied or not patch.applies():
            continue
        patch.apply()
        _applied.add(patch.name)
        logger.info("vllm-hpu-mm patch applied: %s (%s)", patch.name, patch.why)
