"""Bucket edges planned from a workload sample (pure Python and numpy).

The padding of one axis is ``sum(bucket(v) - v)`` over the sampled sizes ``v``.
For at most ``k`` edges it is minimised exactly by dynamic programming over the
sorted distinct sizes: an optimal edge always sits on a sampled size (lowering
it to the largest size it serves pads no row more), so the candidates are the
sizes themselves, plus any edge the caller forces.

``plan_buckets`` spends a budget of axis sizes (``BucketSet.num_graphs``: token
sizes plus batch sizes) on the ``tokens`` (prefill rows) and ``batch`` (requests
and decode rows) axes. It tries every split, plans the batch axis, then the
token axis, and keeps the split with the least padding share of token rows
(decode rows padded to a batch size, prefill rows to a token size) plus of
logits rows (shares, not row counts: prefill tokens outnumber logits rows by
far, and counting rows would starve the batch axis). ``blocks`` gets its own
cap of planned edges, plus edges doubling from the largest planned one up to
``max_blocks`` so that a step larger than any sampled pads by less than 2x.
With attention inside the graph, the graphs warmup compiles are the step
shapes of the set (``buckets.count_graphs``: decode rows x blocks, prefill
tokens x blocks, within what real steps reach); ``step_graph_budget`` caps them
by trimming the block edges the sample uses least.

``simulate_steps`` draws the DESIGN's seeded workloads; ``evaluate`` pads a
sample with the real ``Bucketer`` and reports padding and fallbacks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_hpu_mm.bucketing.buckets import (
    BucketSet,
    Limits,
    count_graphs,
    explicit,
    fallback_size,
    one_request_shapes,
    padding_ratio,
    smallest_fit,
)
from vllm_hpu_mm.bucketing.policy import Bucketer, StepSizes

__all__ = [
    "DEFAULT_BLOCK_BUDGET",
    "MAX_DISTINCT",
    "WORKLOADS",
    "AxisSamples",
    "Plan",
    "axis_padding",
    "evaluate",
    "plan_axis",
    "plan_buckets",
    "plan_buckets_detailed",
    "plan_buckets_from_axes",
    "prompt_lengths",
    "simulate_steps",
]

MAX_DISTINCT = 2048
"""Above this many distinct sizes, ``plan_axis`` bins them first (see there)."""

DEFAULT_BLOCK_BUDGET = 16
"""Block-axis edges: they add no graph on CPU/CUDA, so they have their own cap."""

WORKLOADS = ("single", "chunked", "decode")
"""The DESIGN's seeded workloads ("Where padding comes from")."""


# --------------------------------------------------------------------------
# One axis: exact DP
# --------------------------------------------------------------------------


def axis_padding(values: Iterable[int], edges: Sequence[int]) -> int:
    """``sum(bucket(v) - v)`` of the values that fit under ``edges`` (sorted)."""
    total = 0
    for v in values:
        fit = smallest_fit(v, edges)
        if fit is not None:
            total += fit - v
    return total


