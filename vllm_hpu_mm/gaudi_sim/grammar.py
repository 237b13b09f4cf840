"""xgrammar's token-bitmask kernel as it meets HPU tensors, and the host
copies the simulated stack knows of.

The real selection rule: xgrammar's ``apply_token_bitmask_inplace``
(``xgrammar/matcher.py``, 0.2.x; vLLM 0.33's ``apply_grammar_bitmask`` in
``v1/structured_output/utils.py`` calls it with the runner's logits) picks
its kernel, with ``backend="auto"``, by ``logits.device.type``: ``cpu`` its
CPU kernel, ``cuda`` Triton, ``npu`` the torch-native one, and any other
device type ``torch_compile`` (``kernels/apply_token_bitmask_inplace_
torch_compile.py``: functions decorated ``@torch.compile(dynamic=True)``,
Inductor with symbolic shapes). On logits on a Gaudi card that is Inductor on
HPU tensors, which has no HPU code generation ("Device hpu not supported");
the official plugin applies the bitmask to a host copy of the logits
(vllm-gaudi ``hpu_model_runner.py``).

On the simulated Gaudi every "HPU" tensor is a host tensor: xgrammar would
see ``cpu`` and take its CPU kernel whatever the runner passes, and
``logits.cpu()`` returns the logits themselves. So the simulated stack keeps
the distinction itself:

- ``HostCopies``: the tensors the device module copied to the host
  (``vllm_hpu_mm.device.to_host`` makes a real copy on the simulated Gaudi and
  registers it here). A weak registry: an entry goes with its tensor. Every
  other tensor stands for one on the card (as ``bridge`` treats them).
- ``on_card``: xgrammar's entry point, wrapped so that with ``backend="auto"``
  logits that are not a registered host copy take the ``torch_compile``
  backend, as the real xgrammar does for device type ``hpu``; the simulated
  Inductor (``compiler.inductor_refusing_hpu``) then refuses it. In lazy mode
  Dynamo is off for the process (``device.claim_device``) and the kernel runs
  eagerly, as it would on the card.
- ``install``: wraps ``xgrammar.apply_token_bitmask_inplace`` now if xgrammar
  is imported, else when it is (vLLM imports it lazily, at the first
  structured-output step), so a process that never constrains an output does
  not pay for importing it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

MODULE = "xgrammar"
ENTRY = "apply_token_bitmask_inplace"


class HostCopies:
    """Tensors copied to the host by the device module (weakly held)."""

    def __init__(self) -> None:
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def copy(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new host tensor with ``t``'s values (cast to ``dtype``), recorded."""
        out = t.to(dtype=dtype or t.dtype, copy=True)
        self._copies[out] = True
        return out

    def holds(self, t: torch.Tensor) -> bool:
        return t in self._copies


def on_card(original: Callable[..., None], host: HostCopies) -> Callable[..., None]:
    """xgrammar's ``apply_token_bitmask_inplace`` choosing its backend as for
    HPU logits unless they are a host copy (module doc)."""

    @functools.wraps(original)
    def apply_token_bitmask_inplace(
        logits: torch.Tensor,
        bitmask: torch.Tensor,
        *,
        vocab_size: int | None = None,
        indices: Sequence[int] | torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        if backend == "auto" and not host.holds(logits):
            backend = "torch_compile"  # xgrammar's choice for device type hpu
        original(
            logits, bitmask, vocab_size=vocab_size, indices=indices, backend=backend
        )

    apply_token_bitmask_inplace.__sim_wrapped__ = True  # type: ignore[attr-defined]
    return apply_token_bitmask_inplace


def _wrap_module(module: types.ModuleType, host: HostCopies) -> None:
    entry = getattr(module, ENTRY)
    if not getattr(entry, "__sim_wrapped__", False):
        setattr(module, ENTRY, on_card(entry, host))


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds xgrammar as the path finder does and wraps its entry point once
    the module has run."""

    def __init__(self, host: HostCopies) -> None:
        self.host = host

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module
        host = self.host

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            _wrap_module(module, host)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader
        return spec


def install(host: HostCopies) -> None:
    """Wrap xgrammar's entry point in this process (now, or at its import)."""
    module = sys.modules.get(MODULE)
    if module is not None:
        _wrap_module(module, host)
    else:
        sys.meta_path.insert(0, _WrapOnImport(host))
