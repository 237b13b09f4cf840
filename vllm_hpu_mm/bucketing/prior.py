"""The default bucket set (strategy ``prior``): fine where the rows are.

Padding is counted in rows (``planner.evaluate``: ``1 - sum(real) /
sum(padded)``), so the large steps of an axis weigh the most: a 3000-token
prefill padded by 20 % wastes more rows than a hundred 20-token prompts padded
to 32. ``exponential`` spaces every axis by 2x, which wastes about a quarter of
the rows of a size spread evenly in log scale at every size. This set spends
its sizes in the top of each axis and steps by 4x below it, where a padded row
is cheap in absolute terms.

Every step shape is a graph (``buckets.step_shapes``): a batch size costs one
graph per decode block size its steps reach, a token size one per prefill block
size. Prefill and decode read very different block counts (a prefill tile reads
at most one request's context plus its own rows, ``buckets.
prefill_blocks_reach``; a flat decode reads all its requests' blocks), so they
get separate block axes, and the prefill one is short (three sizes up to that
reach, none below a quarter of it), which leaves room for quarter octaves on the
token axis within the graphs of ``exponential``.

Derived from the limits alone (each axis ends at its limit, so no legal step
takes the fallback). Never more warmup graphs than ``exponential``, with either
decode form: where quarter octaves would compile more, the token axis takes half
octaves, and where that is still more (small limits, where x2 steps are already
few), the exponential set at the same smallest sizes is used. (Graphs keyed by
token count alone at static sizes, the dynamic plan on HPU, count distinct
sizes; not guarded.)

- tokens: from ``min_tokens``, x4 up to ``max_num_batched_tokens / 16``, then
  quarter octaves (1, 1.25, 1.5, 1.75 times a power of two) up to
  ``max_num_batched_tokens`` (half octaves, 1 and 1.5, where those warm too
  many graphs);
- batch: from ``min_batch``, x4 up to ``max_num_seqs / 4``, then half octaves
  up to ``max_num_seqs``;
- blocks (decode): from 1, x4 up to ``max_blocks_per_seq / 2``, then doubling
  up to ``max_blocks`` (all requests at full length);
- prefill blocks: R/4, 5R/8 and the reach R of a tile
  (``prefill_blocks_reach``), then doubling from R up to ``max_blocks``.

The workload prior. The breakpoints, spacings and the prefill block axis were
chosen on the design notes' seeded workloads (``planner.simulate_steps``:
lognormal prompts of median 600 tokens, sigma 0.8; each prompt alone, FCFS
chunked prefill at 2048 tokens, decode at a uniform batch with lognormal
contexts), drawn with seed 12345 (not the benchmark's seeds 0 and 1), over four
limit sets (max_num_seqs / max_num_batched_tokens / max_model_len / block size:
128/8192/8192/128, 256/2048/2048/16, 64/4096/4096/128, 32/2048/4096/128). Among
ladders of that form (token breakpoint 1/4 to 1/16; quarter, eighth or half
octaves above it with the coarser ones as fallbacks; batch half or quarter
octaves; 2 to 5 log-spaced prefill block sizes from 1 to R, or R and one or
two sizes from R/32 to 3R/4, in eighths and sixteenths) with no more warmup
graphs than ``exponential`` at each limit set (both decode forms), this one has
the least ``token padding + (batch padding + block padding) / 4`` summed over
them: a padded token row runs the whole model, a padded logits row only the
head, a padded block only attention's K/V reads. ``benchmarks/bucket_padding.py``
measures it on a held-out bimodal load (short chat prompts and long documents)
that played no part in the choice; figures in docs/performance.md.
"""

from __future__ import annotations

from vllm_hpu_mm.bucketing.buckets import (
    BucketSet,
    Limits,
    clip,
    count_graphs,
    exponential,
    prefill_blocks_reach,
)

TOKENS_FINE_FROM = 16
"""Token sizes are quarter (or half) octaves from ``max_num_batched_tokens / 16``
up."""
TOKENS_PER_OCTAVE = (4, 2)
"""Token sizes per octave above that point: the first that warms no more graphs
than ``exponential``."""
BATCH_FINE_FROM = 4
"""Batch sizes are half octaves from ``max_num_seqs / 4`` up."""
BLOCKS_FINE_FROM = 2
"""Decode block sizes double from ``max_blocks_per_seq / 2`` up."""
PREFILL_BLOCK_EIGHTHS = (2, 5)
"""Prefill block sizes below a tile's reach R, in eighths of R: R/4, 5R/8 (and
R itself)."""
COARSE = 4
"""Ratio between consecutive sizes below those points."""


