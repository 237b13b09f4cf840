"""Counting the work of a step from the ATen ops that run, and the minimum it needs.

``WorkCounter`` is a ``TorchDispatchMode``: every ATen op that runs under it
(eagerly, or inside a graph's compiled callable that enters it) is classified
by the buffers it touches, recognised by their storage:

- tensors are *tagged* by storage (``counter.tag(t, "kv")``: the KV cache,
  ``"weight"``, ``"encoder"`` store, ``"cross"`` cache, ``"kv_new"``: the step's
  fresh keys and values); a view shares its base's storage, so a slice, a
  transpose or ``kv_cache[0]`` keeps its tag;
- a view op reads nothing; a gather (``index_select``, ``index``, ``gather``,
  ``embedding``) reads the bytes it returns from its source; an op that writes
  into a tagged argument (``index_copy_``, ``copy_``, a mutating custom op such
  as ``hpu_mm::write_kv``) writes, it does not read that argument; every other
  op reads each tagged input's whole extent (a stride-0 dimension counted once);
- a *whole-buffer copy* is an op that copies a tagged tensor spanning its whole
  storage into a new one or onto another (``clone``, ``_to_copy``, ``copy_``,
  functional ``index_copy`` / ``index_put``: what functionalisation turns an
  in-place cache write into);
- a composite op that reaches the mode whole (``linear``, SDPA under
  ``inference_mode`` or inside an inlined custom op) is counted by the ops it
  decomposes into; a custom op is one opaque call unless ``inline`` names its
  Python implementation;
- FLOPs come from torch's ``flop_counter`` formulas (matmuls, convolutions,
  SDPA; the CPU's ``_scaled_dot_product_flash_attention_for_cpu`` added), per
  *scope*: ``with counter.scope("attention"):`` around the attention kernels.

The minimum a step needs (``minimum_*``) is computed from the batch alone:
attention as each new token against its own causal context, K/V as the bytes
the contexts hold, weights as each read once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

aten = torch.ops.aten

GATHER_OPS = {
    aten.index_select.default,
    aten.index.Tensor,
    aten.gather.default,
    aten.embedding.default,
    aten.take.default,
}
COPY_OPS = {
    aten.clone.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.copy.default,
    aten.index_copy.default,
    aten.index_put.default,
    aten.scatter.src,
    aten.select_scatter.default,
    aten.slice_scatter.default,
    aten.as_strided_scatter.default,
}


def _sdpa_cpu_flops(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    **kw: Any,
) -> int:
    """FLOPs of the CPU flash SDPA (not in torch's registry): QK and PV over the
    whole ``[S_q, S_k]`` square, as torch counts its other SDPA kernels; GQA
    (``enable_gqa``) counts the key heads as the query's. With ``is_causal``
    only the keys each query row reaches (row i: keys 0..i, top-left aligned as
    torch's causal mask is): the kernel skips the key blocks above the diagonal
    (so does FusedSDPA's causal mode), where torch's formula counts the square."""
    b, hq, sq, d = query.shape
    sk = key.shape[2]
    k_shape = (b, hq, sk, key.shape[3])
    v_shape = (b, hq, value.shape[2], value.shape[3])
    square = int(sdpa_flop_count((b, hq, sq, d), k_shape, v_shape))
    if not is_causal:
        return square
    m = min(sq, sk)  # rows below the last key column: 1, 2, ..., m keys
    reached = m * (m + 1) // 2 + (sq - m) * sk
    return square * reached // (sq * sk)


def _flops(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    if func == aten._scaled_dot_product_flash_attention_for_cpu.default:
        return _sdpa_cpu_flops(*args, **kwargs)
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def unique_bytes(t: torch.Tensor) -> int:
    """Bytes a read of ``t`` touches: its elements, a broadcast (stride-0)
    dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


@dataclass(slots=True)
class WorkCounts:
    """What the ops under a ``WorkCounter`` did (bytes and FLOPs)."""

    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """FLOPs by scope (``"attention"``, ``"other"`` outside any scope), and
    ``"dense"``: ops with a ``"weight"``-tagged operand, in any scope."""
    reads: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes read by tag (``"kv"``, ``"kv_new"``, ``"weight"``, ...), by scope:
    key ``"<scope>:<tag>"``."""
    writes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes written into tagged buffers, by tag."""
    copies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Whole-buffer copies by tag."""
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Calls of each op, by scope: key ``"<scope>:<op>"``."""
    per_buffer: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes read from each tagged storage (by its address), all scopes."""

    def read(self, tag: str, scope: str | None = None) -> int:
        """Bytes read from ``tag``, in ``scope`` or in all scopes."""
        return sum(
            v
            for k, v in self.reads.items()
            if k.split(":", 1)[1] == tag
            and (scope is None or k.startswith(scope + ":"))
        )


class WorkCounter(TorchDispatchMode):
    """Counts FLOPs, tagged-buffer reads and writes, and whole-buffer copies of
    the ATen ops dispatched under it (see the module docstring).

    Higher-order ops reach it too: ``auto_functionalized`` (what AOTAutograd
    makes of a mutating custom op such as ``hpu_mm::write_kv``) clones every
    tagged buffer it mutates when it runs unreinplaced, so each is a
    whole-buffer copy."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, str] = {}
        # custom op -> its Python implementation, run under the counter (a
        # custom op is otherwise one opaque call: its inner ops go uncounted)
        self.inline: dict[Any, Any] = {}
        self.whole: dict[int, int] = {}
        self._kept: list[torch.Tensor] = []
        self.counts = WorkCounts()
        self._scope = "other"

    def tag(self, t: torch.Tensor, name: str, whole_bytes: int | None = None) -> None:
        """Name ``t``'s storage (and every view of it) ``name``. A copy of at
        least ``whole_bytes`` from it (default: all of ``t``) is a whole-buffer
        copy (a cache holding K and V in one tensor: one of the two)."""
        ptr = t.untyped_storage().data_ptr()
        self.tags[ptr] = name
        self.whole[ptr] = whole_bytes or unique_bytes(t)
        # Kept alive: a freed storage's address would tag a later tensor.
        self._kept.append(t)

    def tag_module(self, module: torch.nn.Module, name: str = "weight") -> None:
        for p in module.parameters():
            self.tag(p, name)

    def tag_of(self, t: object) -> str | None:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return None
        return self.tags.get(t.untyped_storage().data_ptr())

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Attribute the FLOPs and reads of the ops inside to ``name``."""
        outer, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = outer

    def scope_modules(
        self, model: torch.nn.Module, kind: type[torch.nn.Module], name: str
    ) -> list[Any]:
        """Attribute the ops of every ``kind`` submodule's forward to scope
        ``name`` (forward hooks); returns the hook handles."""
        handles: list[Any] = []
        saved: list[str] = []

        def enter(module: torch.nn.Module, args: Any) -> None:
            saved.append(self._scope)
            self._scope = name

        def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
            self._scope = saved.pop()

        for m in model.modules():
            if isinstance(m, kind):
                handles.append(m.register_forward_pre_hook(enter))
                handles.append(m.register_forward_hook(leave))
        return handles

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        self.counts.calls[f"{self._scope}:{func}"] += 1
        if func in self.inline:
            with self:  # the custom op's own ops, counted
                return self.inline[func](*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        ):
            # a composite op that reached the mode whole (below the autograd
            # key: inside an inlined custom op, or under inference_mode):
            # counted by the ops it decomposes into
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        return out

    def _higher_order(
        self, func: HigherOrderOperator, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        if func.name().startswith("auto_functionalized"):
            # v2 clones ``_all_bases``; v1 the mutated tensor arguments
            bases = kwargs.get("_all_bases")
            flat = bases if bases is not None else tree_flatten(kwargs)[0]
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self._copied(t, unique_bytes(t))
        return func(*args, **kwargs)

    def _copied(self, t: torch.Tensor, nbytes: int) -> None:
        """A copy of ``nbytes`` out of (or onto) ``t``: whole-buffer copies of
        its tag, in units of ``whole_bytes`` (a cache holding one layer's K
        and V in one tensor, cloned: 2)."""
        tag = self.tag_of(t)
        if tag is not None:
            self.counts.copies[tag] += (
                nbytes // self.whole[t.untyped_storage().data_ptr()]
            )

    def _count(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> None:
        c = self.counts
        flops = _flops(func, args, kwargs, out)
        if flops:
            # a matmul with a weight operand is a dense layer's, whatever scope
            # it runs in (a vision attention module's projections)
            weighted = any(
                self.tag_of(t) == "weight" for t in tree_flatten(list(args))[0]
            )
            c.flops["dense" if weighted else self._scope] += flops
        schema = func._schema
        if any(r.alias_info is not None for r in schema.returns) and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
        ):
            return  # a view: no data moves
        written = self._written(schema, args, kwargs)
        flat, _ = tree_flatten((list(args), kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        # An op that writes a tagged buffer reads its sources to write them:
        # those reads are the write's (``<tag>@write``), not the step's reads.
        suffix = (
            "@write" if any(self.tag_of(t) for t in tensors if id(t) in written) else ""
        )
        for i, t in enumerate(tensors):
            tag = self.tag_of(t)
            if tag is None:
                continue
            if id(t) in written:
                c.writes[tag] += self._write_bytes(tensors, t, written)
                continue
            if func in GATHER_OPS and i == 0:
                nbytes = sum(
                    o.numel() * o.element_size()
                    for o in tree_flatten(out)[0]
                    if isinstance(o, torch.Tensor)
                )
            else:
                nbytes = unique_bytes(t)
            c.reads[f"{self._scope}:{tag}{suffix}"] += nbytes
            if not suffix:
                c.per_buffer[t.untyped_storage().data_ptr()] += nbytes
            if func in COPY_OPS and i == 0:
                self._copied(t, unique_bytes(t))
                if isinstance(out, torch.Tensor) and out.numel() == t.numel():
                    # a copy of a buffer is that buffer (functionalisation's
                    # next write goes to it)
                    self.tag(out, tag, self.whole[t.untyped_storage().data_ptr()])
        if func in COPY_OPS and written:
            # copy_ of a whole buffer onto a tagged one (functionalisation's
            # write-back of a mutated graph input)
            dst = next(t for t in tensors if id(t) in written)
            src = [t for t in tensors if t is not dst and t.is_floating_point()]
            if src and self.tag_of(src[0]) is None:
                self._copied(dst, unique_bytes(src[0]))

    @staticmethod
    def _written(schema: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> set[int]:
        ids: set[int] = set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(value, torch.Tensor):
                ids.add(id(value))
        return ids

    def _write_bytes(
        self, tensors: list[torch.Tensor], dst: torch.Tensor, written: set[int]
    ) -> int:
        """Bytes an op writes into ``dst``: its floating-point tensor arguments
        that it does not write (the source rows; indices are integers; an op
        writing K and V takes each other's cache as no source; its sources are
        shared evenly between the tensors it writes), at most ``dst``'s
        extent."""
        src = [
            t
            for t in tensors
            if t is not dst and id(t) not in written and t.is_floating_point()
        ]
        if not src:
            return unique_bytes(dst)
        n = sum(unique_bytes(t) for t in src) // max(len(written), 1)
        return min(n, unique_bytes(dst))


# --------------------------------------------------------------------------
# The minimum a step needs, from the batch alone
# --------------------------------------------------------------------------


def minimum_attention_flops(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_heads: int,
    head_size: int,
    layers: int = 1,
) -> int:
    """Each new token against its own causal context: a token at position ``p``
    attends ``p + 1`` keys; QK and PV cost ``2 * H * D`` FLOPs a key each."""
    keys = 0
    for q, s in zip(query_lens, seq_lens, strict=True):
        # positions s - q .. s - 1 attend s - q + 1 .. s keys
        keys += q * (s - q) + q * (q + 1) // 2
    return layers * keys * 4 * num_heads * head_size


def minimum_kv_bytes(
    seq_lens: Sequence[int],
    num_kv_heads: int,
    head_size: int,
    dtype_bytes: int,
    layers: int = 1,
) -> int:
    """The K and V bytes the requests' contexts hold (each read once)."""
    return layers * sum(seq_lens) * 2 * num_kv_heads * head_size * dtype_bytes


def minimum_weight_bytes(module: torch.nn.Module) -> int:
    """Every parameter read once."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def needed_weight_bytes(counts: WorkCounts, module: torch.nn.Module) -> int:
    """Each parameter's bytes the step read at least once: all of a matmul's
    weight, the gathered rows of an embedding table (at most the parameter)."""
    total = 0
    for p in module.parameters():
        read = counts.per_buffer.get(p.untyped_storage().data_ptr(), 0)
        total += min(read, p.numel() * p.element_size())
    return total
