"""A simulated Intel Gaudi stack, shipped in the package.

``VLLM_HPU_MM_DEVICE=hpu VLLM_HPU_MM_GAUDI_SIM=1`` runs the whole engine on the
host with a simulated ``habana_frameworks`` and ``torch.hpu`` installed in
every process that loads the plugin (``vllm_hpu_mm.device.select_device``, run
by the platform plugin's ``register()``, which vLLM calls in every process:
API server, engine core, mp and Ray workers). It never loads when a real
``habana_frameworks`` is importable.

It has the real stack's semantics where a mistake in how the plugin drives
Gaudi would show (each cited in its module): ``stack`` (modules, lazy mode,
``mark_step``, ``torch.accelerator``, hccl over gloo), ``card`` (one card per
process taken on first touch, memory statistics), ``compiler``
(``hpu_backend`` through AOTAutograd, refusing what Habana's graph compiler
refuses, counting compilations; Inductor refusing HPU tensors) and
``kernels`` (FusedSDPA with its softmax modes, FusedRMSNorm, fused RoPE) and
``grammar`` (xgrammar's bitmask kernel as chosen for logits on the card; the
device module's host copies are real copies it records).

What it cannot show: the simulated HPU tensors are host tensors (the torch
device the worker computes on is ``cpu``), so what dispatches on the tensor's
device type is exercised only where modelled (xgrammar's kernel choice, the
device module's host copies); pinned memory and asynchronous copies are not;
speed, the graph compiler's own limits and numerics other than the
fused kernels' are not Gaudi's.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from vllm_hpu_mm.gaudi_sim.stack import SimHabana

SIM_ENV = "VLLM_HPU_MM_GAUDI_SIM"

_installed: SimHabana | None = None


def requested() -> bool:
    """``VLLM_HPU_MM_GAUDI_SIM=1`` is set."""
    return os.environ.get(SIM_ENV, "").strip() == "1"


def real_habana_importable() -> bool:
    """A real ``habana_frameworks`` is installed (the simulation then never
    loads)."""
    if _installed is not None:
        return False
    if "habana_frameworks" in sys.modules:
        return sys.modules["habana_frameworks"] is not None
    try:
        return importlib.util.find_spec("habana_frameworks") is not None
    except (ImportError, ValueError):
        return False


def installed() -> SimHabana | None:
    """The simulated stack of this process, if installed."""
    return _installed


def install() -> SimHabana:
    """Install the simulated stack in this process (once)."""
    global _installed
    if _installed is None:
        if real_habana_importable():
            raise RuntimeError(
                f"{SIM_ENV}=1 but a real habana_frameworks is importable: the "
                f"simulated Gaudi never replaces the real one; unset {SIM_ENV}"
            )
        _installed = SimHabana().install_in_process()
    return _installed
