"""The simulated ``habana_frameworks`` modules of one process.

``SimHabana`` is an import finder that serves the modules the plugin imports
(``habana_frameworks.torch``, ``.core``, ``.hpu``, ``.utils.internal``,
``.hpex.kernels``, ``.hpex.normalization``) and records their imports. As in
the bridge:

- importing ``habana_frameworks.torch`` registers the ``hpu`` device's
  ``torch.hpu`` and the ``hpu_backend`` Dynamo backend (vllm-gaudi imports only
  that module before vLLM's import-time
  ``@torch.compile(backend=simple_compile_backend)`` helpers look the backend
  up), and reads ``PT_HPU_LAZY_MODE`` once (optimum-habana:
  "PT_HPU_LAZY_MODE=0 needs to be set before library is loaded"; unset means
  eager, the default of current releases);
- ``utils.internal.is_lazy()`` reports that mode; ``core.mark_step()`` cuts the
  lazy graph (recorded; the host has already run the ops);
- ``hpu.wrap_in_hpu_graph`` (HPU graphs, lazy mode only) returns the model;
- in lazy mode a collective on an ``hccl`` group needs a ``mark_step`` since
  the previous one (``collectives``).

``install_in_process`` makes the stack permanent for the process and adds
what the bridge changes in torch itself: ``torch.accelerator`` answering for
the ``hpu`` device, its ``empty_cache`` raising "Allocator for hpu is not a
DeviceAllocator" as the bridge of Gaudi software 1.24 does (HabanaAI/vllm-fork
#2250; vllm-gaudi ``patches.py`` replaces it), Inductor refusing HPU tensors,
and the ``hccl`` process-group backend, stood in by gloo; the FP8 ops
``torch.ops.hpu.cast_to_fp8_v2`` and ``fp8_gemm_v2`` (``fp8_ops``), the MoE
op ``torch.ops.hpu.mixture_of_experts`` (``moe_ops``); and xgrammar's bitmask
kernel choosing ``torch.compile`` for logits still on the card, told from the
device module's host copies (``grammar``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

import torch

from vllm_hpu_mm.gaudi_sim import fp8_ops, grammar, kernels, moe_ops
from vllm_hpu_mm.gaudi_sim.bridge import SimBridgeConfig
from vllm_hpu_mm.gaudi_sim.card import SimHost, SimTorchHpu
from vllm_hpu_mm.gaudi_sim.collectives import LazyCollectives
from vllm_hpu_mm.gaudi_sim.compiler import (
    inductor_refusing_hpu,
    make_hpu_backend,
    register_hpu_backend,
)

LAZY_ENV = "PT_HPU_LAZY_MODE"
PACKAGES = (
    "habana_frameworks",
    "habana_frameworks.torch",
    "habana_frameworks.torch.utils",
    "habana_frameworks.torch.hpex",
    "habana_frameworks.torch.internal",
)
LEAVES = (
    "habana_frameworks.torch.core",
    "habana_frameworks.torch.hpu",
    "habana_frameworks.torch.utils.internal",
    "habana_frameworks.torch.hpex.kernels",
    "habana_frameworks.torch.hpex.normalization",
    "habana_frameworks.torch.internal.bridge_config",
)
HABANA_NAMES = PACKAGES + LEAVES
ACCELERATOR_ERROR = "Allocator for hpu is not a DeviceAllocator"


class SimHabana(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The simulated ``habana_frameworks`` of one process on ``host``."""

    def __init__(self, host: SimHost | None = None, hpu: SimTorchHpu | None = None):
        self.host = host or SimHost()
        self.hpu = hpu or self.host.process(f"pid {os.getpid()}")
        self.imports: list[str] = []
        self.calls: list[str] = []  # mark_step, wrap_in_hpu_graph, compile
        self.lazy: bool | None = None  # read at import of habana_frameworks.torch
        self.bridge = SimBridgeConfig()
        self.modules = {name: types.ModuleType(name) for name in HABANA_NAMES}
        for name in PACKAGES:
            self.modules[name].__path__ = []
        self._fill()
        self.backend = make_hpu_backend(self._is_lazy, LAZY_ENV)
        # lazy mode as read at import of habana_frameworks.torch (not yet: eager)
        self.collectives = LazyCollectives(lambda: bool(self.lazy))
        # What the device module copied to the host (``grammar``).
        self.host_copies = grammar.HostCopies()

    def _fill(self) -> None:
        m = self.modules
        m["habana_frameworks.torch.core"].mark_step = self._mark_step  # type: ignore[attr-defined]
        m["habana_frameworks.torch.utils.internal"].is_lazy = self._is_lazy  # type: ignore[attr-defined]
        m["habana_frameworks.torch.hpu"].wrap_in_hpu_graph = self._wrap  # type: ignore[attr-defined]
        k = m["habana_frameworks.torch.hpex.kernels"]
        k.FusedSDPA = kernels.FusedSDPA  # type: ignore[attr-defined]
        k.apply_rotary_pos_emb = kernels.apply_rotary_pos_emb  # type: ignore[attr-defined]
        k.RotaryPosEmbeddingMode = kernels.RotaryPosEmbeddingMode  # type: ignore[attr-defined]
        norm = m["habana_frameworks.torch.hpex.normalization"]
        norm.FusedRMSNorm = kernels.FusedRMSNorm  # type: ignore[attr-defined]
        bridge = m["habana_frameworks.torch.internal.bridge_config"]
        bridge.env_setting = self.bridge.env_setting  # type: ignore[attr-defined]

    # ---- the modules' functions ----------------------------------------------------
    def _mark_step(self) -> None:
        self.calls.append("mark_step")
        self.collectives.mark_step()

    def _is_lazy(self) -> bool:
        assert self.lazy is not None, "habana_frameworks.torch was not imported"
        return self.lazy

    def _wrap(self, model: Any) -> Any:
        self.calls.append("wrap_in_hpu_graph")
        return model

    def host_copy(
        self, t: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A device-to-host copy: a real copy, recorded as on the host (the
        simulated card's tensors are host tensors already; ``grammar``)."""
        return self.host_copies.copy(t, dtype)

    def hpu_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = self.backend(gm, example_inputs)
        self.calls.append("compile")
        return compiled

    # ---- importlib protocol --------------------------------------------------------
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(
            fullname, self, is_package=fullname in PACKAGES
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        self.imports.append(module.__name__)
        if module.__name__ == "habana_frameworks.torch":
            self.lazy = os.environ.get(LAZY_ENV, "0") == "1"

            def hpu_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
                return self.hpu_backend(gm, example_inputs)

            register_hpu_backend(hpu_backend)

    # ---- process-wide installation -------------------------------------------------
    def install_in_process(self) -> SimHabana:
        """Serve the modules and change torch as the bridge does, for good."""
        for name in HABANA_NAMES:
            sys.modules.pop(name, None)
        sys.meta_path.insert(0, self)
        torch.hpu = self.hpu  # type: ignore[attr-defined]
        _bridge_accelerator(self.hpu)
        import torch._inductor.compile_fx as compile_fx

        compile_fx.compile_fx = inductor_refusing_hpu()
        _register_hccl_as_gloo()
        fp8_ops.register()  # torch.ops.hpu.cast_to_fp8_v2 / fp8_gemm_v2
        moe_ops.register()  # torch.ops.hpu.mixture_of_experts
        grammar.install(self.host_copies)  # xgrammar's kernel choice on HPU logits
        import torch.distributed as dist

        for name, fn in self.collectives.wrappers().items():
            setattr(dist, name, fn)
        return self


def _accelerator_empty_cache() -> None:
    raise RuntimeError(ACCELERATOR_ERROR)


def _bridge_accelerator(hpu: SimTorchHpu) -> None:
    """``torch.accelerator`` as the bridge (1.24) leaves it: synchronisation and
    memory figures answered by ``torch.hpu``, ``empty_cache`` refused (the HPU
    allocator is not a ``c10::DeviceAllocator``). Device discovery
    (``is_available``, ``current_stream``) is left to the host build: Dynamo
    would otherwise ask for streams of a device the host cannot reach."""
    acc: Any = torch.accelerator
    acc.synchronize = lambda device=None: hpu.synchronize()
    acc.empty_cache = _accelerator_empty_cache
    acc.memory_allocated = lambda device=None: hpu.memory_allocated()
    acc.max_memory_allocated = lambda device=None: hpu.max_memory_allocated()
    acc.reset_peak_memory_stats = lambda device=None: hpu.reset_peak_memory_stats()
    acc.get_memory_info = lambda device=None: hpu.mem_get_info()


def _register_hccl_as_gloo() -> None:
    """The ``hccl`` process-group backend, with gloo doing the collectives."""
    import torch.distributed as dist

    if not dist.is_available() or "hccl" in dist.Backend.backend_list:
        return

    def create(store: Any, rank: int, size: int, timeout: Any) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("hccl", create, devices=["cpu"])
