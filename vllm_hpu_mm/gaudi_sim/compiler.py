"""The simulated ``hpu_backend`` (Habana's torch.compile backend) and Inductor
as it meets HPU tensors.

What the real backend does and refuses (the bridge's
``python_packages/habana_frameworks/torch/dynamo/compile_backend/``, the
official plugin vllm-project/vllm-gaudi and Habana's docs, summarised in
docs/gaudi.md):

- It lowers the Dynamo graph through AOTAutograd (``aot_autograd`` with its own
  forward / inference compiler), so the graph the compiler sees is
  functionalised ATen: a ``torch.library.custom_op`` with ``mutates_args``
  becomes an ``auto_functionalized`` higher-order op.
- The compile passes implement only the ``cond`` and ``while_loop``
  higher-order ops and reinplace only plain ``index_copy`` on non-view
  inputs: any other higher-order op is refused here
  (``UnsupportedGraph``).
- The graph compiler is driven with static shapes: vllm-gaudi documents
  ``TypeError: Cannot convert symbols to int`` for graphs with symbolic or
  unbacked sizes (its ``patches.py``, ``batched_count_greater_than`` after
  ``mark_unbacked``, and ``dynamic=True`` helpers); refused here with that error.
- In lazy mode (``PT_HPU_LAZY_MODE=1``) torch.compile is not supported
  (vllm-gaudi ``platform.py``: "PT HPU lazy backend ... does not support
  torch.compile").
- Inductor has no HPU code generation (``torch/_inductor/graph.py`` raises
  "Device hpu not supported"): on the simulated Gaudi every Inductor
  compilation raises that error.

After the checks the graph runs eagerly on the host. ``Compilations`` counts
each compiled graph, so a test can check that serving compiles nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger("vllm.hpu_mm.gaudi_sim")

ALLOWED_HIGHER_ORDER_OPS = frozenset({"cond", "while_loop"})
# Logged once per compiled graph (a server's log shows what it compiled when).
COMPILE_LOG = "simulated hpu_backend compiled graph"


class UnsupportedGraph(RuntimeError):
    """A graph Habana's graph compiler refuses."""


class Compilations:
    """Graphs compiled by the simulated ``hpu_backend`` in this process."""

    count = 0
    names: list[str] = []

    @classmethod
    def add(cls, name: str) -> None:
        cls.count += 1
        cls.names.append(name)


def _symbolic(value: Any) -> str | None:
    """Why ``value`` (a node's example value) is not static, else None."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return f"symbolic scalar {value}"
    if isinstance(value, torch.Tensor) and any(
        not isinstance(s, int) for s in value.shape
    ):
        return f"symbolic size {tuple(value.shape)}"
    if isinstance(value, list | tuple):
        for item in value:
            reason = _symbolic(item)
            if reason:
                return reason
    return None


def check_graph(gm: torch.fx.GraphModule) -> None:
    """Refuse what Habana's graph compiler refuses (module doc)."""
    for node in gm.graph.nodes:
        target = node.target
        hop = node.op == "call_function" and isinstance(
            target, torch._ops.HigherOrderOperator
        )
        if hop and target.name() not in ALLOWED_HIGHER_ORDER_OPS:
            raise UnsupportedGraph(
                f"hpu_backend: higher-order op {target.name()!r} (node "
                f"{node.name}) is not supported by the graph compiler (only "
                f"{', '.join(sorted(ALLOWED_HIGHER_ORDER_OPS))}); a "
                "torch.library.custom_op with mutates_args becomes "
                "auto_functionalized: write with a plain in-place op instead"
            )
        reason = _symbolic(node.meta.get("val"))
        if reason:
            raise TypeError(
                f"Cannot convert symbols to int: hpu_backend compiles static "
                f"shapes only, node {node.name} has a {reason}"
            )


def copies_not_reinplaced(gm: torch.fx.GraphModule) -> list[str]:
    """The ``index_copy`` nodes whose destination is not a graph input itself
    (a view of one, or an intermediate): Habana's compile passes reinplace
    only a plain ``index_copy`` on a non-view input, so each of these copies
    its whole destination on every call (a KV cache written through a view of
    a ``[2, ...]`` K/V tensor is copied whole per layer and step)."""
    return [
        node.name
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node.target is torch.ops.aten.index_copy.default
        and node.args[0].op != "placeholder"
    ]


def make_hpu_backend(
    is_lazy: Callable[[], bool], lazy_env: str = "PT_HPU_LAZY_MODE"
) -> Callable[..., Any]:
    """The ``hpu_backend`` Dynamo backend of one process."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        check_graph(gm)
        copies = copies_not_reinplaced(gm)
        if copies:
            logger.warning(
                "simulated hpu_backend: %d index_copy on a view of a graph input "
                "(%s) would not be reinplaced on Gaudi: each copies its whole "
                "destination every call",
                len(copies),
                ", ".join(copies[:4]),
            )
        Compilations.add(gm.__class__.__name__)
        logger.info(
            "%s %d (%d nodes)", COMPILE_LOG, Compilations.count, len(gm.graph.nodes)
        )
        return make_boxed_func(gm.forward)

    lowered = aot_autograd(fw_compiler=compile_graph, inference_compiler=compile_graph)

    def hpu_backend(
        gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any
    ) -> Any:
        if is_lazy():
            raise RuntimeError(
                "hpu_backend: torch.compile is not supported in lazy mode "
                f"({lazy_env}=1); set {lazy_env}=0"
            )
        for value in example_inputs:
            reason = _symbolic(value)
            if reason:
                raise TypeError(
                    f"Cannot convert symbols to int: hpu_backend compiles static "
                    f"shapes only, an input has a {reason}"
                )
        return lowered(gm, example_inputs)

    return hpu_backend


def register_hpu_backend(backend: Callable[..., Any]) -> None:
    """Register ``backend`` under Dynamo's name ``hpu_backend`` (replacing a
    previous simulated one)."""
    from torch._dynamo.backends import registry

    registry._COMPILER_FNS.pop("hpu_backend", None)
    registry.register_backend(backend, name="hpu_backend")


def unregister_hpu_backend() -> None:
    from torch._dynamo.backends import registry

    registry._COMPILER_FNS.pop("hpu_backend", None)
    registry._BACKENDS.pop("hpu_backend", None)


def inductor_refusing_hpu() -> Callable[..., Any]:
    """``compile_fx`` as it meets HPU tensors."""

    def compile_fx(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Device hpu not supported")  # torch/_inductor/graph.py

    return compile_fx
