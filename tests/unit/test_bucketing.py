"""Property tests of vllm_hpu_mm.bucketing.buckets and .policy (pure ints).

A *legal* step is one within the Limits (requests <= max_num_seqs, token rows
<= max_num_batched_tokens, blocks within max_model_len). Default sets are
closed at the limits, so a legal step never takes the fallback; explicit sets
are not, and a larger step takes a bounded fallback, warned once per size.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_hpu_mm.bucketing.buckets import (
    BucketSet,
    Limits,
    clip,
    count_graphs,
    default_buckets,
    explicit,
    exponential,
    fallback_size,
    linear,
    one_request_shapes,
    padding_ratio,
    smallest_fit,
    step_shapes,
    token_shapes,
)
from vllm_hpu_mm.bucketing.policy import Bucketer, PaddedSizes, StepSizes

FAST = settings(max_examples=150, deadline=None)
LOGGER = "vllm.hpu_mm.bucketing"

# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------


@st.composite
def limits_st(draw: st.DrawFn) -> Limits:
    return Limits(
        max_num_seqs=draw(st.integers(1, 256)),
        max_num_batched_tokens=draw(st.integers(1, 16384)),
        max_model_len=draw(st.integers(1, 8192)),
        block_size=draw(st.sampled_from([16, 64, 128])),
    )


@st.composite
def legal_step_st(draw: st.DrawFn, limits: Limits) -> StepSizes:
    """A step within the limits: decode rows first, then >= 1 token per
    prefill request; >= 1 context block per prefill request."""
    max_tokens = limits.max_tokens
    decodes = draw(st.integers(0, min(limits.max_num_seqs, max_tokens)))
    prefills = draw(
        st.integers(0, min(limits.max_num_seqs - decodes, max_tokens - decodes))
    )
    prefill_tokens = (
        draw(st.integers(prefills, max_tokens - decodes)) if prefills else 0
    )
    prefill_blocks = (
        draw(st.integers(prefills, limits.max_blocks)) if prefill_tokens else 0
    )
    decode_blocks = draw(st.integers(1, limits.max_blocks_per_seq)) if decodes else 0
    return StepSizes(
        num_reqs=decodes + prefills,
        num_decodes=decodes,
        decode_blocks=decode_blocks,
        prefill_tokens=prefill_tokens,
        prefill_blocks=prefill_blocks,
    )


@st.composite
def default_set_st(draw: st.DrawFn, limits: Limits) -> BucketSet:
    return default_buckets(
        limits,
        draw(st.sampled_from(["exponential", "linear"])),
        min_tokens=draw(st.integers(1, 256)),
        token_step=draw(st.integers(16, 1024)),
        batch_step=draw(st.integers(1, 64)),
        block_step=draw(st.integers(16, 1024)),
        min_batch=draw(st.integers(1, 16)),
    )


def axis_st(hi: int = 300) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(1, hi), min_size=1, max_size=8, unique=True).map(
        lambda xs: tuple(sorted(xs))
    )


@st.composite
def any_step_st(draw: st.DrawFn, hi: int = 600) -> StepSizes:
    """A step of any sizes (often above a small explicit set's buckets)."""
    decodes = draw(st.integers(0, hi))
    prefills = draw(st.integers(0, hi))
    prefill_tokens = draw(st.integers(prefills, 2 * hi)) if prefills else 0
    return StepSizes(
        num_reqs=decodes + prefills,
        num_decodes=decodes,
        decode_blocks=draw(st.integers(1, hi)) if decodes else 0,
        prefill_tokens=prefill_tokens,
        prefill_blocks=draw(st.integers(1, hi)) if prefill_tokens else 0,
    )


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def assert_smallest(value: int, padded: int, axis: Sequence[int]) -> None:
    """``padded`` is the smallest bucket of ``axis`` >= ``value`` (0 for 0)."""
    if value == 0:
        assert padded == 0
        return
    assert padded in axis, (value, padded, axis)
    assert padded >= value
    smaller = [b for b in axis if value <= b < padded]
    assert not smaller, f"{value} padded to {padded} though {smaller} fit"


def assert_covers(s: StepSizes, p: PaddedSizes) -> None:
    assert p.batch >= s.num_reqs
    assert p.num_decodes >= s.num_decodes
    assert p.decode_blocks >= s.decode_blocks
    assert p.prefill_tokens >= s.prefill_tokens
    assert p.prefill_blocks >= s.prefill_blocks
    assert p.tokens >= s.tokens


@pytest.fixture
def bucket_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog attached to the bucketing logger itself, not propagating (vLLM's
    logging config may stop "vllm.*" records before the root logger; without
    it, they would reach caplog twice)."""
    logger = logging.getLogger(LOGGER)
    logger.addHandler(caplog.handler)
    propagate, logger.propagate = logger.propagate, False
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        yield caplog
    finally:
        logger.propagate = propagate
        logger.removeHandler(caplog.handler)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# --------------------------------------------------------------------------
# Default sets: closed at the limits; the chosen bucket fits and is smallest
# --------------------------------------------------------------------------


@FAST
@given(data=st.data(), limits=limits_st())
def test_default_sets_are_within_and_closed_at_the_limits(
    data: st.DataObject, limits: Limits
) -> None:
    b = data.draw(default_set_st(limits))
    assert b.tokens[-1] == limits.max_tokens
    assert b.batch[-1] == limits.max_num_seqs
    assert b.blocks[-1] == limits.max_blocks
    assert b.prefill_blocks[-1] == limits.max_blocks
    assert all(0 < v <= limits.max_tokens for v in b.tokens)
    assert all(0 < v <= limits.max_num_seqs for v in b.batch)
    assert all(0 < v <= limits.max_blocks for v in b.blocks)
    assert all(0 < v <= limits.max_blocks for v in b.prefill_blocks)
    assert b.num_graphs == len(b.tokens) + len(b.batch)
    for form in ("flat", "batched"):
        decode, prefill = step_shapes(b, limits, form)
        assert count_graphs(b, limits, form) == len(decode) + len(prefill) + len(
            b.batch
        )
        assert all(r in b.batch and n in b.blocks for r, n in decode)
        assert all(t in b.tokens and n in b.prefill_blocks for t, n in prefill)
        # Opaque attention: one shape per distinct token count of the step keys.
        dec1, pre1 = token_shapes(decode, prefill)
        rows = [r for r, _ in dec1] + [t for t, _ in pre1]
        assert len(rows) == len(set(rows))
        assert set(rows) == {r for r, _ in decode} | {t for t, _ in prefill}
        assert set(dec1) <= set(decode) and set(pre1) <= set(prefill)
        assert count_graphs(b, limits, form, opaque_attention=True) == len(rows) + len(
            b.batch
        )


@FAST
@given(data=st.data(), limits=limits_st())
def test_legal_step_takes_the_smallest_fitting_bucket_and_no_fallback(
    data: st.DataObject, limits: Limits
) -> None:
    b = data.draw(default_set_st(limits))
    s = data.draw(legal_step_st(limits))
    bucketer = Bucketer(b)
    p = bucketer.pad(s)
    assert p.fallbacks == ()
    assert bucketer.fallback_count == 0
    assert_covers(s, p)
    assert_smallest(s.num_reqs, p.batch, b.batch)
    assert_smallest(s.decode_blocks, p.decode_blocks, b.blocks)
    assert_smallest(s.prefill_blocks, p.prefill_blocks, b.prefill_blocks)
    # The decode part pads to a batch bucket, the prefill part to a token
    # bucket, each on its own (a mixed step runs as two passes).
    assert_smallest(s.num_decodes, p.num_decodes, b.batch)
    assert_smallest(s.prefill_tokens, p.prefill_tokens, b.tokens)


@FAST
@given(data=st.data(), limits=limits_st())
def test_legal_steps_never_fall_back_over_a_run(
    data: st.DataObject, limits: Limits
) -> None:
    b = data.draw(default_set_st(limits))
    steps = data.draw(st.lists(legal_step_st(limits), min_size=1, max_size=20))
    bucketer = Bucketer(b)
    for s in steps:
        assert bucketer.pad(s).fallbacks == ()
    assert bucketer.fallback_count == 0


# --------------------------------------------------------------------------
# Explicit sets: clipped to the limits, not closed; fallback past them
# --------------------------------------------------------------------------


@FAST
@given(
    limits=limits_st(),
    tokens=st.lists(st.integers(-5, 20000), max_size=12),
    batch=st.lists(st.integers(-5, 400), max_size=12),
    blocks=st.lists(st.integers(-5, 200000), max_size=12),
)
def test_explicit_clips_to_the_limits(
    limits: Limits, tokens: list[int], batch: list[int], blocks: list[int]
) -> None:
    want_tokens = {v for v in tokens if 0 < v <= limits.max_tokens}
    want_batch = {v for v in batch if 0 < v <= limits.max_num_seqs}
    want_blocks = {v for v in blocks if 0 < v <= limits.max_blocks}
    if not (want_tokens and want_batch and want_blocks):
        with pytest.raises(ValueError, match="is empty"):
            explicit(limits, tokens, batch, blocks)
        return
    b = explicit(limits, tokens, batch, blocks)
    assert b.tokens == tuple(sorted(want_tokens))
    assert b.batch == tuple(sorted(want_batch))
    assert b.blocks == tuple(sorted(want_blocks))


@FAST
@given(buckets=axis_st(), value=st.integers(1, 100000))
def test_fallback_size_is_bounded_aligned_and_shared(
    buckets: tuple[int, ...], value: int
) -> None:
    top = buckets[-1]
    value = top + value  # above every bucket
    size = fallback_size(value, buckets)
    align = 1 << (top.bit_length() - 1)
    assert value <= size < 2 * value
    assert size - value < align
    assert size % align == 0
    # Every value of the same alignment window shares the size.
    assert fallback_size(size - align + 1, buckets) == size


@FAST
@given(
    buckets=axis_st(),
    value=st.integers(1, 100000),
    ratio=st.floats(1.0, 4.0, allow_nan=False),
)
def test_fallback_size_honours_max_pad_ratio(
    buckets: tuple[int, ...], value: int, ratio: float
) -> None:
    value = buckets[-1] + value
    size = fallback_size(value, buckets, ratio)
    assert value <= size <= max(value, value * ratio)
    assert size <= fallback_size(value, buckets)  # the cap only lowers it
    assert fallback_size(value, buckets, 1.0) == value


@FAST
@given(
    tokens=axis_st(),
    batch=axis_st(),
    blocks=axis_st(),
    prefill_blocks=st.one_of(st.just(()), axis_st()),
    s=any_step_st(),
)
def test_bucketer_pads_every_step_to_a_fit_and_bounds_each_fallback(
    tokens: tuple[int, ...],
    batch: tuple[int, ...],
    blocks: tuple[int, ...],
    prefill_blocks: tuple[int, ...],
    s: StepSizes,
) -> None:
    """Each axis pads its own sizes: the prefill blocks to ``prefill_blocks``
    when the set has them (the default set does), else to ``blocks``."""
    b = BucketSet(tokens, batch, blocks, prefill_blocks)
    pre = prefill_blocks or blocks
    assert b.prefill_blocks == pre
    bucketer = Bucketer(b)
    logger = logging.getLogger(LOGGER)
    logger.disabled = True  # warnings have their own tests
    try:
        p = bucketer.pad(s)
    finally:
        logger.disabled = False
    assert_covers(s, p)
    assert bucketer.fallback_count == (1 if p.fallbacks else 0)

    def check(value: int, padded: int, axis: tuple[int, ...], name: str) -> None:
        if value == 0:
            assert padded == 0
        elif value <= axis[-1]:
            assert_smallest(value, padded, axis)
        else:
            assert name in p.fallbacks
            assert padded == fallback_size(value, axis)
            assert value <= padded < 2 * value

    check(s.num_reqs, p.batch, batch, "batch")
    check(s.decode_blocks, p.decode_blocks, blocks, "blocks")
    check(s.prefill_blocks, p.prefill_blocks, pre, "prefill_blocks")
    check(s.num_decodes, p.num_decodes, batch, "batch")
    check(s.prefill_tokens, p.prefill_tokens, tokens, "tokens")


@FAST
@example(
    # tokens [8], batch [64]: 8 decode rows + 1 prefill token = 9 real rows,
    # above the largest token bucket. The decode rows are padded to 64 first,
    # so the token fallback pads 65 to 72 rows: 8 x the real 9.
    tokens=(8,),
    batch=(64,),
    s=StepSizes(
        num_reqs=9, num_decodes=8, decode_blocks=1, prefill_tokens=1, prefill_blocks=1
    ),
)
@example(
    # tokens [8], batch [8]: 9 decode rows + 1 prefill token = 10 real rows;
    # the decode rows fall back to 16, the total 17 to 24 = 2.4 x 10.
    tokens=(8,),
    batch=(8,),
    s=StepSizes(
        num_reqs=10, num_decodes=9, decode_blocks=1, prefill_tokens=1, prefill_blocks=1
    ),
)
@given(tokens=axis_st(), batch=axis_st(), s=any_step_st())
def test_token_fallback_is_bounded_by_the_real_token_rows(
    tokens: tuple[int, ...], batch: tuple[int, ...], s: StepSizes
) -> None:
    """The fallback promises a pad below the size itself (fallback_size; the
    docs: "pad it to at most [2] times its real size"); for a step whose
    token rows take it, that size is the step's real prefill rows (the decode
    rows are a part of their own, padded on the batch axis).

    Failed on policy.py as of 38fab45, when decode rows were padded first and
    the token fallback sized from that padded total (see the examples)."""
    b = BucketSet(tokens, batch, (1,))
    logger = logging.getLogger(LOGGER)
    logger.disabled = True
    try:
        p = Bucketer(b).pad(s)
    finally:
        logger.disabled = False
    if "tokens" in p.fallbacks:
        assert p.prefill_tokens < 2 * s.prefill_tokens, (s, p)


def test_fallback_warns_once_per_axis_and_size_and_counts_steps(
    bucket_log: pytest.LogCaptureFixture,
) -> None:
    b = BucketSet(tokens=(16, 100), batch=(4,), blocks=(8,))  # token align 64
    bucketer = Bucketer(b)

    def decode(n: int, blocks: int = 1) -> StepSizes:
        return StepSizes(n, n, blocks, 0, 0)

    p = bucketer.pad(decode(3, blocks=20))  # blocks 20 > 8: align 8 -> 24
    assert p.fallbacks == ("blocks",)
    assert p.decode_blocks == 24
    bucketer.pad(decode(3, blocks=17))  # also 24: no second warning
    bucketer.pad(decode(3, blocks=25))  # 32: a new size, a new warning
    bucketer.pad(decode(3, blocks=2))  # fits: no fallback
    assert bucketer.fallback_count == 3
    warnings = [r.getMessage() for r in bucket_log.records]
    assert len(warnings) == 2
    assert "blocks=20" in warnings[0] and "padding to 24" in warnings[0]
    assert "blocks=25" in warnings[1] and "padding to 32" in warnings[1]
    assert "vllm-hpu-mm buckets plan" in warnings[0]

    bucket_log.clear()
    p = bucketer.pad(
        StepSizes(
            num_reqs=5,
            num_decodes=0,
            decode_blocks=0,
            prefill_tokens=101,
            prefill_blocks=9,
        )
    )
    # batch 5 > 4 -> 8; tokens 101 > 100 -> 128; prefill blocks 9 > 8 -> 16
    assert p.batch == 8 and p.tokens == 128 and p.prefill_blocks == 16
    assert p.fallbacks == ("batch", "tokens", "prefill_blocks")
    assert bucketer.fallback_count == 4  # one step, however many axes
    assert len(bucket_log.records) == 3
    # The same sizes again: counted, not warned.
    bucketer.pad(StepSizes(5, 0, 0, 101, 9))
    assert bucketer.fallback_count == 5
    assert len(bucket_log.records) == 3


@FAST
@given(
    tokens=axis_st(),
    values=st.lists(st.integers(1, 2000), min_size=1, max_size=30),
)
def test_warnings_match_distinct_fallback_sizes(
    tokens: tuple[int, ...], values: list[int]
) -> None:
    b = BucketSet(tokens, (1,), (1 << 20,))
    bucketer = Bucketer(b)
    logger = logging.getLogger(LOGGER)
    handler = _Records()
    logger.addHandler(handler)
    try:
        steps = [StepSizes(1, 0, 0, v, 1) for v in values]  # prefill only
        sizes = [bucketer.pad(s) for s in steps]
    finally:
        logger.removeHandler(handler)
    over = [v for v in values if v > tokens[-1]]
    assert bucketer.fallback_count == len(over)
    assert len(handler.records) == len({fallback_size(v, tokens) for v in over})
    for v, p in zip(values, sizes, strict=True):
        assert p.tokens >= v


# --------------------------------------------------------------------------
# Strategies' shapes
# --------------------------------------------------------------------------


@FAST
@given(lo=st.integers(1, 5000), extra=st.integers(0, 100000))
def test_exponential_doubles_from_lo_and_ends_at_hi(lo: int, extra: int) -> None:
    hi = lo + extra
    xs = exponential(lo, hi)
    assert xs[0] == lo and xs[-1] == hi
    assert list(xs) == sorted(set(xs))
    for a, b in itertools.pairwise(xs[:-1]):
        assert b == 2 * a
    if len(xs) > 1:
        assert xs[-2] < hi <= 2 * xs[-2]


@FAST
@given(lo=st.integers(1, 5000), step=st.integers(1, 600), extra=st.integers(0, 20000))
def test_linear_steps_on_multiples_and_ends_at_hi(
    lo: int, step: int, extra: int
) -> None:
    hi = lo + extra
    xs = linear(lo, step, hi)
    assert xs[0] == lo and xs[-1] == hi
    assert list(xs) == sorted(set(xs))
    assert all(x % step == 0 for x in xs[1:-1])
    assert all(b - a <= step for a, b in itertools.pairwise(xs))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: exponential(0, 8), "0 < lo <= hi"),
        (lambda: exponential(9, 8), "0 < lo <= hi"),
        (lambda: linear(-1, 8, 8), "0 < lo <= hi"),
        (lambda: linear(1, 0, 8), "step must be positive"),
        (lambda: default_buckets(Limits(4, 64, 64, 16), "explicit"), "explicit"),
    ],
)
def test_strategy_argument_errors(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_default_set_examples() -> None:
    limits = Limits(128, 8192, 8192, 128)
    exp = default_buckets(limits, "exponential")
    assert exp.batch == (1, 2, 4, 8, 16, 32, 64, 128)
    assert exp.tokens == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert exp.blocks == exponential(1, 8192)
    assert exp.num_graphs == 18
    lin = default_buckets(limits, "linear", min_tokens=32, batch_step=32)
    assert lin.batch == (1, 32, 64, 96, 128)
    assert lin.tokens[:4] == (32, 128, 256, 384)
    assert clip([5, 0, 300, 7, 5], 100) == (5, 7, 100)


# --------------------------------------------------------------------------
# Validation and helpers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "batch", "blocks", "match"),
    [
        ((), (1,), (1,), "'tokens' is empty"),
        ((1,), (), (1,), "'batch' is empty"),
        ((1,), (1,), (), "'blocks' is empty"),
        ((4, 2), (1,), (1,), "'tokens' must be strictly increasing"),
        ((1,), (2, 2), (1,), "'batch' must be strictly increasing"),
        ((1,), (1,), (0, 4), "'blocks' must be strictly increasing positive"),
        ((-3, 1), (1,), (1,), "'tokens' must be strictly increasing positive"),
    ],
)
def test_bucket_set_validation(
    tokens: tuple[int, ...], batch: tuple[int, ...], blocks: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        BucketSet(tokens, batch, blocks)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": -1},
        {"max_model_len": 1.5},
        {"block_size": "16"},
    ],
)
def test_limits_validation(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "block_size": 16,
    }
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"Limits.{name} must be a positive int"):
        Limits(**{**base, **kwargs})  # type: ignore[arg-type]


def test_limits_derived_sizes() -> None:
    limits = Limits(
        max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1000, block_size=128
    )
    assert limits.max_blocks_per_seq == 8  # ceil(1000 / 128)
    assert limits.max_blocks == 64
    assert limits.max_tokens == 512


@FAST
@given(buckets=axis_st(1000), value=st.integers(1, 1200))
def test_smallest_fit_matches_a_scan(buckets: tuple[int, ...], value: int) -> None:
    scan = next((b for b in buckets if b >= value), None)
    assert smallest_fit(value, buckets) == scan


def test_padding_ratio() -> None:
    assert padding_ratio([3, 5], [4, 8]) == pytest.approx(1 - 8 / 12)
    assert padding_ratio([], []) == 0.0
    assert padding_ratio([7], [7]) == 0.0


# --------------------------------------------------------------------------
# step_shapes: warmup's list holds every key a real step pads to
# --------------------------------------------------------------------------


@st.composite
def real_step_st(draw: st.DrawFn, limits: Limits) -> tuple[object, object]:
    """(query_lens, seq_lens) of a real step: decodes, then prefill chunks, at
    most one of them with prior context (a continued chunk or a prefix hit)."""
    import numpy as np

    seqs, budget, model_len = (
        limits.max_num_seqs,
        limits.max_tokens,
        limits.max_model_len,
    )
    n_dec = draw(st.integers(0, min(seqs, budget)))
    dec_ctx = [draw(st.integers(1, model_len)) for _ in range(n_dec)]
    left, q, prior = budget - n_dec, [], []
    for i in range(min(seqs - n_dec, 6)):
        if left < 2 or not draw(st.booleans()):
            break
        n = draw(st.integers(2, min(left, model_len)))
        p = draw(st.integers(0, model_len - n)) if i == 0 else 0
        q.append(n)
        prior.append(p)
        left -= n
    query = np.array([1] * n_dec + q, np.int64)
    seq = np.array(dec_ctx + [p + n for p, n in zip(prior, q, strict=True)], np.int64)
    return query, seq


@settings(max_examples=200, deadline=None)
@given(data=st.data(), form=st.sampled_from(["flat", "batched"]))
def test_every_real_step_pads_to_a_warmed_shape(data: st.DataObject, form: str) -> None:
    from vllm_hpu_mm.attention.metadata import exact_shape

    limits = data.draw(
        st.builds(
            Limits,
            max_num_seqs=st.integers(1, 16),
            max_num_batched_tokens=st.integers(2, 512),
            max_model_len=st.integers(2, 1024),
            block_size=st.sampled_from([4, 16]),
        )
    )
    b = data.draw(default_set_st(limits))
    query, seq = data.draw(real_step_st(limits))
    real = exact_shape(query, seq, limits.block_size, form, tile=32)  # type: ignore[arg-type]
    p = Bucketer(b).pad(
        StepSizes(
            num_reqs=int(query.size),
            num_decodes=real.num_decodes,
            decode_blocks=real.decode_blocks,
            prefill_tokens=real.num_prefill_tokens,
            prefill_blocks=real.prefill_blocks,
        )
    )
    assert p.fallbacks == ()
    decode, prefill = step_shapes(b, limits, form, prefill_tile=32)
    if p.num_decodes:
        assert (p.num_decodes, p.decode_blocks) in decode
    if p.prefill_tokens:
        assert (p.prefill_tokens, p.prefill_blocks) in prefill
    # a one-request part in its own form (bucketing.prefill_one_request)
    one = one_request_shapes(b, limits, prefill_tile=32)
    if real.prefill_form == "causal":
        assert (p.prefill_tokens, 0, "causal") in one
    elif real.prefill_form == "request":
        assert (p.prefill_tokens, p.prefill_blocks, "request") in one


def test_one_request_keys_hand_worked() -> None:
    """Token sizes 16, 64, 256 (block 128, 512-token requests): only 256 holds
    one request above a 128-row tile (129..256 rows: 2 blocks, up to a whole
    request's 4): a causal key and request keys over blocks 2 and 4."""
    limits = Limits(
        max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, block_size=128
    )
    b = explicit(limits, [16, 64, 256], [1, 2], [2, 4, 8])
    one = one_request_shapes(b, limits)
    assert one == [(256, 0, "causal"), (256, 2, "request"), (256, 4, "request")]
    tiles = count_graphs(b, limits, "flat")
    assert count_graphs(b, limits, "flat", one_request=True) == tiles + 3
    # graphs keyed by token rows alone (opaque attention) have no forms
    assert count_graphs(b, limits, "flat", opaque_attention=True) == count_graphs(
        b, limits, "flat", opaque_attention=True, one_request=True
    )
