"""Bucket sets and lookup: pure functions over ints (no torch, no vLLM).

A step is padded along three axes, each with its own sorted list of sizes:

- ``tokens``: the step's prefill token rows (flat).
- ``batch``: requests in the step (rows of logits) and decode rows.
- ``blocks``: KV-cache blocks read by decode attention (the decode rows' flat
  block list, or their block-table width);
- ``prefill_blocks``: context blocks of the widest prefill tile. Unless given,
  the ``blocks`` list: a bucket file has one block list for both; the default
  set (``prior``) gives prefill its own, short one.

Attention runs inside the compiled body, so a graph is keyed by the whole step
shape. A step runs as a decode part ``(batch, blocks)`` and a prefill part
``(tokens, blocks)`` (a mixed step as two passes): graphs add up over the two
parts instead of multiplying, and ``step_shapes`` lists every key serving can
produce, which is what warmup compiles.

Flat layout: a step pads its *total* token count once, not every prompt to the
longest, so the waste is one bucket's slack per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Limits:
    """Engine limits that bound every bucket."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def max_tokens(self) -> int:
        """Most token rows a step can have."""
        return self.max_num_batched_tokens

    @property
    def max_blocks(self) -> int:
        """Most context blocks one step can read (all requests at full length)."""
        return self.max_num_seqs * self.max_blocks_per_seq


PREFILL_TILE = 128
"""Query rows of a prefill tile (``attention.layout.PREFILL_TILE``)."""


@dataclass(frozen=True, slots=True)
class BucketSet:
    tokens: tuple[int, ...]
    batch: tuple[int, ...]
    blocks: tuple[int, ...]
    prefill_blocks: tuple[int, ...] = ()
    """Block sizes of the prefill part; empty (the default) means ``blocks``."""

    def __post_init__(self) -> None:
        if not self.prefill_blocks:
            object.__setattr__(self, "prefill_blocks", self.blocks)
        for axis in ("tokens", "batch", "blocks", "prefill_blocks"):
            values = getattr(self, axis)
            if not values:
                raise ValueError(f"bucket axis {axis!r} is empty")
            if list(values) != sorted(set(values)) or values[0] <= 0:
                raise ValueError(
                    f"bucket axis {axis!r} must be strictly increasing positive "
                    f"ints, got {list(values)}"
                )

    @property
    def num_graphs(self) -> int:
        """Axis sizes (token plus batch sizes): the budget unit of the planner.
        The graphs warmup compiles are ``count_graphs``."""
        return len(self.tokens) + len(self.batch)


def _prev(values: Sequence[int], v: int) -> int:
    """The bucket below v (0 when v is the smallest)."""
    below = [x for x in values if x < v]
    return below[-1] if below else 0


def _fit_or_top(value: int, values: Sequence[int]) -> int:
    fit = smallest_fit(value, values)
    return fit if fit is not None else values[-1]


