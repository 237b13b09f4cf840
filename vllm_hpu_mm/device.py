"""The only module that touches habana_frameworks or torch.cuda.

Everything device-specific goes through here: which device the plugin runs on,
synchronisation, HPU's lazy-mode step marker, memory figures and seeding. The rest
of the package is device-free and runs unchanged on hpu, cuda and cpu, which is
how CI without a Gaudi exercises the HPU code path.

Device choice (``select_device``):

1. ``VLLM_HPU_MM_DEVICE`` = ``hpu`` | ``cuda`` | ``cpu`` forces a device (an
   unavailable forced device is an error, not a silent fallback);
2. else ``hpu`` when ``habana_frameworks.torch`` imports;
3. else ``cuda`` when ``torch.cuda.is_available()``;
4. else ``cpu``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

DeviceKind = Literal["hpu", "cuda", "cpu"]
DEVICE_ENV = "VLLM_HPU_MM_DEVICE"
_KINDS: tuple[DeviceKind, ...] = ("hpu", "cuda", "cpu")

# Default KV-cache size on the CPU fallback when --kv-cache-memory-bytes is unset:
# host RAM is shared with everything else, so take a modest fixed slice.
CPU_DEFAULT_KV_CACHE_BYTES = 512 * 1024**2

logger = logging.getLogger("vllm.hpu_mm.device")


class DeviceError(RuntimeError):
    """The requested device cannot be used on this host."""


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    kind: DeviceKind
    reason: str  # one human sentence: why this device was chosen


def _habana() -> Any | None:
    """``habana_frameworks.torch`` if it imports, else None."""
    try:
        return importlib.import_module("habana_frameworks.torch")
    except Exception:  # ImportError, or a broken Habana install
        return None


def _hpu_core() -> Any:
    return importlib.import_module("habana_frameworks.torch.core")


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def _available(kind: DeviceKind) -> bool:
    if kind == "hpu":
        return _habana() is not None
    if kind == "cuda":
        return _cuda_available()
    return True


@functools.cache
def select_device() -> DeviceChoice:
    """Pick the device once per process and log the choice with its reason."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        if forced not in _KINDS:
            raise DeviceError(
                f"{DEVICE_ENV}={forced!r} is not one of {', '.join(_KINDS)} "
                "(unset it to choose automatically)"
            )
        if not _available(forced):  # type: ignore[arg-type]
            raise DeviceError(
                f"{DEVICE_ENV}={forced} but that device is not available here "
                f"({'habana_frameworks.torch does not import' if forced == 'hpu' else 'torch.cuda.is_available() is False'})"  # noqa: E501
            )
        choice = DeviceChoice(forced, f"forced by {DEVICE_ENV}={forced}")  # type: ignore[arg-type]
    elif _habana() is not None:
        choice = DeviceChoice("hpu", "habana_frameworks.torch imports")
    elif _cuda_available():
        choice = DeviceChoice(
            "cuda", "no habana_frameworks; torch.cuda.is_available() is True"
        )
    else:
        choice = DeviceChoice("cpu", "no habana_frameworks and no CUDA device")
    logger.info("vllm-hpu-mm: running on %s (%s)", choice.kind, choice.reason)
    return choice


def device_kind() -> DeviceKind:
    return select_device().kind


def torch_device(local_rank: int = 0) -> torch.device:
    """The torch device this worker computes on."""
    kind = device_kind()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, local_rank)


def set_device(device: torch.device) -> None:
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.set_device(device)
    elif kind == "hpu":
        _habana()  # importing registers the hpu device with torch
        torch.hpu.set_device(device)  # type: ignore[attr-defined]


def device_count() -> int:
    kind = device_kind()
    if kind == "cuda":
        return int(torch.cuda.device_count())
    if kind == "hpu":
        return int(torch.hpu.device_count())  # type: ignore[attr-defined]
    return 1