def ladder(
    lo: int, hi: int, fine_from: int, coarse: int = COARSE, per_octave: int = 2
) -> tuple[int, ...]:
    """lo, lo * coarse, ... while below ``fine_from``; from there ``per_octave``
    sizes an octave (multiples of ``2**e / per_octave`` in ``[2**e, 2**(e+1))``:
    half octaves, ``2**e`` and ``1.5 * 2**e``, by default; consecutive sizes,
    once above ``per_octave``, differ by at most ``1 + 1 / per_octave``); ends
    at hi. Strictly increasing, every value in [lo, hi].

    >>> ladder(32, 8192, 1024)
    (32, 128, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    >>> ladder(32, 2048, 512, per_octave=4)
    (32, 128, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
    """
    if lo <= 0 or hi < lo:
        raise ValueError(f"ladder range needs 0 < lo <= hi, got lo={lo}, hi={hi}")
    if coarse < 2:
        raise ValueError(f"ladder coarse ratio must be >= 2, got {coarse}")
    if per_octave < 1:
        raise ValueError(f"ladder per_octave must be >= 1, got {per_octave}")
    out = {hi}
    v = lo
    while v < hi:
        out.add(v)
        if v < fine_from:
            v = min(v * coarse, fine_from) if v * coarse > fine_from else v * coarse
        else:
            octave = 1 << (v.bit_length() - 1)  # largest power of two <= v
            step = max(1, octave // per_octave)
            v = (v // step + 1) * step  # next multiple of the octave's step
    return tuple(sorted(out))


def prefill_block_axis(
    limits: Limits, eighths: tuple[int, ...] = PREFILL_BLOCK_EIGHTHS
) -> tuple[int, ...]:
    """Block sizes of the prefill part: ``eighths`` of the reach R of a prefill
    tile (``buckets.prefill_blocks_reach``), R itself, then doubling from R up
    to ``max_blocks`` (sizes above R are not warmed: ``step_shapes`` stops at
    R). No size below R/4: a tile that reads fewer blocks pads to R/4, cheap
    next to the rows it serves, and each size here costs a graph per token size.

    >>> prefill_block_axis(Limits(128, 8192, 8192, 128))
    (16, 41, 66, 132, 264, 528, 1056, 2112, 4224, 8192)
    """
    reach, top = prefill_blocks_reach(limits), limits.max_blocks
    out = {reach, top} | {max(1, reach * e // 8) for e in eighths}
    v = 2 * reach
    while v < top:
        out.add(v)
        v *= 2
    return tuple(sorted(out))


def prior_buckets(
    limits: Limits, min_tokens: int = 32, min_batch: int = 1
) -> BucketSet:
    """The default set for ``limits`` (see the module docstring)."""
    max_tokens, seqs = limits.max_tokens, limits.max_num_seqs
    lo_tokens, lo_batch = min(min_tokens, max_tokens), min(min_batch, seqs)
    batch = ladder(lo_batch, seqs, max(1, seqs // BATCH_FINE_FROM))
    blocks_from = max(1, limits.max_blocks_per_seq // BLOCKS_FINE_FROM)
    blocks = _doubling_from(blocks_from, limits.max_blocks)
    prefill_blocks = prefill_block_axis(limits)
    doubling = BucketSet(
        tokens=clip(exponential(lo_tokens, max_tokens), max_tokens),
        batch=exponential(lo_batch, seqs),
        blocks=exponential(1, limits.max_blocks),
    )
    budget = {form: count_graphs(doubling, limits, form) for form in FORMS}
    for per_octave in TOKENS_PER_OCTAVE:
        fine_from = max(1, max_tokens // TOKENS_FINE_FROM)
        tokens = ladder(lo_tokens, max_tokens, fine_from, per_octave=per_octave)
        ladders = BucketSet(
            tokens=clip(tokens, max_tokens),
            batch=batch,
            blocks=blocks,
            prefill_blocks=prefill_blocks,
        )
        if all(count_graphs(ladders, limits, f) <= budget[f] for f in FORMS):
            return ladders
    return doubling


FORMS = ("flat", "batched")
"""Decode forms whose warmup graphs are held to ``exponential``'s."""


def _doubling_from(fine_from: int, hi: int) -> tuple[int, ...]:
    """1, 4, 16, ... below ``fine_from``, then doubling from it; ends at hi."""
    out = {hi}
    v = 1
    while v < hi:
        out.add(v)
        if v < fine_from:
            v = min(v * COARSE, fine_from) if v * COARSE > fine_from else v * COARSE
        else:
            v *= 2
    return tuple(sorted(out))
