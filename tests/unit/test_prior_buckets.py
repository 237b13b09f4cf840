"""The default bucket set (strategy ``prior``, ``bucketing/prior.py``)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hpu_mm.bucketing.buckets import (
    Limits,
    count_graphs,
    default_buckets,
    from_config,
    prefill_blocks_reach,
    step_shapes,
)
from vllm_hpu_mm.bucketing.planner import evaluate, simulate_steps
from vllm_hpu_mm.bucketing.policy import Bucketer, StepSizes
from vllm_hpu_mm.bucketing.prior import ladder, prefill_block_axis, prior_buckets
from vllm_hpu_mm.config import BucketingConfig

BENCH = Limits(128, 8192, 8192, 128)  # benchmarks/bucket_padding.py's limits
QWEN_SERVE = Limits(256, 2048, 2048, 16)  # `vllm serve` of tiny Qwen2.5-VL on the CPU

limits_st = st.builds(
    Limits,
    max_num_seqs=st.integers(1, 512),
    max_num_batched_tokens=st.integers(16, 16384),
    max_model_len=st.integers(16, 32768),
    block_size=st.sampled_from([16, 128]),
)


def test_prior_is_the_default() -> None:
    limits = BENCH
    assert BucketingConfig().strategy == "prior"
    assert from_config(limits, BucketingConfig()) == prior_buckets(limits)
    assert from_config(limits, BucketingConfig(strategy="exponential")) == (
        default_buckets(limits, "exponential", min_tokens=32)
    )


def test_ladder_spacing() -> None:
    xs = ladder(32, 8192, 1024)
    assert xs == (32, 128, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    assert ladder(1, 256, 64) == (1, 4, 16, 64, 96, 128, 192, 256)
    assert ladder(5, 5, 1) == (5,)
    for lo, hi, fine in [(3, 1000, 100), (1, 7, 2), (16, 4096, 512)]:
        ys = ladder(lo, hi, fine)
        assert ys[0] == lo and ys[-1] == hi and list(ys) == sorted(set(ys))
        # from the fine point up, each size is at most 1.5x the one below
        # (above 2, where half an octave is a whole row)
        above = [y for y in ys if y >= max(fine, 2)]
        assert all(b <= 1.5 * a for a, b in itertools.pairwise(above))


def test_bucket_counts_against_exponential() -> None:
    """The warmup graphs (every step shape, flat decode as on Gaudi) of the two
    reference limit sets: fewer than the exponential set's, counted here."""
    for limits in (BENCH, QWEN_SERVE):
        prior = prior_buckets(limits)
        exp = default_buckets(limits, "exponential", min_tokens=32)
        assert prior != exp  # the ladders, not the fallback to exponential
        for form in ("flat", "batched"):
            assert count_graphs(prior, limits, form) < count_graphs(exp, limits, form)
    assert (
        count_graphs(default_buckets(QWEN_SERVE, "exponential", 32), QWEN_SERVE) == 127
    )
    assert count_graphs(prior_buckets(QWEN_SERVE), QWEN_SERVE) == 120
    assert count_graphs(default_buckets(BENCH, "exponential", 32), BENCH) == 136
    assert count_graphs(prior_buckets(BENCH), BENCH) == 118