def step_shapes(
    buckets: BucketSet,
    limits: Limits,
    decode_form: str = "flat",
    prefill_tile: int = PREFILL_TILE,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every graph key serving can produce: (decode rows, decode blocks) and
    (prefill tokens, prefill blocks), as the Bucketer pads real steps.

    Decode: a batch bucket B holds more decodes than the bucket below it, each
    with at least one block and at most ``max_blocks_per_seq``; the flat list
    then holds between those counts of blocks, the batched table's width is at
    most ``max_blocks_per_seq``. Prefill: a token bucket T holds more tokens
    than the bucket below it (and at least 2); its widest tile (``min(tile, T)``
    rows) reads at least its rows' blocks and, by this enumeration, at most one
    full-length request plus the tile's own rows. A step above that (several
    long prefix-cache hits in one tile) pads to a size not warmed (or, above
    the axis, takes the fallback: warned, counted). Decode keys take their
    blocks from ``blocks``, prefill keys from ``prefill_blocks``.
    """
    bs, per_seq = limits.block_size, limits.max_blocks_per_seq
    blocks = buckets.blocks
    decode: list[tuple[int, int]] = []
    for b in buckets.batch:
        reqs = _prev(buckets.batch, b) + 1
        if decode_form == "flat":
            lo = _fit_or_top(reqs, blocks)
            hi = _fit_or_top(min(b * per_seq, limits.max_blocks), blocks)
        else:
            lo, hi = blocks[0], _fit_or_top(per_seq, blocks)
        decode += [(b, n) for n in blocks if lo <= n <= hi]
    prefill: list[tuple[int, int]] = []
    pre = buckets.prefill_blocks
    for t in buckets.tokens:
        rows = max(_prev(buckets.tokens, t) + 1, 2)
        if rows > t:
            continue  # no prefill part lands here (1 token is a decode row)
        tq = min(prefill_tile, t)
        lo = _fit_or_top(-(-min(rows, tq) // bs), pre)
        hi = _fit_or_top(prefill_blocks_reach(limits, tq), pre)
        prefill += [(t, n) for n in pre if lo <= n <= hi]
    return decode, prefill


OneRequestForm = Literal["request", "causal"]
"""The one-request forms of ``attention.layout.PrefillForm``."""


def one_request_shapes(
    buckets: BucketSet, limits: Limits, prefill_tile: int = PREFILL_TILE
) -> list[tuple[int, int, OneRequestForm]]:
    """The graph keys of prefill parts of one request above one tile
    (``attention.layout.PrefillForm``), as ``(tokens, prefill blocks, form)``:
    for each token bucket T that can hold more than ``prefill_tile`` rows, a
    ``causal`` key (a fresh prompt; blocks 0: its gather covers T's rows) and
    ``request`` keys over the prefill block sizes a request of those rows can
    read (its rows' blocks up to one full-length request's)."""
    bs = limits.block_size
    pre = buckets.prefill_blocks
    out: list[tuple[int, int, OneRequestForm]] = []
    for t in buckets.tokens:
        rows = max(_prev(buckets.tokens, t) + 1, prefill_tile + 1)
        if rows > t:
            continue  # every part landing here fits one tile: ``tiles``
        out.append((t, 0, "causal"))
        lo = _fit_or_top(-(-rows // bs), pre)
        hi = _fit_or_top(limits.max_blocks_per_seq, pre)
        out += [(t, n, "request") for n in pre if lo <= n <= hi]
    return out


def prefill_blocks_reach(limits: Limits, tile_rows: int = PREFILL_TILE) -> int:
    """Most context blocks a prefill tile of ``tile_rows`` rows reads in
    ``step_shapes``' enumeration: one full-length request plus the tile's own
    rows (and one block of misalignment), at most ``max_blocks``."""
    rows = min(tile_rows, limits.max_tokens)
    reach = limits.max_blocks_per_seq + -(-rows // limits.block_size) + 1
    return min(reach, limits.max_blocks)


def token_shapes(
    decode: Sequence[tuple[int, int]], prefill: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """With attention outside the graphs (an opaque op), a graph is keyed by its
    token rows only: one step shape per distinct row count serves them all. Of
    ``step_shapes``' lists, keeps the first decode shape of each batch size and
    the first prefill shape of each token size that no decode shape has."""
    rows: set[int] = set()
    kept_decode, kept_prefill = [], []
    for b, n in decode:
        if b not in rows:
            rows.add(b)
            kept_decode.append((b, n))
    for t, n in prefill:
        if t not in rows:
            rows.add(t)
            kept_prefill.append((t, n))
    return kept_decode, kept_prefill


def count_graphs(
    buckets: BucketSet,
    limits: Limits,
    decode_form: str = "flat",
    prefill_tile: int = PREFILL_TILE,
    opaque_attention: bool = False,
    symbolic_tokens: bool = False,
    one_request: bool = False,
) -> int:
    """Graphs warmup compiles: every step key (with ``opaque_attention``, every
    token count) plus one logits graph per batch size. ``symbolic_tokens`` (opaque
    attention on the CPU and CUDA): warmup's first, smallest size compiles a static
    graph and the second a symbolic one that serves every larger size, so at most
    two per region. ``one_request``: the static plan's one-request prefill keys
    (``one_request_shapes``, ``bucketing.prefill_one_request``) are counted too;
    without it, the tile-form keys alone (what the default set and the planner
    hold to their budgets)."""
    decode, prefill = step_shapes(buckets, limits, decode_form, prefill_tile)
    if opaque_attention:
        decode, prefill = token_shapes(decode, prefill)
        if symbolic_tokens:
            return min(2, len(decode) + len(prefill)) + min(2, len(buckets.batch))
        one_request = False  # graphs keyed by token rows alone
    extra = len(one_request_shapes(buckets, limits, prefill_tile)) if one_request else 0
    return len(decode) + len(prefill) + extra + len(buckets.batch)


def exponential(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... and hi itself (lo <= hi)."""
    _check_range(lo, hi)
    out = []
    v = lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return tuple(out)


def linear(lo: int, step: int, hi: int) -> tuple[int, ...]:
    """lo, then multiples of step above lo, and hi itself."""
    _check_range(lo, hi)
    if step <= 0:
        raise ValueError(f"linear step must be positive, got {step}")
    first = (lo // step + 1) * step
    return tuple(sorted({lo, *range(first, hi, step), hi}))


def _check_range(lo: int, hi: int) -> None:
    if lo <= 0 or hi < lo:
        raise ValueError(f"bucket range needs 0 < lo <= hi, got lo={lo}, hi={hi}")


def clip(values: Iterable[int], hi: int) -> tuple[int, ...]:
    """Sorted unique values in (0, hi], with hi appended so the axis covers it."""
    return tuple(sorted({v for v in values if 0 < v < hi} | {hi}))


def default_buckets(
    limits: Limits,
    strategy: str,
    min_tokens: int = 16,
    token_step: int = 128,
    batch_step: int = 8,
    block_step: int = 16,
    min_batch: int = 1,
) -> BucketSet:
    """Buckets for the whole range the limits allow."""
    max_batch = limits.max_num_seqs
    min_batch = min(min_batch, max_batch)
    if strategy == "prior":
        from vllm_hpu_mm.bucketing.prior import prior_buckets

        return prior_buckets(limits, min_tokens=min_tokens, min_batch=min_batch)
    if strategy == "exponential":
        tokens = exponential(min(min_tokens, limits.max_tokens), limits.max_tokens)
        batch = exponential(min_batch, max_batch)
        blocks = exponential(1, limits.max_blocks)
    elif strategy == "linear":
        tokens = linear(
            min(min_tokens, limits.max_tokens), token_step, limits.max_tokens
        )
        batch = linear(min_batch, batch_step, max_batch)
        blocks = linear(1, block_step, limits.max_blocks)
    else:
        raise ValueError(
            f"bucket strategy {strategy!r} is not one of 'prior', 'exponential', "
            "'linear' "
            "(use 'explicit' with a file for hand-picked lists)"
        )
    return BucketSet(tokens=clip(tokens, limits.max_tokens), batch=batch, blocks=blocks)


def explicit(
    limits: Limits, tokens: Sequence[int], batch: Sequence[int], blocks: Sequence[int]
) -> BucketSet:
    """Hand-picked (or planner-fitted) lists, clipped to the limits. They are
    not closed at the limits: a rarer, larger step takes the fallback."""

    def within(values: Iterable[int], hi: int) -> tuple[int, ...]:
        return tuple(sorted({v for v in values if 0 < v <= hi}))

    return BucketSet(
        tokens=within(tokens, limits.max_tokens),
        batch=within(batch, limits.max_num_seqs),
        blocks=within(blocks, limits.max_blocks),
    )


def smallest_fit(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= value, or None when none fits (binary search)."""
    lo, hi = 0, len(buckets)
    while lo < hi:
        mid = (lo + hi) // 2
        if buckets[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return buckets[lo] if lo < len(buckets) else None


def fallback_size(
    value: int, buckets: Sequence[int], max_pad_ratio: float = 2.0
) -> int:
    """Size for a value above every bucket: the next multiple of the largest
    bucket's power-of-two alignment (so repeated outliers share a shape), but
    never more than ``max_pad_ratio`` times the value."""
    top = buckets[-1]
    align = 1 << (top.bit_length() - 1)
    aligned = math.ceil(value / align) * align
    return max(value, min(aligned, math.floor(value * max_pad_ratio)))


def padding_ratio(real: Iterable[int], padded: Iterable[int]) -> float:
    """Share of padded rows that are padding: 1 - sum(real) / sum(padded)."""
    r, p = sum(real), sum(padded)
    return 0.0 if p == 0 else 1.0 - r / p


def from_config(limits: Limits, bucketing: Any) -> BucketSet | None:
    """The bucket set a ``hpu_mm.bucketing`` config asks for (None: off)."""
    strategy = bucketing.strategy
    if strategy == "off":
        return None
    if strategy == "explicit":
        lists = bucketing.buckets
        return explicit(limits, lists.prefill_tokens, lists.decode_batch, lists.blocks)
    return default_buckets(
        limits,
        strategy,
        min_tokens=bucketing.prefill_min_tokens,
        token_step=bucketing.prefill_step_tokens,
        batch_step=bucketing.decode_step_batch,
        block_step=bucketing.block_step,
        min_batch=bucketing.decode_min_batch,
    )