def _bin(values: np.ndarray, top: int | None, max_distinct: int) -> np.ndarray:
    """Values rounded up to multiples of q (clamped to ``top``) so at most
    about ``max_distinct`` stay distinct; each then pads by < q rows more."""
    if np.unique(values).size <= max_distinct:
        return values
    q = math.ceil(int(values.max()) / max_distinct)
    binned = -(-values // q) * q
    return np.minimum(binned, top) if top is not None else binned


def plan_axis(
    values: Sequence[int],
    max_buckets: int,
    top: int | None = None,
    *,
    fixed: Iterable[int] = (),
    max_distinct: int = MAX_DISTINCT,
    weights: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """At most ``max_buckets`` sorted edges minimising ``sum(bucket(v) - v)``.

    values: sampled sizes of one axis; zeros (axis unused) and, when ``top`` is
    given, sizes above it (illegal: they take the fallback whatever the edges)
    are ignored. Repeats weigh in. top: forced as the last edge, so every legal
    size fits; without it the last edge is the largest value (or fixed edge).
    fixed: edges forced in as well (they count towards ``max_buckets``; those
    above ``top`` are dropped).

    Exact over the distinct values: ``O(k * n**2)`` time, ``O(n**2)`` memory.
    With more than ``max_distinct`` distinct values they are first rounded up to
    multiples of ``q = ceil(max / max_distinct)`` (clamped to ``top``): every
    edge is then a multiple of q, a forced edge or ``top``; without forced
    edges off that grid, the result is within ``(q - 1) * len(values)`` rows
    of the optimum.

    weights: how many times each value occurred (default: once each), so a
    histogram plans like the list it counts.

    Among plans of equal padding, the one with fewest edges is returned.
    """
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    if top is not None and top <= 0:
        raise ValueError(f"top must be a positive int, got {top}")
    arr = np.asarray([int(v) for v in values], dtype=np.int64)
    wts = (
        np.ones(arr.size, np.int64)
        if weights is None
        else np.asarray([int(w) for w in weights], dtype=np.int64)
    )
    if wts.shape != arr.shape or (wts < 0).any():
        raise ValueError("weights must be one non-negative count per value")
    keep = (arr > 0) & (wts > 0)
    if top is not None:
        keep &= arr <= top
    arr, wts = arr[keep], wts[keep]
    forced = {int(f) for f in fixed if int(f) > 0 and (top is None or f <= top)}
    if top is not None:
        forced.add(top)
    if arr.size:
        arr = _bin(arr, top, max_distinct)
        forced.add(int(arr.max()) if top is None else top)
    if not forced:
        raise ValueError("plan_axis needs values, a top or fixed edges")
    if len(forced) > max_buckets:
        raise ValueError(
            f"{len(forced)} forced edges {sorted(forced)} exceed max_buckets="
            f"{max_buckets}"
        )

    distinct, where = np.unique(arr, return_inverse=True)
    counts = np.bincount(where.ravel(), weights=wts, minlength=distinct.size)
    cand = np.union1d(distinct, np.fromiter(forced, np.int64))
    n = cand.size
    # Index 0 is a virtual edge at 0; candidates are 1..n.
    c = np.concatenate(([0], cand)).astype(np.float64)
    w = np.zeros(n + 1)
    w[1:][np.searchsorted(cand, distinct)] = counts
    wsum, vsum = np.cumsum(w), np.cumsum(w * c)
    # cost[j, i]: values in (c_j, c_i] padded up to c_i.
    cost = c[None, :] * (wsum[None, :] - wsum[:, None]) - (
        vsum[None, :] - vsum[:, None]
    )
    idx = np.arange(n + 1)
    forced_idx = np.sort(np.searchsorted(cand, sorted(forced)) + 1)
    # next forced index strictly after j: an edge after j may not skip it.
    nxt = forced_idx[
        np.minimum(np.searchsorted(forced_idx, idx, side="right"), forced_idx.size - 1)
    ]
    nxt = np.where(idx < forced_idx[-1], nxt, n)
    valid = (idx[:, None] < idx[None, :]) & (idx[None, :] <= nxt[:, None])
    cost = np.where(valid, cost, np.inf)

    layer = cost[0].copy()  # layer[i]: least padding of values <= c_i, last edge i
    parents = [np.zeros(n + 1, dtype=np.int64)]  # parents[k-1][i]: edge before i
    best_k, best_cost = 1, layer[n]
    for k in range(2, min(max_buckets, n) + 1):
        if best_cost == 0:
            break
        total = layer[:, None] + cost
        total[0, :] = np.inf  # a k-th edge needs a (k-1)-th edge before it
        parent = np.argmin(total, axis=0)
        layer = total[parent, idx]
        parents.append(parent)
        if layer[n] < best_cost:  # strictly: fewest edges among equal plans
            best_k, best_cost = k, layer[n]
    if not math.isfinite(best_cost):  # pragma: no cover - forced fits the budget
        raise AssertionError("no feasible plan")
    edges = []
    i = n
    for k in range(best_k, 0, -1):
        edges.append(int(cand[i - 1]))
        i = int(parents[k - 1][i])
    return tuple(sorted(edges))


# --------------------------------------------------------------------------
# Three axes from a graph budget
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """A planned BucketSet and the split search that chose it."""

    buckets: BucketSet
    batch_edges: int  # len(buckets.batch)
    padded_token_rows: int  # token padding of the sample (legal steps)
    padded_batch_rows: int  # logits padding of the sample (legal steps)
    splits_tried: int


def _fit(value: int, edges: Sequence[int]) -> int:
    if value == 0:
        return 0
    fit = smallest_fit(value, edges)
    return fit if fit is not None else fallback_size(value, edges)


@dataclass(frozen=True, slots=True)
class AxisSamples:
    """Sampled sizes per axis, each as (size, count) pairs: what the planner
    reads. From steps (``from_steps``) or from the ``step_shape`` histogram of
    ``/metrics``, which counts each axis on its own (``bucketing.scrape``).

    requests: requests per step (logits rows); decode_rows: decode rows of steps
    with decodes; prefill_tokens: prefill rows of steps with a prefill;
    decode_blocks, prefill_blocks: their blocks.
    """

    requests: tuple[tuple[int, int], ...]
    decode_rows: tuple[tuple[int, int], ...]
    prefill_tokens: tuple[tuple[int, int], ...]
    decode_blocks: tuple[tuple[int, int], ...]
    prefill_blocks: tuple[tuple[int, int], ...]

    @staticmethod
    def counted(values: Iterable[int]) -> tuple[tuple[int, int], ...]:
        """(size, count) of the positive values."""
        arr = np.asarray([int(v) for v in values], dtype=np.int64)
        sizes, counts = np.unique(arr[arr > 0], return_counts=True)
        return tuple((int(v), int(c)) for v, c in zip(sizes, counts, strict=True))

    @classmethod
    def from_steps(cls, samples: Sequence[StepSizes]) -> AxisSamples:
        """The axes of every step, as the ``step_shape`` histogram counts them
        (blocks only of the steps with that part)."""
        return cls(
            requests=cls.counted(s.num_reqs for s in samples),
            decode_rows=cls.counted(s.num_decodes for s in samples),
            prefill_tokens=cls.counted(s.prefill_tokens for s in samples),
            decode_blocks=cls.counted(
                s.decode_blocks for s in samples if s.num_decodes
            ),
            prefill_blocks=cls.counted(
                s.prefill_blocks for s in samples if s.prefill_tokens
            ),
        )

    @property
    def steps(self) -> int:
        """Steps counted (each has a ``requests`` size)."""
        return sum(c for _, c in self.requests)


def _values(pairs: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [v for v, _ in pairs], [c for _, c in pairs]


def _padding(pairs: Sequence[tuple[int, int]], edges: Sequence[int]) -> int:
    return sum(c * (_fit(v, edges) - v) for v, c in pairs)


def plan_buckets_detailed(
    samples: Sequence[StepSizes],
    limits: Limits,
    graph_budget: int,
    *,
    block_budget: int = DEFAULT_BLOCK_BUDGET,
    batch_weight: float = 1.0,
    step_graph_budget: int | None = None,
    decode_form: str = "flat",
) -> Plan:
    """``plan_buckets`` with the numbers behind its choice.

    The split search minimises ``token_pad / token_rows + batch_weight *
    logits_pad / logits_rows`` over the legal steps of the sample (padding
    relative to the real rows of each axis).
    batch_weight: weight of the logits axis; 0 minimises padded token rows
    alone, a large value the padded logits rows.
    step_graph_budget: when given, most graphs warmup may compile
    (``count_graphs`` with ``decode_form``); block edges are dropped, least
    used first, until the set fits (raises if even the fewest blocks do not).
    decode_form: the decode attention the graphs are counted for, with the
    same default as ``buckets.step_shapes`` and ``count_graphs``: ``flat``,
    Gaudi's, where attention is traced into the graphs and every step shape is
    a graph; ``batched`` is the dynamic plan's form off Gaudi
    (``vllm_hpu_mm.plan``).
    """
    if not samples:
        raise ValueError("plan_buckets needs at least one sampled step")
    legal = [
        s
        for s in samples
        if 0 < s.num_reqs <= limits.max_num_seqs and s.tokens <= limits.max_tokens
    ]
    score = AxisSamples(
        requests=AxisSamples.counted(s.num_reqs for s in legal),
        decode_rows=AxisSamples.counted(s.num_decodes for s in legal),
        prefill_tokens=AxisSamples.counted(s.prefill_tokens for s in legal),
        decode_blocks=(),
        prefill_blocks=(),
    )
    return plan_buckets_from_axes(
        AxisSamples.from_steps(samples),
        limits,
        graph_budget,
        block_budget=block_budget,
        batch_weight=batch_weight,
        step_graph_budget=step_graph_budget,
        decode_form=decode_form,
        score=score,
    )


def plan_buckets_from_axes(
    axes: AxisSamples,
    limits: Limits,
    graph_budget: int,
    *,
    block_budget: int = DEFAULT_BLOCK_BUDGET,
    batch_weight: float = 1.0,
    step_graph_budget: int | None = None,
    decode_form: str = "flat",
    score: AxisSamples | None = None,
) -> Plan:
    """``plan_buckets_detailed`` from per-axis counts (a ``/metrics``
    histogram): the same search, since every term of its score is a sum over
    one axis. score: the sizes the split is scored on (default: ``axes``'
    within the limits).
    """
    if not axes.requests:
        raise ValueError("plan_buckets needs at least one sampled step")
    seqs, max_tokens = limits.max_num_seqs, limits.max_tokens
    least = 2  # batch {max_num_seqs}, tokens {max_num_batched_tokens}
    if graph_budget < least:
        raise ValueError(
            f"graph_budget={graph_budget} is below the least that covers the limits: "
            f"{least} (batch bucket {seqs} + token bucket {max_tokens})"
        )
    if score is None:
        score = AxisSamples(
            requests=tuple((v, c) for v, c in axes.requests if v <= seqs),
            decode_rows=tuple((v, c) for v, c in axes.decode_rows if v <= seqs),
            prefill_tokens=tuple(
                (v, c) for v, c in axes.prefill_tokens if v <= max_tokens
            ),
            decode_blocks=(),
            prefill_blocks=(),
        )
    batch_values, batch_weights = _values(axes.requests + axes.decode_rows)
    prefill_values, prefill_weights = _values(axes.prefill_tokens)
    bat_rows = max(1, sum(v * c for v, c in score.requests))
    tok_rows = max(1, sum(v * c for v, c in score.decode_rows + score.prefill_tokens))

    best: tuple[float, tuple[int, ...], tuple[int, ...], int, int] | None = None
    tried = 0
    for kb in range(1, graph_budget):
        batch = plan_axis(batch_values, kb, top=seqs, weights=batch_weights)
        if kb > len(batch):
            break  # the batch axis needs no more edges
        tokens = plan_axis(
            prefill_values,
            graph_budget - len(batch),
            top=max_tokens,
            weights=prefill_weights,
        )
        tried += 1
        tok_pad = _padding(score.decode_rows, batch) + _padding(
            score.prefill_tokens, tokens
        )
        bat_pad = _padding(score.requests, batch)
        split = tok_pad / tok_rows + batch_weight * bat_pad / bat_rows
        if best is None or split < best[0]:
            best = (split, tokens, batch, tok_pad, bat_pad)
    assert best is not None  # kb = 1 always fits the budget checked above
    _, tokens, batch, tok_pad, bat_pad = best
    block_pairs = axes.decode_blocks + axes.prefill_blocks
    block_values, block_weights = _values(block_pairs)
    blocks = plan_axis(
        block_values, block_budget, top=limits.max_blocks, weights=block_weights
    )
    blocks = tuple(sorted({*blocks, *_doubling_tail(blocks, limits.max_blocks)}))
    buckets = explicit(limits, tokens, batch, blocks)
    if step_graph_budget is not None:
        buckets = _fit_step_graphs(
            buckets, limits, block_pairs, step_graph_budget, decode_form
        )
    return Plan(buckets, len(buckets.batch), tok_pad, bat_pad, tried)


def _fit_step_graphs(
    buckets: BucketSet,
    limits: Limits,
    block_pairs: Sequence[tuple[int, int]],
    budget: int,
    decode_form: str,
) -> BucketSet:
    """Drop block edges (never the top one), least used by the sample first,
    until ``count_graphs`` fits ``budget``. block_pairs: (size, count)."""
    blocks = list(buckets.blocks)
    uses = {e: 0 for e in blocks}
    for v, c in block_pairs:
        fit = smallest_fit(v, blocks)
        if fit is not None:
            uses[fit] += c
    while True:
        current = BucketSet(buckets.tokens, buckets.batch, tuple(blocks))
        graphs = count_graphs(current, limits, decode_form)
        if graphs <= budget:
            return current
        if len(blocks) == 1:
            raise ValueError(
                f"step_graph_budget={budget} is below the {graphs} graphs of "
                f"{len(buckets.tokens)} token sizes x {len(buckets.batch)} batch "
                "sizes with a single block size; lower graph_budget"
            )
        drop = min(blocks[:-1], key=lambda e: (uses[e], e))
        blocks.remove(drop)


def _doubling_tail(edges: Sequence[int], top: int) -> list[int]:
    """Edges doubling from the largest one below ``top`` up to it, so that a
    size above the sample pads by less than 2x instead of up to ``top``."""
    below = [e for e in edges if e < top]
    if not below:
        return []
    out, v = [], 2 * below[-1]
    while v < top:
        out.append(v)
        v *= 2
    return out


def plan_buckets(
    samples: list[StepSizes], limits: Limits, graph_budget: int
) -> BucketSet:
    """Buckets for ``samples`` with at most ``graph_budget`` graphs
    (``BucketSet.num_graphs``), closed at the limits so that no legal step
    takes the fallback; blocks get ``DEFAULT_BLOCK_BUDGET`` planned edges and
    the doubling tail above them."""
    return plan_buckets_detailed(samples, limits, graph_budget).buckets


# --------------------------------------------------------------------------
# Seeded workloads (DESIGN, "Where padding comes from")
# --------------------------------------------------------------------------


def prompt_lengths(
    n: int,
    seed: int,
    *,
    median: float = 600.0,
    sigma: float = 0.8,
    lo: int = 16,
    hi: int = 8192,
) -> list[int]:
    """``n`` prompt lengths, lognormal(median, sigma) rounded and clipped."""
    rng = np.random.default_rng(seed)
    return _lognormal(rng, n, median, sigma, lo, hi)


def _lognormal(
    rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> list[int]:
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return [int(x) for x in np.clip(np.rint(draws), lo, hi)]


def _pack(
    prompt_lens: Sequence[int], limits: Limits, budget: int, max_reqs: int
) -> list[StepSizes]:
    """FCFS prefill packing: each step takes the queue's head requests until
    ``budget`` tokens or ``max_reqs`` requests; the request that does not fit
    whole is chunked and continues first in the next step."""
    bs = limits.block_size
    queue = [min(int(n), limits.max_model_len) for n in prompt_lens if n > 0]
    done = [0] * len(queue)  # tokens already computed per request
    head, steps = 0, []
    while head < len(queue):
        left, reqs, tokens, blocks, i = budget, 0, 0, 0, head
        while i < len(queue) and left > 0 and reqs < max_reqs:
            chunk = min(queue[i] - done[i], left)
            done[i] += chunk
            left -= chunk
            tokens += chunk
            blocks += -(-done[i] // bs)  # context incl. prior chunks and this one
            reqs += 1
            if done[i] < queue[i]:
                break
            i += 1
        while head < len(queue) and done[head] == queue[head]:
            head += 1
        steps.append(
            StepSizes(
                num_reqs=reqs,
                num_decodes=0,
                decode_blocks=0,
                prefill_tokens=tokens,
                prefill_blocks=blocks,
            )
        )
    return steps


def _decode(
    num_steps: int, limits: Limits, seed: int, gen_max: int = 512
) -> list[StepSizes]:
    """Decode-only steps: batch uniform in 1..max_num_seqs, each request's
    context a lognormal prompt plus uniform 0..gen_max generated tokens."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(num_steps):
        b = int(rng.integers(1, limits.max_num_seqs + 1))
        ctx = np.asarray(_lognormal(rng, b, 600.0, 0.8, 16, 8192))
        ctx = np.minimum(
            ctx + rng.integers(0, gen_max + 1, size=b), limits.max_model_len
        )
        width = int(-(-ctx.max() // limits.block_size))
        steps.append(
            StepSizes(
                num_reqs=b,
                num_decodes=b,
                decode_blocks=width,
                prefill_tokens=0,
                prefill_blocks=0,
            )
        )
    return steps


def simulate_steps(
    prompt_lens: Sequence[int],
    limits: Limits,
    budget_tokens: int = 2048,
    seed: int = 0,
    workloads: Sequence[str] = WORKLOADS,
) -> list[StepSizes]:
    """The step shapes of the DESIGN's seeded workloads, concatenated in the
    order given:

    - ``single``: each prompt alone in a step (chunked only above
      ``max_num_batched_tokens``);
    - ``chunked``: FCFS packing at ``budget_tokens`` (capped at
      ``max_num_batched_tokens``) and ``max_num_seqs`` requests per step;
    - ``decode``: ``len(prompt_lens)`` decode steps drawn with ``seed``.

    Prompts longer than ``max_model_len`` are cut to it.
    """
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(
            f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}"
        )
    if budget_tokens <= 0:
        raise ValueError(f"budget_tokens must be positive, got {budget_tokens}")
    steps: list[StepSizes] = []
    for name in workloads:
        if name == "single":
            steps += _pack(prompt_lens, limits, limits.max_tokens, 1)
        elif name == "chunked":
            budget = min(budget_tokens, limits.max_tokens)
            steps += _pack(prompt_lens, limits, budget, limits.max_num_seqs)
        else:
            steps += _decode(len(prompt_lens), limits, seed)
    return steps


# --------------------------------------------------------------------------
# Evaluation with the real Bucketer
# --------------------------------------------------------------------------


def evaluate(
    buckets: BucketSet,
    samples: Iterable[StepSizes],
    max_pad_ratio: float = 2.0,
    limits: Limits | None = None,
) -> dict[str, Any]:
    """Pad every step with ``Bucketer`` and sum real and padded sizes.

    Padding % is ``100 * padding_ratio`` (share of padded rows that are
    padding) per axis: tokens (token rows), batch (logits rows), blocks (decode
    block-table width plus prefill context blocks). Fallback steps count with
    their fallback sizes (``max_pad_ratio``: ``hpu_mm.bucketing.
    fallback_max_pad_ratio``).
    """
    bucketer = Bucketer(buckets, max_pad_ratio=max_pad_ratio)
    real = {"tokens": 0, "batch": 0, "blocks": 0}
    padded = dict(real)
    steps = 0
    for s in samples:
        p = bucketer.pad(s)
        steps += 1
        real["tokens"] += s.tokens
        padded["tokens"] += p.tokens
        real["batch"] += s.num_reqs
        padded["batch"] += p.batch
        real["blocks"] += s.decode_blocks + s.prefill_blocks
        padded["blocks"] += p.decode_blocks + p.prefill_blocks
    out: dict[str, Any] = {"graphs": buckets.num_graphs, "steps": steps}
    if limits is not None:  # graphs warmup compiles (whole step shapes)
        out["step_graphs"] = count_graphs(buckets, limits, "batched")
        out["step_graphs_flat"] = count_graphs(buckets, limits, "flat")
        # the static plan's one-request prefill forms, on top of the flat count
        out["one_request_graphs"] = len(one_request_shapes(buckets, limits))
    for axis in real:
        pct = 100.0 * padding_ratio([real[axis]], [padded[axis]])
        out[f"{axis}_padding_pct"] = pct
        out[f"real_{axis}"] = real[axis]
        out[f"padded_{axis}"] = padded[axis]
    out["fallback_steps"] = bucketer.fallback_count
    return out
