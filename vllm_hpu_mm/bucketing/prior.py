"""The default bucket set (strategy ``prior``): fine where the rows are.

Padding is counted in rows (``planner.evaluate``: ``1 - sum(real) /
sum(padded)``), so the large steps of an axis weigh the most: a 3000-token
prefill padded by 20 % wastes more rows than a hundred 20-token prompts padded
to 32. ``exponential`` spaces every axis by 2x, which wastes about a quarter of
the rows of a size spread evenly in log scale at every size. This set spends
its sizes in the top of each axis (half octaves: 1, 1.5, 2, 3, 4, 6, ... times
a power of two) and steps by 4x below it, where a padded row is cheap in
absolute terms. Every step shape is a graph (``buckets.step_shapes``), and each
token or batch size costs one graph per block size its steps reach, so the
block axis steps by 4x below half a request's blocks as well.

Derived from the limits alone (each axis ends at its limit, so no legal step
takes the fallback). Never more warmup graphs than ``exponential``: where the
ladder would compile more (small limits, where x2 steps are already few), with
either decode form, the exponential set at the same smallest sizes is used.
(Graphs keyed by token count alone at static sizes, the dynamic plan on HPU,
count distinct sizes: 16 here against 14 at 128/8192; not guarded.)

- tokens: from ``min_tokens``, x4 up to ``max_num_batched_tokens / 8``, then
  half octaves up to ``max_num_batched_tokens``;
- batch: from ``min_batch``, x4 up to ``max_num_seqs / 4``, then half octaves
  up to ``max_num_seqs``;
- blocks: from 1, x4 up to ``max_blocks_per_seq / 2``, then doubling up to
  ``max_blocks`` (all requests at full length).

The workload prior. The three breakpoints (1/8, 1/4, 1/2) and the two spacings
(x4 below, half octaves above) were chosen on the design notes' seeded workloads
(``planner.simulate_steps``: lognormal prompts of median 600 tokens, sigma 0.8;
each prompt alone, FCFS chunked prefill at 2048 tokens, decode at a uniform
batch with lognormal contexts), drawn with seed 12345 (not the benchmark's
seeds 0 and 1), over four limit sets (max_num_seqs / max_num_batched_tokens /
max_model_len / block size: 128/8192/8192/128, 256/2048/2048/16,
64/4096/4096/128, 32/2048/4096/128). Among ladders of that form (token
breakpoint 1/4 to 1/16, batch 1/2 to 1/8, blocks 1 to 1/8; x2 or x4 below,
half or quarter octaves above) with no more
warmup graphs than ``exponential`` at each of the four limit sets (flat decode),
this one has the least ``token padding + (batch padding + block padding) / 4``
summed over them: a padded token row runs the whole model, a padded logits row
only the head, a padded block only attention's K/V reads.
``benchmarks/bucket_padding.py`` measures it on a
held-out bimodal load (short chat prompts and long documents) that played no
part in the choice; figures in docs/performance.md.
"""

from __future__ import annotations

from vllm_hpu_mm.bucketing.buckets import (
    BucketSet,
    Limits,
    clip,
    count_graphs,
    exponential,
)

TOKENS_FINE_FROM = 8
"""Token sizes are half octaves from ``max_num_batched_tokens / 8`` up."""
BATCH_FINE_FROM = 4
"""Batch sizes are half octaves from ``max_num_seqs / 4`` up."""
BLOCKS_FINE_FROM = 2
"""Block sizes double from ``max_blocks_per_seq / 2`` up."""
COARSE = 4
"""Ratio between consecutive sizes below those points."""


def ladder(lo: int, hi: int, fine_from: int, coarse: int = COARSE) -> tuple[int, ...]:
    """lo, lo * coarse, ... while below ``fine_from``; from there half octaves
    (``2**e`` and ``1.5 * 2**e``; consecutive sizes, once above 2, differ by
    at most 1.5x); ends at hi. Strictly increasing, every value in [lo, hi].

    >>> ladder(32, 8192, 1024)
    (32, 128, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    """
    if lo <= 0 or hi < lo:
        raise ValueError(f"ladder range needs 0 < lo <= hi, got lo={lo}, hi={hi}")
    if coarse < 2:
        raise ValueError(f"ladder coarse ratio must be >= 2, got {coarse}")
    out = {hi}
    v = lo
    while v < hi:
        out.add(v)
        if v < fine_from:
            v = min(v * coarse, fine_from) if v * coarse > fine_from else v * coarse
        else:
            octave = 1 << (v.bit_length() - 1)  # largest power of two <= v
            step = max(1, octave // 2)
            v = (v // step + 1) * step  # next multiple of half the octave
    return tuple(sorted(out))


def prior_buckets(
    limits: Limits, min_tokens: int = 32, min_batch: int = 1
) -> BucketSet:
    """The default set for ``limits`` (see the module docstring)."""
    max_tokens, seqs = limits.max_tokens, limits.max_num_seqs
    lo_tokens, lo_batch = min(min_tokens, max_tokens), min(min_batch, seqs)
    tokens = ladder(lo_tokens, max_tokens, max(1, max_tokens // TOKENS_FINE_FROM))
    batch = ladder(lo_batch, seqs, max(1, seqs // BATCH_FINE_FROM))
    blocks_from = max(1, limits.max_blocks_per_seq // BLOCKS_FINE_FROM)
    blocks = _doubling_from(blocks_from, limits.max_blocks)
    ladders = BucketSet(tokens=clip(tokens, max_tokens), batch=batch, blocks=blocks)
    doubling = BucketSet(
        tokens=clip(exponential(lo_tokens, max_tokens), max_tokens),
        batch=exponential(lo_batch, seqs),
        blocks=exponential(1, limits.max_blocks),
    )
    fewer = all(
        count_graphs(ladders, limits, form) <= count_graphs(doubling, limits, form)
        for form in ("flat", "batched")
    )
    return ladders if fewer else doubling


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
