"""The simulated ``hpu_backend`` (Habana's torch.compile backend) and Inductor
as it meets HPU tensors.

What the real backend does and refuses (the bridge's
``python_packages/habana_frameworks/torch/dynamo/compile_backend/``, the
official plugin vllm-project/vllm-gaudi and Habana's docs, summarised in
docs/gaudi.md):

- It lowers the Dynamo graph through AOTAutograd (``aot_autograd`` with its own
  forward / inference compiler), so the graph the compiler sees is
  functionalised ATen: a ``torch.library.custom_op`` with ``mutates_args``
  becomes an ``auto_functionalized`` higher-order op. Input mutations stay in
  the graph (``keep_inference_input_mutations``, the bridge's
  ``PT_HPU_KEEP_INPUT_MUTATIONS``, default 1 in its ``compile_backend/
  config.py``): a write to an input ends the graph as ``copy_(input, new)``.
- Its passes turn ``index_copy(input, ...)`` followed by ``copy_(input, that)``
  back into an in-place ``index_copy_`` on the input, an input that is not a
  view into a larger storage (the official plugin's KV write relies on it:
  vllm-gaudi ``VLLMKVCache``, one K and one V tensor allocated per layer;
  ``view_inputs`` finds the others). Any other ``copy_`` into an input (a
  write through a view taken in the graph rebuilds the whole base with
  ``select_scatter`` and copies it back; a write into a view input), a
  write AOTAutograd leaves to its runtime epilogue, or a ``clone`` of an
  input costs a copy of the whole input on every call:
  ``reinplace_input_writes`` does the first, the others are counted
  (``InputCopies``) and logged (``INPUT_COPY_LOG``), so a test can require
  zero whole-cache copies.
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
# Logged per compiled graph that copies whole inputs (what and how many).
INPUT_COPY_LOG = "simulated hpu_backend: whole copies of graph inputs"


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


class InputCopies:
    """Whole copies of graph inputs in the graphs compiled in this process
    (``copies_of_inputs``), each a copy of the whole input on every call."""

    count = 0
    names: list[str] = []

    @classmethod
    def add(cls, names: list[str]) -> None:
        cls.count += len(names)
        cls.names.extend(names)


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


_COPY = torch.ops.aten.copy_.default
_INDEX_COPY = torch.ops.aten.index_copy.default


def view_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> set[str]:
    """Names of the placeholders whose example input is a view into a larger
    storage (an offset into it, or fewer bytes than it holds): say the K or V
    half of one ``[2, ...]`` cache passed in as two inputs. AOTAutograd keeps
    such inputs apart when they do not overlap; Habana's passes reinplace
    ``index_copy`` on non-view inputs only (module doc)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    views = set()
    for name, value in zip(names, example_inputs, strict=False):
        if not isinstance(value, torch.Tensor):
            continue
        spans = value.numel() * value.element_size()
        storage = value.untyped_storage().nbytes()
        if value.storage_offset() or storage > spans:
            views.add(name)
    return views


def reinplace_input_writes(
    gm: torch.fx.GraphModule, views: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Turn ``copy_(x, index_copy(x, dim, index, src))`` on a graph input ``x``
    into ``index_copy_(x, dim, index, src)``, as Habana's passes do (module
    doc), where ``x`` is not a view (``views``: placeholder names) and nothing
    reads ``x``'s old value after the write. Returns the names of the
    rewritten writes; the graph is recompiled in place."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _COPY:
            continue
        dest, src = node.args[0], node.args[1]
        if not isinstance(dest, torch.fx.Node) or not isinstance(src, torch.fx.Node):
            continue
        if dest.op != "placeholder" or dest.name in views:
            continue
        if src.target is not _INDEX_COPY or src.args[0] is not dest:
            continue
        later_reads = [
            u for u in dest.users if u not in (src, node) and order[u] > order[src]
        ]
        if later_reads:
            continue
        src.target = torch.ops.aten.index_copy_.default
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        done.append(src.name)
    if done:
        gm.recompile()
    return done


def copies_of_inputs(gm: torch.fx.GraphModule, runtime_mutations: int = 0) -> list[str]:
    """What copies a whole graph input on every call, after
    ``reinplace_input_writes``: each remaining ``copy_`` into an input (a write
    through a view of it, say the K or V half of one ``[2, ...]`` KV cache),
    each ``clone`` of an input, and ``runtime_mutations`` inputs written back
    by AOTAutograd's epilogue outside the graph."""
    names = [
        f"{node.name} ({node.target.__name__} of {node.args[0].name})"
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node.target in (_COPY, torch.ops.aten.clone.default)
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    ]
    return names + [f"epilogue write {i}" for i in range(runtime_mutations)]


def _runtime_mutations() -> int:
    """Inputs AOTAutograd mutates in its runtime epilogue (outside the graph)
    for the graph being compiled."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return 0
    return len(getattr(meta, "mutated_inp_runtime_indices", ()))


def make_hpu_backend(
    is_lazy: Callable[[], bool], lazy_env: str = "PT_HPU_LAZY_MODE"
) -> Callable[..., Any]:
    """The ``hpu_backend`` Dynamo backend of one process."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        check_graph(gm)
        reinplace_input_writes(gm, view_inputs(gm, example_inputs))
        copies = copies_of_inputs(gm, _runtime_mutations())
        if copies:
            InputCopies.add(copies)
            logger.warning(
                "%s: %d (%s): each copies a whole input every call on Gaudi "
                "(Habana reinplaces only index_copy on a non-view input)",
                INPUT_COPY_LOG,
                len(copies),
                ", ".join(copies[:4]),
            )
        Compilations.add(gm.__class__.__name__)
        logger.info(
            "%s %d (%d nodes)", COMPILE_LOG, Compilations.count, len(gm.graph.nodes)
        )
        return make_boxed_func(gm.forward)

    lowered = aot_autograd(
        fw_compiler=compile_graph,
        inference_compiler=compile_graph,
        keep_inference_input_mutations=True,
    )

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