def test_prefill_has_its_own_short_block_axis() -> None:
    """Prefill pads its blocks to a quarter, five eighths and all of a tile's
    reach (the doubling above is never warmed), decode to the decode ladder;
    every prefill token size costs three graphs, not one per decode block size."""
    prior = prior_buckets(BENCH)
    reach = prefill_blocks_reach(BENCH)
    assert reach == 64 + 1 + 1  # a full request, the tile's own block, one more
    assert prior.prefill_blocks[:3] == (16, 41, reach)
    assert prior.prefill_blocks[-1] == BENCH.max_blocks
    assert prior.blocks == (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert prefill_block_axis(QWEN_SERVE)[:3] == (34, 85, 128 + 8 + 1)
    for limits in (BENCH, QWEN_SERVE):
        b = prior_buckets(limits)
        _, prefill = step_shapes(b, limits, "flat")
        per_size: dict[int, set[int]] = {}
        for t, n in prefill:
            per_size.setdefault(t, set()).add(n)
        assert set(per_size) == set(b.tokens)
        assert all(sizes == set(b.prefill_blocks[:3]) for sizes in per_size.values())
    # The padder uses the prefill axis for the prefill part only.
    p = Bucketer(prior).pad(StepSizes(3, 2, 20, 300, 20))
    assert (p.decode_blocks, p.prefill_blocks) == (32, 41)
    p = Bucketer(prior).pad(StepSizes(1, 0, 0, 40, 1))
    assert p.prefill_blocks == 16


def test_token_axis_takes_quarter_octaves_where_they_fit() -> None:
    """Above max_num_batched_tokens / 16 the token sizes are quarter octaves at
    both reference limit sets (each at most 1.25x the one below), half octaves
    where quarters would warm more graphs than exponential."""
    for limits in (BENCH, QWEN_SERVE):
        tokens = prior_buckets(limits).tokens
        top = [t for t in tokens if t >= limits.max_tokens // 16]
        assert all(b <= 1.25 * a for a, b in itertools.pairwise(top))
        assert len(top) == 4 * 4 + 1  # four octaves, four sizes each, and the top
    # 32/2048/4096/128: quarter octaves would compile more than exponential.
    small = Limits(32, 2048, 4096, 128)
    quarter = ladder(32, 2048, 2048 // 16, per_octave=4)
    assert prior_buckets(small).tokens == ladder(32, 2048, 2048 // 16, per_octave=2)
    assert prior_buckets(small).tokens != quarter


def _bucket_padding_benchmark() -> Any:
    path = Path(__file__).parents[2] / "benchmarks" / "bucket_padding.py"
    spec = importlib.util.spec_from_file_location("bucket_padding", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bimodal_default_padding_under_ten_percent() -> None:
    """Issue 29 item 5's target on the benchmark's held-out bimodal load at its
    limits: the default pads under 10 % of token rows (exponential: 18.4 %),
    no step takes the fallback, with fewer warmup graphs than exponential."""
    bench = _bucket_padding_benchmark()
    rows = bench.run(
        bench.build_parser().parse_args(["--workloads", "bimodal", "--budgets", "16"])
    )
    by = {r["buckets"]: r for r in rows}
    prior, exp = by["prior"], by["exponential"]
    assert prior["tokens_padding_pct"] < 10.0 < exp["tokens_padding_pct"]
    assert prior["fallback_steps"] == 0
    assert prior["step_graphs_flat"] < exp["step_graphs_flat"]


@settings(max_examples=150, deadline=None)
@given(limits=limits_st, min_tokens=st.integers(1, 64), min_batch=st.integers(1, 8))
def test_never_more_graphs_than_exponential(
    limits: Limits, min_tokens: int, min_batch: int
) -> None:
    prior = prior_buckets(limits, min_tokens, min_batch)
    exp = default_buckets(limits, "exponential", min_tokens, min_batch=min_batch)
    for form in ("flat", "batched"):
        assert count_graphs(prior, limits, form) <= count_graphs(exp, limits, form)


@settings(max_examples=150, deadline=None)
@given(limits=limits_st, data=st.data())
def test_every_legal_step_fits_and_was_warmed(
    limits: Limits, data: st.DataObject
) -> None:
    """No legal step takes the fallback, and its padded decode and prefill keys
    are among the step shapes warmup compiles (flat decode: blocks are the
    requests' summed blocks; prefill: the widest tile reads one request's
    context plus its own rows)."""
    buckets = prior_buckets(limits)
    assert buckets.tokens[-1] == limits.max_tokens
    assert buckets.batch[-1] == limits.max_num_seqs
    assert buckets.blocks[-1] == limits.max_blocks
    decode_keys, prefill_keys = map(set, step_shapes(buckets, limits, "flat"))
    bucketer = Bucketer(buckets)
    per_seq = limits.max_blocks_per_seq
    reqs = data.draw(st.integers(1, limits.max_num_seqs))
    decodes = data.draw(st.integers(0, min(reqs, limits.max_tokens)))
    dec_blocks = data.draw(st.integers(decodes, decodes * per_seq)) if decodes else 0
    room = min(limits.max_tokens - decodes, limits.max_model_len)
    prefill = data.draw(st.integers(0, room)) if reqs > decodes and room else 0
    tile_rows = min(prefill, 128)
    lo = -(-tile_rows // limits.block_size)
    hi = min(per_seq + lo, limits.max_blocks)
    pre_blocks = data.draw(st.integers(lo, hi)) if prefill >= 2 else 0
    step = StepSizes(
        reqs, decodes, dec_blocks, prefill if pre_blocks else 0, pre_blocks
    )
    padded = bucketer.pad(step)
    assert padded.fallbacks == ()
    if decodes:
        assert (padded.num_decodes, padded.decode_blocks) in decode_keys
    if step.prefill_tokens:
        assert (padded.prefill_tokens, padded.prefill_blocks) in prefill_keys


def _held_out_steps(limits: Limits, seed: int) -> list[StepSizes]:
    """A load the default was not chosen on: prompts log-uniform over
    16..max_num_batched_tokens (the prior's are lognormal around 600), alone,
    chunked at half the budget, and decode steps at batches skewed to the top."""
    rng = np.random.default_rng(seed)
    top = limits.max_tokens
    lens = [int(x) for x in np.exp(rng.uniform(np.log(16), np.log(top), 800))]
    steps = simulate_steps(lens, limits, max(1, top // 2), seed, ["single", "chunked"])
    for b in np.sqrt(rng.uniform(0, 1, 800)) * limits.max_num_seqs:
        n = max(1, int(np.ceil(b)))
        steps.append(StepSizes(n, n, n * 4, 0, 0))
    return steps


def test_held_out_padding_below_exponential_and_the_ladder_bound() -> None:
    """Token padding on the held-out load: below the exponential set's, and a
    step above the fine points pads its token rows by at most 1.5x, so the
    share of padding in those steps' rows is at most 1 - 1 / 1.5."""
    for limits in (BENCH, QWEN_SERVE):
        steps = _held_out_steps(limits, seed=2026)
        prior = prior_buckets(limits)
        exp = default_buckets(limits, "exponential", min_tokens=32)
        ours, theirs = evaluate(prior, steps), evaluate(exp, steps)
        assert ours["fallback_steps"] == theirs["fallback_steps"] == 0
        assert ours["tokens_padding_pct"] < theirs["tokens_padding_pct"], (
            ours,
            theirs,
        )
        fine = [
            s
            for s in steps
            if s.prefill_tokens >= limits.max_tokens // 8 and not s.num_decodes
        ]
        big = evaluate(prior, fine)
        assert big["tokens_padding_pct"] <= 100 * (1 - 1 / 1.5)
        bucketer = Bucketer(prior)
        assert all(
            bucketer.pad(s).prefill_tokens <= 1.5 * s.prefill_tokens for s in fine
        )


def _observed(axis: str) -> tuple[float, float]:
    """(count, sum) of the ``step_shape`` histogram's ``axis`` in this process."""
    from vllm_hpu_mm import metrics

    count = total = 0.0
    for family in metrics.STEP_SHAPE.collect():
        for sample in family.samples:
            if sample.labels.get("axis") != axis:
                continue
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total


def test_shape_policy_observes_served_steps_only() -> None:
    """Steps before ``start_serving`` (warmup, the memory profile) are not in
    the histogram; served ones are, by axis, with their exact sizes."""
    from vllm_hpu_mm.attention.metadata import StepShape
    from vllm_hpu_mm.worker.shapes import ShapePolicy

    policy = ShapePolicy(prior_buckets(BENCH))
    axes = ("tokens", "requests", "decode_rows", "decode_blocks", "prefill_tokens")
    start = {a: _observed(a) for a in axes}
    mixed = StepShape(
        num_decodes=3, decode_blocks=7, num_prefill_tokens=50, prefill_blocks=1
    )
    policy(mixed, 4)  # warmup
    assert {a: _observed(a) for a in axes} == start
    policy.start_serving()
    padded, batch = policy(mixed, 4)
    assert padded.num_tokens > mixed.num_tokens and batch == 4
    policy(StepShape(2, 5, 0, 0), 2)  # decode only: no prefill axes

    def added(axis: str) -> tuple[float, float]:
        (c0, s0), (c1, s1) = start[axis], _observed(axis)
        return c1 - c0, s1 - s0

    assert added("tokens") == (2, 53 + 2)
    assert added("requests") == (2, 6)
    assert added("decode_rows") == (2, 5)
    assert added("decode_blocks") == (2, 12)
    assert added("prefill_tokens") == (1, 50)
