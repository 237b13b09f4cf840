"""``vllm-hpu-mm buckets plan --metrics``: buckets fitted to a saved scrape of the
server's ``/metrics`` (the ``vllm_hpu_mm:step_shape`` histogram)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from vllm_hpu_mm.bucketing.buckets import Limits
from vllm_hpu_mm.bucketing.planner import (
    AxisSamples,
    evaluate,
    plan_buckets,
    plan_buckets_from_axes,
    prompt_lengths,
    simulate_steps,
)
from vllm_hpu_mm.bucketing.record import STEP_SHAPE_EDGES
from vllm_hpu_mm.bucketing.scrape import read_step_shape_metrics
from vllm_hpu_mm.cli.main import main
from vllm_hpu_mm.worker import shapes

LIMITS = Limits(128, 8192, 8192, 128)

# A scrape as vLLM's /metrics serves it (abridged to the plugin's histogram),
# recorded from a server that ran 5 steps: decode 3 rows / 7 blocks, then
# prefills of 40 and 600 tokens, decode 3, then one mixed step.
RECORDED = """\
# HELP vllm_hpu_mm:step_shape Exact (unpadded) sizes of the served steps, by axis
# TYPE vllm_hpu_mm:step_shape histogram
vllm_hpu_mm:step_shape_bucket{axis="requests",le="1.0"} 2.0
vllm_hpu_mm:step_shape_bucket{axis="requests",le="2.0"} 2.0
vllm_hpu_mm:step_shape_bucket{axis="requests",le="3.0"} 4.0
vllm_hpu_mm:step_shape_bucket{axis="requests",le="4.0"} 5.0
vllm_hpu_mm:step_shape_bucket{axis="requests",le="+Inf"} 5.0
vllm_hpu_mm:step_shape_count{axis="requests"} 5.0
vllm_hpu_mm:step_shape_sum{axis="requests"} 12.0
vllm_hpu_mm:step_shape_bucket{axis="decode_rows",le="3.0"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="decode_rows",le="+Inf"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="decode_blocks",le="7.0"} 2.0
vllm_hpu_mm:step_shape_bucket{axis="decode_blocks",le="8.0"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="decode_blocks",le="+Inf"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_tokens",le="40.0"} 1.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_tokens",le="50.0"} 2.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_tokens",le="608.0"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_tokens",le="+Inf"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_blocks",le="1.0"} 2.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_blocks",le="5.0"} 3.0
vllm_hpu_mm:step_shape_bucket{axis="prefill_blocks",le="+Inf"} 3.0
# HELP vllm_hpu_mm:padded_tokens_total Token rows added by bucket padding.
# TYPE vllm_hpu_mm:padded_tokens_total counter
vllm_hpu_mm:padded_tokens_total 171.0
"""


def test_read_a_recorded_scrape() -> None:
    scrape = read_step_shape_metrics(RECORDED)
    assert scrape.bins["requests"] == ((1, 2), (3, 2), (4, 1))
    assert scrape.bins["decode_blocks"] == ((7, 2), (8, 1))
    assert scrape.bins["prefill_tokens"] == ((40, 1), (50, 1), (608, 1))
    assert scrape.above == {} and scrape.steps == 5
    axes = scrape.axes()
    assert axes.decode_rows == ((3, 3),) and axes.prefill_blocks == ((1, 2), (5, 1))


def test_bad_scrapes_are_refused() -> None:
    with pytest.raises(ValueError, match="holds no vllm_hpu_mm:step_shape"):
        read_step_shape_metrics("vllm_hpu_mm:padded_tokens_total 3.0\n")
    broken = RECORDED.replace('le="4.0"} 5.0', 'le="4.0"} 1.0')
    with pytest.raises(ValueError, match="not cumulative"):
        read_step_shape_metrics(broken)


def _scrape_of(steps: list, tmp_path: Path) -> Path:
    """Observe ``steps`` into a fresh registry through the server's own
    observation code and edges, and save the text exposition."""
    registry = CollectorRegistry()
    hist = Histogram(
        "vllm_hpu_mm:step_shape",
        "step shapes",
        ["axis"],
        buckets=STEP_SHAPE_EDGES,
        registry=registry,
    )
    from vllm_hpu_mm.attention.metadata import StepShape

    real = shapes.metrics.STEP_SHAPE
    shapes.metrics.STEP_SHAPE = hist
    try:
        for s in steps:
            shapes.observe_step(
                StepShape(
                    s.num_decodes, s.decode_blocks, s.prefill_tokens, s.prefill_blocks
                ),
                s.num_reqs,
            )
    finally:
        shapes.metrics.STEP_SHAPE = real
    path = tmp_path / "metrics.txt"
    path.write_bytes(generate_latest(registry))
    return path


def test_edges_are_exact_to_16_then_within_a_sixteenth() -> None:
    edges = [int(e) for e in STEP_SHAPE_EDGES]
    assert edges[:16] == list(range(1, 17)) and edges[-1] == 1 << 18
    assert all(b - a <= max(1, a / 16) for a, b in itertools.pairwise(edges))


def test_plan_from_the_scrape_pads_close_to_the_plan_from_the_steps(
    tmp_path: Path,
) -> None:
    """The histogram loses which sizes went together in a step and rounds each
    up to its bin; planned from it, the buckets still pad the real steps within
    a point or two of the plan from the exact steps (and far below the old
    half-octave edges', which could only plan half octaves)."""
    lens = prompt_lengths(1500, seed=3)
    steps = simulate_steps(lens, LIMITS, 2048, seed=3)
    scrape = read_step_shape_metrics(_scrape_of(steps, tmp_path).read_text())
    assert scrape.steps == len(steps)
    from_scrape = plan_buckets_from_axes(scrape.axes(), LIMITS, 16).buckets
    from_steps = plan_buckets(steps, LIMITS, 16)
    got = evaluate(from_scrape, steps)["tokens_padding_pct"]
    best = evaluate(from_steps, steps)["tokens_padding_pct"]
    assert best <= got <= best + 1.0, (got, best)
    # Exact sizes (no rounding) plan exactly as the steps do.
    exact = plan_buckets_from_axes(AxisSamples.from_steps(steps), LIMITS, 16).buckets
    assert evaluate(exact, steps)["tokens_padding_pct"] == pytest.approx(best)
    # Half-octave edges (the histogram's before) lose several points.
    half = AxisSamples(
        requests=scrape.axes().requests,
        decode_rows=_half_octave(scrape.axes().decode_rows),
        prefill_tokens=_half_octave(scrape.axes().prefill_tokens),
        decode_blocks=(),
        prefill_blocks=(),
    )
    worse = evaluate(plan_buckets_from_axes(half, LIMITS, 16).buckets, steps)
    assert worse["tokens_padding_pct"] > got + 2.0


def _half_octave(pairs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    edges = sorted({m << e for e in range(20) for m in (2, 3)} | {1})
    out: dict[int, int] = {}
    for v, c in pairs:
        up = next(e for e in edges if e >= v)
        out[up] = out.get(up, 0) + c
    return tuple(sorted(out.items()))


def test_cli_plans_from_a_saved_scrape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "metrics.txt"
    path.write_text(RECORDED)
    out = tmp_path / "buckets.yaml"
    argv = ["buckets", "plan", "--metrics", str(path), "--graph-budget", "8"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Sample: 5 steps (the step_shape histogram of" in printed
    text = out.read_text()
    from vllm_hpu_mm.config import load_explicit_buckets

    lists = load_explicit_buckets(out)
    # Each sampled size is an edge (the budget allows it): no padding left.
    assert {40, 50, 608} <= set(lists.prefill_tokens)
    assert {1, 3, 4} <= set(lists.decode_batch)
    assert "tokens 0.0 %" in text
    empty = tmp_path / "empty.txt"
    empty.write_text("vllm_hpu_mm:padded_tokens_total 3.0\n")
    bad = ["buckets", "plan", "--metrics", str(empty), "--out", str(tmp_path / "b")]
    assert main(bad) == 1
    assert "holds no vllm_hpu_mm:step_shape" in capsys.readouterr().err