def device_name(index: int = 0) -> str:
    kind = device_kind()
    if kind == "cuda":
        return str(torch.cuda.get_device_name(index))
    if kind == "hpu":
        return str(torch.hpu.get_device_name(index))  # type: ignore[attr-defined]
    return "cpu"


def synchronize() -> None:
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "hpu":
        torch.hpu.synchronize()  # type: ignore[attr-defined]


def mark_step() -> None:
    """End an HPU lazy-mode graph segment; a no-op elsewhere."""
    if device_kind() == "hpu":
        _hpu_core().mark_step()


def empty_cache() -> None:
    if device_kind() == "cuda":
        torch.cuda.empty_cache()


def manual_seed_all(seed: int) -> None:
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.manual_seed_all(seed)
    elif kind == "hpu":
        torch.hpu.manual_seed_all(seed)  # type: ignore[attr-defined]


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM, from /proc/meminfo."""
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]


def memory_info() -> tuple[int, int]:
    """(free, total) bytes on the device (host RAM on the CPU fallback)."""
    kind = device_kind()
    if kind == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    if kind == "hpu":
        stats = torch.hpu.memory_stats()  # type: ignore[attr-defined]
        total = int(stats["Limit"])
        return total - int(stats["InUse"]), total
    return _host_memory()


def peak_memory_bytes() -> int:
    """Peak bytes allocated by torch on the device since start (0 on the CPU)."""
    kind = device_kind()
    if kind == "cuda":
        return int(torch.cuda.max_memory_allocated())
    if kind == "hpu":
        return int(torch.hpu.max_memory_allocated())  # type: ignore[attr-defined]
    return 0


def allocated_memory_bytes() -> int:
    """Bytes torch holds allocated on the device now (0 on the CPU)."""
    kind = device_kind()
    if kind == "cuda":
        return int(torch.cuda.memory_allocated())
    if kind == "hpu":
        return int(torch.hpu.memory_allocated())  # type: ignore[attr-defined]
    return 0


def reset_peak_memory() -> None:
    """Start ``peak_memory_bytes`` afresh from what is allocated now."""
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif kind == "hpu":
        torch.hpu.reset_peak_memory_stats()  # type: ignore[attr-defined]


def total_memory(index: int = 0) -> int:
    return memory_info()[1]


def compile_backend() -> str:
    """torch.compile backend for graph mode on this device."""
    if device_kind() == "hpu":
        _hpu_core()  # registers the "hpu_backend" with torch.compile
        return "hpu_backend"
    return "inductor"


def dist_backend() -> str:
    return {"hpu": "hccl", "cuda": "nccl", "cpu": "gloo"}[device_kind()]


# --- HF transformers as the benchmark's reference (vllm-hpu-mm bench --backend hf)


def prepare_hf_for_device() -> None:
    """Call before loading an HF transformers model: on Gaudi, optimum-habana
    swaps in its Gaudi model classes and ``generate``; a no-op elsewhere."""
    if device_kind() == "hpu":
        _habana()
        gaudi = importlib.import_module("optimum.habana.transformers.modeling_utils")
        gaudi.adapt_transformers_to_gaudi()


def hf_model_to_device(model: Any) -> Any:
    """The HF model on this device: on Gaudi moved to ``hpu`` and wrapped in
    HPU graphs; on CUDA moved to ``cuda``; unchanged on the CPU."""
    kind = device_kind()
    if kind == "hpu":
        hpu = importlib.import_module("habana_frameworks.torch.hpu")
        return hpu.wrap_in_hpu_graph(model.to("hpu"))
    if kind == "cuda":
        return model.to("cuda")
    return model


def hf_generate_kwargs() -> dict[str, Any]:
    """Extra ``generate`` arguments of the Gaudi adaptation (lazy mode, HPU
    graphs); none elsewhere."""
    if device_kind() == "hpu":
        return {"lazy_mode": True, "hpu_graphs": True}
    return {}
