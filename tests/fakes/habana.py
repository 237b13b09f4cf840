"""The simulated Gaudi stack (``vllm_hpu_mm.gaudi_sim``) for CPU unit tests.

The semantics (one card per process taken on first touch, no indexed
devices, lazy vs eager, ``hpu_backend`` through AOTAutograd and its refusals,
the fused kernels' signatures and restrictions, memory statistics) live in the
package, each cited in its docstring; this module only adapts it to a
test: ``FakeHabana.install(monkeypatch)`` serves the simulated modules and
``torch.hpu`` for one test and undoes everything afterwards, and a card's
allocations are a settable figure (``in_use``) instead of the process's live
tensors.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_hpu_mm.gaudi_sim.bridge import (
    COMPILE_ONLY_SETTING,
    CompileOnlyRead,
)
from vllm_hpu_mm.gaudi_sim.bridge import SimBridgeConfig as FakeBridgeConfig
from vllm_hpu_mm.gaudi_sim.card import (
    VISIBLE_MODULES_ENV,
    CardUnavailable,
    SimEvent,
    SimHost,
    SimTorchHpu,
)
from vllm_hpu_mm.gaudi_sim.compiler import inductor_refusing_hpu, unregister_hpu_backend
from vllm_hpu_mm.gaudi_sim.kernels import FusedRMSNorm as FakeFusedRMSNorm
from vllm_hpu_mm.gaudi_sim.kernels import FusedSDPA as FakeFusedSDPA
from vllm_hpu_mm.gaudi_sim.kernels import RotaryPosEmbeddingMode
from vllm_hpu_mm.gaudi_sim.kernels import (
    apply_rotary_pos_emb as fake_apply_rotary_pos_emb,
)
from vllm_hpu_mm.gaudi_sim.stack import HABANA_NAMES, LAZY_ENV, SimHabana

__all__ = [
    "COMPILE_ONLY_SETTING",
    "HABANA_NAMES",
    "LAZY_ENV",
    "VISIBLE_MODULES_ENV",
    "CardUnavailable",
    "CompileOnlyRead",
    "FakeBridgeConfig",
    "FakeFusedRMSNorm",
    "FakeFusedSDPA",
    "FakeGaudiHost",
    "FakeHabana",
    "FakeHpuEvent",
    "FakeTorchHpu",
    "RotaryPosEmbeddingMode",
    "check_gaudi_generate_kwargs",
    "cpu_only_host",
    "fake_apply_rotary_pos_emb",
    "reject_inductor",
]

FakeHpuEvent = SimEvent


class FakeTorchHpu(SimTorchHpu):
    """One process's simulated ``torch.hpu`` whose allocated bytes are
    ``in_use`` (10 GiB unless a test sets it)."""

    def __init__(self, host: SimHost, name: str) -> None:
        super().__init__(host, name, allocated=lambda: self.in_use)
        self.in_use = 10 * 2**30


class FakeGaudiHost(SimHost):
    """A host of 96 GiB cards (a test sets ``memory``)."""

    def __init__(self, modules: tuple[int, ...] = (0,), memory: int = 96 * 2**30):
        super().__init__(modules, memory)

    def process(self, name: str, allocated: Any = None) -> FakeTorchHpu:
        return FakeTorchHpu(self, name)


class FakeHabana(SimHabana):
    """The simulated ``habana_frameworks`` of one test process on ``host``."""

    def __init__(self, host: FakeGaudiHost | None = None, process: str = "worker"):
        host = host or FakeGaudiHost()
        super().__init__(host, host.process(process))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeHabana:
        for name in HABANA_NAMES:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [self, *sys.meta_path])
        monkeypatch.setattr(torch, "hpu", self.hpu, raising=False)
        return self

    def uninstall(self) -> None:
        unregister_hpu_backend()
        for name in HABANA_NAMES:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def cpu_only_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A host without Habana's stack or CUDA, device choice unforced and
    uncached for the body (the device module re-chooses on each side)."""
    from vllm_hpu_mm import device

    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in HABANA_NAMES:
        monkeypatch.setitem(sys.modules, name, None)
    device.select_device.cache_clear()
    yield
    device.select_device.cache_clear()


def reject_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor as it meets HPU tensors: every compile raises
    (``vllm_hpu_mm.gaudi_sim.compiler``)."""
    import torch._inductor.compile_fx as compile_fx

    monkeypatch.setattr(compile_fx, "compile_fx", inductor_refusing_hpu())


def check_gaudi_generate_kwargs(kwargs: dict[str, Any]) -> None:
    """optimum-habana's ``GaudiGenerationMixin.generate`` check
    (``transformers/generation/utils.py``): HPU graphs require lazy mode."""
    if kwargs.get("hpu_graphs") and not kwargs.get("lazy_mode"):
        raise ValueError(
            "`hpu_graphs` is True but `lazy_mode` is False. HPU graphs require "
            "`lazy_mode` to be set to True."
        )
