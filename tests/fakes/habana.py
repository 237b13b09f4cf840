"""A fake Intel Gaudi stack (``habana_frameworks`` and ``torch.hpu``) for CPU tests.

It rejects what the real stack rejects, so that a mistake in how the plugin
drives Gaudi fails a test instead of passing silently. Sources, read from the
official Gaudi plugin (vllm-project/vllm-gaudi @ 091bbad), optimum-habana and
PyTorch (summarised in docs/gaudi.md):

- One card per process, taken on first touch. A Habana process takes the first
  free card visible through ``HABANA_VISIBLE_MODULES`` when it first touches
  the device; vllm-gaudi's ``platform.py`` therefore answers
  ``get_device_name`` with a static name and ``get_device_total_memory`` with
  0 ("a workaround" for ``engine/arg_utils.py``), and its ``set_device`` is a
  no-op. ``FakeGaudiHost`` holds the cards, ``FakeTorchHpu`` is one process's
  ``torch.hpu``: its first device query takes a card, and a process that
  finds none free fails as the real runtime does.
- No indexed devices. vllm-gaudi's worker makes ``torch.device("hpu")``;
  optimum-habana dropped ``hpu:X`` "until fully supported by bridge" (#637);
  DeepSpeed went back and forth (#5255, #7545; ``hpu:0`` in #7497). A process
  drives one card, so only ``hpu`` / ``hpu:0`` name it: the fake
  ``set_device`` refuses ``hpu:N`` for N > 0 (the plugin never needs an index).
- Card per rank. With the first free card, the rank-to-module mapping follows
  process start order, which breaks HCCL for world sizes above 4 on 8-card
  Gaudi2 nodes (vllm-gaudi #788 "Set device according to local rank", which
  tied the module to the local rank through ``HABANA_VISIBLE_MODULES``; it was
  reverted in #946 and vllm-gaudi 091bbad leaves the card to the runtime;
  HabanaAI/vllm-fork #1198 / #1915). The fake hands out the first free visible
  card, as the runtime does; the per-rank rule is the plugin's own.
- Lazy vs eager. ``habana_frameworks.torch.utils.internal.is_lazy()`` reports
  ``PT_HPU_LAZY_MODE`` as read when ``habana_frameworks.torch`` was imported
  (optimum-habana: "PT_HPU_LAZY_MODE=0 needs to be set before library is
  loaded"); unset means eager, the default of current releases. The fake
  ``hpu_backend`` refuses to compile in lazy mode (vllm-gaudi
  ``platform.py``: "PT HPU lazy backend (PT_HPU_LAZY_MODE = 1) does not
  support torch.compile"; optimum-habana: "Dynamo and lazy are mutually
  exclusive").
- Inductor cannot compile HPU tensors (torch/_inductor/graph.py raises
  "Device {device_type} not supported" for a device without an Inductor
  codegen; vllm-gaudi sets ``simple_compile_backend = "hpu_backend"``). On a
  Gaudi host every model tensor is an HPU tensor, so ``reject_inductor`` makes
  Inductor raise that error.
- Kernels with the real signatures, as vllm-gaudi calls them:
  ``FusedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale,
  softmax_mode, recompute_mode, valid_sequence_lengths, padding_side)``
  (``extension/ops.py``, ``extension/utils.py``: a mask together with
  ``is_causal`` "is not yet supported"; GQA K/V heads passed unrepeated);
  ``FusedRMSNorm.apply(x, weight, eps)`` (``ops/hpu_layernorm.py``: "requires
  3D tensors as inputs"); ``apply_rotary_pos_emb(x, cos, sin, position_ids,
  offset, mode)`` with ``RotaryPosEmbeddingMode.BLOCKWISE`` / ``PAIRWISE``
  (``ops/hpu_rotary_embedding.py``: cos and sin as wide as the rotated
  channels, ``position_ids=None``).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

VISIBLE_MODULES_ENV = "HABANA_VISIBLE_MODULES"
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


class CardUnavailable(RuntimeError):
    """No free Gaudi card for this process (the real runtime's acquire failure)."""


# ---- cards and processes ---------------------------------------------------------


class FakeGaudiHost:
    """A host's Gaudi cards (module ids), shared by every process on it."""

    def __init__(self, modules: tuple[int, ...] = (0,), memory: int = 96 * 2**30):
        self.modules = modules
        self.memory = memory
        self.owner: dict[int, str] = {}  # module id -> process name

    def process(self, name: str) -> FakeTorchHpu:
        return FakeTorchHpu(self, name)


class FakeHpuEvent:
    """An event of ``torch.hpu`` (``record()`` on the current stream,
    ``synchronize()`` waits for it): both are device calls, so both take the
    process's card as any other device query does. The fake's work is done
    when it returns, so there is nothing to wait for."""

    def __init__(self, hpu: FakeTorchHpu) -> None:
        self.hpu = hpu

    def record(self) -> None:
        self.hpu._touch("event.record")

    def synchronize(self) -> None:
        self.hpu._touch("event.synchronize")


class FakeTorchHpu:
    """``torch.hpu`` of one process: the first device query takes a card."""

    def __init__(self, host: FakeGaudiHost, name: str) -> None:
        self.host = host
        self.name = name
        self.card: int | None = None
        self.calls: list[str] = []
        self.in_use = 10 * 2**30

    def _touch(self, call: str) -> None:
        self.calls.append(call)
        if self.card is not None:
            return
        listed = os.environ.get(VISIBLE_MODULES_ENV, "")
        visible = [int(m) for m in listed.split(",") if m.strip()] or list(
            self.host.modules
        )
        free = [m for m in visible if m not in self.host.owner]
        if not free:
            raise CardUnavailable(
                f"{self.name}: device acquire failed, no free Gaudi card among "
                f"modules {visible} (taken: {self.host.owner})"
            )
        self.card = free[0]
        self.host.owner[self.card] = self.name

    def is_available(self) -> bool:
        # Asked by Dynamo while it traces; answered from the loaded bridge.
        return True

    # device queries (each one touches the card)
    def mem_get_info(self) -> tuple[int, int]:
        self._touch("mem_get_info")
        return self.host.memory - self.in_use, self.host.memory

    def max_memory_allocated(self) -> int:
        self._touch("max_memory_allocated")
        return self.in_use

    def synchronize(self) -> None:
        self._touch("synchronize")

    def Event(self, enable_timing: bool = False) -> FakeHpuEvent:
        """``torch.hpu.Event``: record() on the current stream, synchronize()
        waits for it; both are device calls."""
        return FakeHpuEvent(self)

    def manual_seed_all(self, seed: int) -> None:
        self._touch("manual_seed_all")

    def device_count(self) -> int:
        self._touch("device_count")
        return 1

    def get_device_name(self, index: int = 0) -> str:
        self._touch("get_device_name")
        return "GAUDI3"

    def set_device(self, device: torch.device | str | int) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(
                f"indexed HPU device {device!r}: a Habana process drives one card, "
                f"chosen by {VISIBLE_MODULES_ENV}; use torch.device('hpu')"
            )
        self._touch("set_device")


# ---- habana_frameworks modules -----------------------------------------------------


class RotaryPosEmbeddingMode(enum.Enum):
    BLOCKWISE = "blockwise"  # neox: rotate the two halves
    PAIRWISE = "pairwise"  # GPT-J: rotate interleaved pairs


class FakeFusedSDPA:
    """``habana_frameworks.torch.hpex.kernels.FusedSDPA`` (float32 reference maths)."""

    calls = 0

    @staticmethod
    def apply(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        softmax_mode: str = "None",
        recompute_mode: bool | None = None,
        valid_sequence_lengths: torch.Tensor | None = None,
        padding_side: str = "left",
    ) -> torch.Tensor:
        FakeFusedSDPA.calls += 1
        if is_causal and attn_mask is not None:
            raise RuntimeError("FusedSDPA: is_causal with attn_mask is not supported")
        if softmax_mode not in ("None", "fast", "fp32"):
            raise ValueError(f"FusedSDPA: unknown softmax_mode {softmax_mode!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"FusedSDPA: unknown padding_side {padding_side!r}")
        hq, hkv = query.shape[1], key.shape[1]
        if hq % hkv:
            raise RuntimeError(f"FusedSDPA: {hq} query heads over {hkv} KV heads")
        k = key.repeat_interleave(hq // hkv, dim=1).float()
        v = value.repeat_interleave(hq // hkv, dim=1).float()
        scores = query.float() @ k.transpose(-2, -1)
        scores = scores * (scale if scale is not None else query.shape[-1] ** -0.5)
        if attn_mask is not None:
            scores = scores + attn_mask.float()
        if is_causal:
            s, kl = scores.shape[-2:]
            keep = torch.ones(s, kl, dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        return (scores.softmax(-1) @ v).to(query.dtype)


class FakeFusedRMSNorm:
    """``habana_frameworks.torch.hpex.normalization.FusedRMSNorm``."""

    calls = 0

    @staticmethod
    def apply(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        FakeFusedRMSNorm.calls += 1
        if x.dim() != 3:
            raise RuntimeError(f"FusedRMSNorm needs a 3-D input, got {tuple(x.shape)}")
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype)


def fake_apply_rotary_pos_emb(
    p: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    offset: int = 0,
    mode: RotaryPosEmbeddingMode = RotaryPosEmbeddingMode.BLOCKWISE,
) -> torch.Tensor:
    """``habana_frameworks.torch.hpex.kernels.apply_rotary_pos_emb``."""
    if position_ids is not None:
        raise RuntimeError("apply_rotary_pos_emb: position_ids must be None here")
    if cos.shape[-1] != p.shape[-1] or sin.shape[-1] != p.shape[-1]:
        raise RuntimeError(
            f"apply_rotary_pos_emb: cos/sin width {cos.shape[-1]} != input "
            f"width {p.shape[-1]}"
        )
    if mode is RotaryPosEmbeddingMode.BLOCKWISE:
        x1, x2 = p.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif mode is RotaryPosEmbeddingMode.PAIRWISE:
        x1, x2 = p[..., 0::2], p[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        raise ValueError(f"apply_rotary_pos_emb: unknown mode {mode!r}")
    return p * cos + rotated * sin


# ---- the bridge's runtime settings: compile-only mode --------------------------

COMPILE_ONLY_SETTING = "PT_COMPILE_ONLY_MODE"
# Tensor methods that hand a tensor's values to the host.
VALUE_READS = (
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
)


class CompileOnlyRead(RuntimeError):
    """A tensor's value was read while the bridge only compiles."""


class FakeBridgeConfig:
    """``habana_frameworks.torch.internal.bridge_config``: ``env_setting(name,
    value)`` changes a bridge setting for the body of a ``with``; a setting the
    bridge does not know raises KeyError on entry (the official plugin probes
    ``PT_COMPILE_ONLY_MODE`` that way and falls back on older software,
    vllm-gaudi ``hpu_model_runner.py`` warmup).

    Compile-only mode compiles recipes without executing them, so no tensor
    holds computed values inside it: vllm-gaudi's own notes say ``clone()``
    "does not copy data in compile-only mode" (``ops`` split weights), that
    shapes "need to be predetermined, not depend on the tensor value itself"
    (its Qwen2.5-VL ``rot_pos_emb``), and it runs multimodal warmup outside the
    mode for "data-dependent output shapes that must be materialized"
    (``VLLM_MM_WARMUP_OUTSIDE_COMPILE_ONLY``). On the CPU every tensor stands
    for a device tensor, so while the mode is on every read of a value
    (``VALUE_READS``) raises ``CompileOnlyRead``, except inside torch's
    compiler (``_COMPILER_FRAMES``); ``entered`` counts the
    times warmup switched it on."""

    def __init__(self, known: tuple[str, ...] = (COMPILE_ONLY_SETTING,)) -> None:
        self.known = known
        self.settings: dict[str, object] = {}
        self.entered = 0

    @contextlib.contextmanager
    def env_setting(self, name: str, value: object) -> Iterator[None]:
        if name not in self.known:
            raise KeyError(name)
        before = self.settings.get(name)
        self.settings[name] = value
        guard = (
            _reject_value_reads()
            if name == COMPILE_ONLY_SETTING and value
            else contextlib.nullcontext()
        )
        self.entered += 1
        try:
            with guard:
                yield
        finally:
            self.settings[name] = before


# Frames of torch's compiler stack: a value read there is the compiler folding a
# constant it created itself (Inductor's ``scalar_tensor``), compile-time work
# that stands for hpu_backend's own, not a read of a computed device tensor.
_COMPILER_FRAMES = (
    f"{os.sep}torch{os.sep}_inductor{os.sep}",
    f"{os.sep}torch{os.sep}_functorch{os.sep}",
)


def _in_the_compiler() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COMPILER_FRAMES):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextlib.contextmanager
def _reject_value_reads() -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in VALUE_READS}

    def refuse(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _in_the_compiler():
                return saved[name](self, *args, **kwargs)
            raise CompileOnlyRead(
                f"Tensor.{name} on a {tuple(self.shape)} tensor in "
                f"{COMPILE_ONLY_SETTING}: values are not computed"
            )

        return read

    for name in VALUE_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class FakeHabana(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the fake ``habana_frameworks`` modules and records their imports.

    ``install`` puts it on ``sys.meta_path`` and ``torch.hpu`` (a process of
    ``host``) on torch. Importing ``habana_frameworks.torch`` registers
    ``hpu_backend`` with Dynamo (vllm-gaudi imports only that module before
    vLLM's import-time ``@torch.compile(backend=simple_compile_backend)``
    helpers look the backend up). Every change is undone by the monkeypatch
    and ``uninstall``.
    """

    def __init__(self, host: FakeGaudiHost | None = None, process: str = "worker"):
        self.host = host or FakeGaudiHost()
        self.hpu = self.host.process(process)
        self.imports: list[str] = []
        self.calls: list[str] = []  # mark_step, wrap_in_hpu_graph, compile
        self.lazy: bool | None = None  # read at import of habana_frameworks.torch
        self.bridge = FakeBridgeConfig()
        self.modules = {name: types.ModuleType(name) for name in HABANA_NAMES}
        for name in PACKAGES:
            self.modules[name].__path__ = []
        self._fill()

    def _fill(self) -> None:
        m = self.modules
        m["habana_frameworks.torch.core"].mark_step = self._mark_step  # type: ignore[attr-defined]
        m["habana_frameworks.torch.utils.internal"].is_lazy = self._is_lazy  # type: ignore[attr-defined]
        m["habana_frameworks.torch.hpu"].wrap_in_hpu_graph = self._wrap  # type: ignore[attr-defined]
        kernels = m["habana_frameworks.torch.hpex.kernels"]
        kernels.FusedSDPA = FakeFusedSDPA  # type: ignore[attr-defined]
        kernels.apply_rotary_pos_emb = fake_apply_rotary_pos_emb  # type: ignore[attr-defined]
        kernels.RotaryPosEmbeddingMode = RotaryPosEmbeddingMode  # type: ignore[attr-defined]
        norm = m["habana_frameworks.torch.hpex.normalization"]
        norm.FusedRMSNorm = FakeFusedRMSNorm  # type: ignore[attr-defined]
        bridge = m["habana_frameworks.torch.internal.bridge_config"]
        bridge.env_setting = self.bridge.env_setting  # type: ignore[attr-defined]

    # the modules' functions
    def _mark_step(self) -> None:
        self.calls.append("mark_step")

    def _is_lazy(self) -> bool:
        assert self.lazy is not None, "habana_frameworks.torch was not imported"
        return self.lazy

    def _wrap(self, model: Any) -> Any:
        self.calls.append("wrap_in_hpu_graph")
        return model

    def hpu_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if self._is_lazy():
            raise RuntimeError(
                "hpu_backend: torch.compile is not supported in lazy mode "
                f"({LAZY_ENV}=1); set {LAZY_ENV}=0"
            )
        self.calls.append("compile")
        return gm.forward

    # importlib protocol
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
            from torch._dynamo.backends.registry import register_backend

            def hpu_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
                return self.hpu_backend(gm, example_inputs)

            register_backend(hpu_backend, name="hpu_backend")

    # set-up
    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeHabana:
        for name in HABANA_NAMES:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [self, *sys.meta_path])
        monkeypatch.setattr(torch, "hpu", self.hpu, raising=False)
        return self

    def uninstall(self) -> None:
        from torch._dynamo.backends import registry

        registry._COMPILER_FNS.pop("hpu_backend", None)
        registry._BACKENDS.pop("hpu_backend", None)
        for name in HABANA_NAMES:
            sys.modules.pop(name, None)


def reject_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor as it meets HPU tensors: every compile raises (see module doc)."""
    import torch._inductor.compile_fx as compile_fx

    def compile_hpu(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Device hpu not supported")  # torch/_inductor/graph.py

    monkeypatch.setattr(compile_fx, "compile_fx", compile_hpu)


def check_gaudi_generate_kwargs(kwargs: dict[str, Any]) -> None:
    """optimum-habana's ``GaudiGenerationMixin.generate`` check
    (``transformers/generation/utils.py``): HPU graphs require lazy mode."""
    if kwargs.get("hpu_graphs") and not kwargs.get("lazy_mode"):
        raise ValueError(
            "`hpu_graphs` is True but `lazy_mode` is False. HPU graphs require "
            "`lazy_mode` to be set to True."
        )
