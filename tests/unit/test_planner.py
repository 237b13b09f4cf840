"""vllm_hpu_mm.bucketing.planner and `vllm-hpu-mm buckets`: the DP against
brute force, budgets and closure, the seeded workloads, the CLI round trip."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hpu_mm.bucketing.buckets import (
    BucketSet,
    Limits,
    count_graphs,
    default_buckets,
    explicit,
)
from vllm_hpu_mm.bucketing.planner import (
    WORKLOADS,
    axis_padding,
    evaluate,
    plan_axis,
    plan_buckets,
    plan_buckets_detailed,
    prompt_lengths,
    simulate_steps,
)
from vllm_hpu_mm.bucketing.policy import StepSizes
from vllm_hpu_mm.cli.main import main
from vllm_hpu_mm.config import load_explicit_buckets

FAST = settings(max_examples=80, deadline=None)
DESIGN = Limits(
    max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=8192, block_size=128
)


def brute_force(
    values: list[int], max_buckets: int, top: int | None, fixed: set[int]
) -> int:
    """Least padding over every edge set of integers in 1..last holding the
    forced edges (not only sampled sizes: this also checks that claim)."""
    forced = set(fixed) | ({top} if top is not None else {max(values)})
    last = max(forced)
    free = [e for e in range(1, last) if e not in forced]
    best = math.inf
    for extra in range(max_buckets - len(forced) + 1):
        for combo in itertools.combinations(free, extra):
            best = min(best, axis_padding(values, sorted(forced | set(combo))))
    return int(best)


# --------------------------------------------------------------------------
# plan_axis
# --------------------------------------------------------------------------


@FAST
@given(
    values=st.lists(st.integers(1, 18), min_size=1, max_size=12),
    max_buckets=st.integers(1, 4),
    top_extra=st.one_of(st.none(), st.integers(0, 4)),
    fixed=st.sets(st.integers(1, 18), max_size=2),
)
def test_plan_axis_is_optimal_against_brute_force(
    values: list[int], max_buckets: int, top_extra: int | None, fixed: set[int]
) -> None:
    top = None if top_extra is None else max(values) + top_extra
    fixed = {f for f in fixed if top is None or f <= top}  # above top: dropped
    forced = fixed | ({top} if top is not None else {max(values)})
    if len(forced) > max_buckets:
        with pytest.raises(ValueError, match="exceed max_buckets"):
            plan_axis(values, max_buckets, top, fixed=fixed)
        return
    edges = plan_axis(values, max_buckets, top, fixed=fixed)
    assert list(edges) == sorted(set(edges))
    assert len(edges) <= max_buckets
    assert forced <= set(edges)
    assert edges[-1] == max(forced)
    assert all(any(e >= v for e in edges) for v in values)  # every value fits
    assert axis_padding(values, edges) == brute_force(values, max_buckets, top, fixed)


@FAST
@given(
    values=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    max_buckets=st.integers(1, 10),
)
def test_plan_axis_edges_are_sampled_sizes_and_more_budget_never_hurts(
    values: list[int], max_buckets: int
) -> None:
    edges = plan_axis(values, max_buckets)
    assert set(edges) <= set(values)
    more = plan_axis(values, max_buckets + 1)
    assert axis_padding(values, more) <= axis_padding(values, edges)
    if len(set(values)) <= max_buckets:
        assert axis_padding(values, edges) == 0


def test_plan_axis_small_cases() -> None:
    assert plan_axis([5, 5, 5], 4) == (5,)  # fewest edges among equal plans
    assert plan_axis([5, 5, 5], 4, top=10) == (5, 10)
    assert plan_axis([1, 2, 3, 100], 2) == (3, 100)
    # Weighted by repeats: many 10s pull an edge onto 10.
    assert plan_axis([10] * 50 + [11, 12, 13], 2, top=13) == (10, 13)
    # Zeros are "axis unused", sizes above top are illegal: both ignored.
    assert plan_axis([0, 4, 9, 50], 2, top=10) == (4, 10)
    assert plan_axis([], 3, top=64, fixed=[8]) == (8, 64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"values": [1, 2], "max_buckets": 0}, "max_buckets must be >= 1"),
        ({"values": [], "max_buckets": 2}, "needs values, a top or fixed"),
        ({"values": [3], "max_buckets": 1, "top": 0}, "top must be a positive"),
        (
            {"values": [3], "max_buckets": 2, "top": 9, "fixed": [1, 2]},
            r"3 forced edges \[1, 2, 9\] exceed max_buckets=2",
        ),
    ],
)
def test_plan_axis_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_axis(**kwargs)  # type: ignore[arg-type]


def test_plan_axis_bins_many_distinct_values() -> None:
    values = [int(v) for v in prompt_lengths(3000, seed=3, hi=4000)]
    values = sorted(set(values))[:600] + values  # >= 600 distinct
    assert len(set(values)) > 300
    exact = plan_axis(values, 12, top=4000)
    binned = plan_axis(values, 12, top=4000, max_distinct=50)
    q = math.ceil(max(values) / 50)
    assert len(binned) <= 12 and binned[-1] == 4000
    assert all(e % q == 0 or e == 4000 for e in binned)
    assert all(any(e >= v for e in binned) for v in values)
    gap = axis_padding(values, binned) - axis_padding(values, exact)
    assert 0 <= gap <= (q - 1) * len(values)


# --------------------------------------------------------------------------
# plan_buckets
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def design_sample() -> list[StepSizes]:
    """The DESIGN's three seeded workloads, 400 prompts, seed 0."""
    return simulate_steps(prompt_lengths(400, seed=0), DESIGN, 2048, seed=0)


@st.composite
def small_sample_st(draw: st.DrawFn) -> tuple[Limits, list[StepSizes]]:
    limits = Limits(
        max_num_seqs=draw(st.integers(1, 32)),
        max_num_batched_tokens=draw(st.integers(32, 1024)),
        max_model_len=draw(st.integers(16, 2048)),
        block_size=draw(st.sampled_from([16, 32])),
    )
    lens = draw(st.lists(st.integers(1, 3000), min_size=1, max_size=15))
    workloads = draw(
        st.lists(st.sampled_from(WORKLOADS), min_size=1, max_size=3, unique=True)
    )
    budget = draw(st.integers(8, 1024))
    seed = draw(st.integers(0, 3))
    return limits, simulate_steps(lens, limits, budget, seed, workloads)


@FAST
@given(data=small_sample_st(), extra=st.integers(0, 20))
def test_plan_buckets_respects_the_budget_and_closes_at_the_limits(
    data: tuple[Limits, list[StepSizes]], extra: int
) -> None:
    limits, steps = data
    budget = 3 + extra
    plan = plan_buckets_detailed(steps, limits, budget)
    b = plan.buckets
    assert b.num_graphs <= budget
    assert b.tokens[-1] == limits.max_tokens
    assert b.batch[-1] == limits.max_num_seqs
    assert b.blocks[-1] == limits.max_blocks
    # What the engine builds from the written lists is the same set.
    assert explicit(limits, b.tokens, b.batch, b.blocks) == b
    result = evaluate(b, steps)
    assert result["fallback_steps"] == 0
    assert result["graphs"] == b.num_graphs
    assert plan.padded_token_rows == result["padded_tokens"] - result["real_tokens"]
    assert plan.padded_batch_rows == result["padded_batch"] - result["real_batch"]


def test_plan_buckets_rejects_a_budget_below_the_least(
    design_sample: list[StepSizes],
) -> None:
    with pytest.raises(ValueError, match=r"graph_budget=1 is below .*: 2"):
        plan_buckets(design_sample, DESIGN, 1)
    assert plan_buckets(design_sample, DESIGN, 2).num_graphs == 2


@pytest.mark.parametrize("form", ["batched", "flat"])
def test_step_graph_budget_caps_the_graphs_warmup_compiles(
    design_sample: list[StepSizes], form: str
) -> None:
    free = plan_buckets_detailed(design_sample, DESIGN, 16, decode_form=form).buckets
    graphs = count_graphs(free, DESIGN, form)
    cap = graphs // 2
    capped = plan_buckets_detailed(
        design_sample, DESIGN, 16, step_graph_budget=cap, decode_form=form
    ).buckets
    assert count_graphs(capped, DESIGN, form) <= cap < graphs
    # Only block edges go; the set stays closed at the limits.
    assert (capped.tokens, capped.batch) == (free.tokens, free.batch)
    assert set(capped.blocks) < set(free.blocks)
    assert capped.blocks[-1] == DESIGN.max_blocks
    assert evaluate(capped, design_sample)["fallback_steps"] == 0
    with pytest.raises(ValueError, match="step_graph_budget=1 is below"):
        plan_buckets_detailed(design_sample, DESIGN, 16, step_graph_budget=1)
    with pytest.raises(ValueError, match="at least one sampled step"):
        plan_buckets([], DESIGN, 10)


def test_planned_beats_exponential_at_no_more_graphs(
    design_sample: list[StepSizes],
) -> None:
    exp = default_buckets(DESIGN, "exponential")
    base = evaluate(exp, design_sample)
    for budget in (16, exp.num_graphs):
        planned = evaluate(plan_buckets(design_sample, DESIGN, budget), design_sample)
        assert planned["graphs"] <= base["graphs"]
        assert planned["fallback_steps"] == base["fallback_steps"] == 0
        for axis in ("tokens", "batch", "blocks"):
            key = f"{axis}_padding_pct"
            assert planned[key] <= base[key], (budget, axis, planned, base)


def test_more_budget_never_raises_the_split_score(
    design_sample: list[StepSizes],
) -> None:
    def score(b: BucketSet) -> float:
        r = evaluate(b, design_sample)
        tok = (r["padded_tokens"] - r["real_tokens"]) / r["real_tokens"]
        return tok + (r["padded_batch"] - r["real_batch"]) / r["real_batch"]

    scores = [score(plan_buckets(design_sample, DESIGN, k)) for k in range(4, 30, 3)]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(scores)), scores


def test_blocks_get_a_doubling_tail_up_to_the_limit(
    design_sample: list[StepSizes],
) -> None:
    blocks = plan_buckets(design_sample, DESIGN, 16).blocks
    sampled_max = max(max(s.decode_blocks, s.prefill_blocks) for s in design_sample)
    tail = [b for b in blocks if b > sampled_max]
    assert tail[-1] == DESIGN.max_blocks
    # From the largest planned size up to the limit, each size at most doubles.
    assert all(b <= 2 * a for a, b in itertools.pairwise(blocks[-len(tail) - 1 :]))


# --------------------------------------------------------------------------
# Workloads and evaluate
# --------------------------------------------------------------------------


def test_prompt_lengths_are_seeded_lognormal_and_clipped() -> None:
    lens = prompt_lengths(20000, seed=1)
    assert lens == prompt_lengths(20000, seed=1)
    assert lens != prompt_lengths(20000, seed=2)
    assert min(lens) >= 16 and max(lens) <= 8192
    median = sorted(lens)[len(lens) // 2]
    assert 570 <= median <= 630


def test_single_and_chunked_workloads_pack_fcfs() -> None:
    limits = Limits(
        max_num_seqs=4, max_num_batched_tokens=512, max_model_len=900, block_size=16
    )
    lens = [100, 300, 700, 1000, 20, 20, 20, 20, 20]
    single = simulate_steps(lens, limits, workloads=["single"])
    # 700 and 1000 (cut to max_model_len 900) are chunked at 512 tokens.
    assert [s.prefill_tokens for s in single] == [100, 300, 512, 188, 512, 388] + [
        20
    ] * 5
    assert all(s.num_reqs == 1 and s.num_decodes == 0 for s in single)
    assert single[3].prefill_blocks == math.ceil(700 / 16)  # context incl. chunk 1

    chunked = simulate_steps(lens, limits, budget_tokens=256, workloads=["chunked"])
    tokens = [s.prefill_tokens for s in chunked]
    assert sum(tokens) == 100 + 300 + 700 + 900 + 5 * 20
    assert all(t == 256 for t in tokens[:-1]) and 0 < tokens[-1] <= 256
    assert all(1 <= s.num_reqs <= limits.max_num_seqs for s in chunked)
    # Step 1: 100 whole + 156 of 300: blocks ceil(100/16) + ceil(156/16).
    assert chunked[0] == StepSizes(2, 0, 0, 256, 7 + 10)


def test_decode_workload_is_seeded_and_within_the_limits() -> None:
    steps = simulate_steps([600] * 300, DESIGN, seed=5, workloads=["decode"])
    assert steps == simulate_steps([1] * 300, DESIGN, seed=5, workloads=["decode"])
    assert len(steps) == 300
    assert all(1 <= s.num_reqs == s.num_decodes <= 128 for s in steps)
    assert all(s.prefill_tokens == s.prefill_blocks == 0 for s in steps)
    assert all(1 <= s.decode_blocks <= DESIGN.max_blocks_per_seq for s in steps)
    assert len({s.num_reqs for s in steps}) > 60  # uniform over 1..128


def test_simulate_steps_errors() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        simulate_steps([10], DESIGN, workloads=["prefill"])
    with pytest.raises(ValueError, match="budget_tokens must be positive"):
        simulate_steps([10], DESIGN, budget_tokens=0)


def test_evaluate_counts_padding_and_fallbacks() -> None:
    b = BucketSet(tokens=(4, 16), batch=(4,), blocks=(8,))
    steps = [
        StepSizes(3, 3, 2, 0, 0),  # decode: tokens 3->4, batch 3->4, blocks 2->8
        StepSizes(1, 0, 0, 10, 1),  # prefill: tokens 10->16, blocks 1->8
        StepSizes(1, 0, 0, 20, 1),  # fallback: tokens 20 -> 32 (align 16)
    ]
    r = evaluate(b, steps)
    assert r["steps"] == 3 and r["graphs"] == 3 and r["fallback_steps"] == 1
    assert (r["real_tokens"], r["padded_tokens"]) == (33, 52)
    assert (r["real_batch"], r["padded_batch"]) == (5, 12)
    assert (r["real_blocks"], r["padded_blocks"]) == (4, 24)
    assert r["tokens_padding_pct"] == pytest.approx(100 * (1 - 33 / 52))


def test_planner_counts_graphs_with_the_buckets_default_decode_form(
    design_sample: list[StepSizes],
) -> None:
    """``plan_buckets_detailed`` and ``count_graphs`` default to the same decode
    form (flat, Gaudi's), so a plan capped at G step graphs has at most G by the
    count warmup and ``buckets show`` use."""
    free = plan_buckets_detailed(design_sample, DESIGN, 16).buckets
    cap = count_graphs(free, DESIGN) // 2
    capped = plan_buckets_detailed(design_sample, DESIGN, 16, step_graph_budget=cap)
    assert count_graphs(capped.buckets, DESIGN) <= cap
    assert count_graphs(free, DESIGN) == count_graphs(free, DESIGN, "flat")
    flat = plan_buckets_detailed(
        design_sample, DESIGN, 16, step_graph_budget=cap, decode_form="flat"
    )
    assert capped.buckets == flat.buckets
    batched = plan_buckets_detailed(
        design_sample, DESIGN, 16, step_graph_budget=cap, decode_form="batched"
    )
    assert batched.buckets != flat.buckets  # the form matters on this sample


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

LIMIT_ARGS = [
    "--max-num-seqs", "128",
    "--max-num-batched-tokens", "8192",
    "--max-model-len", "8192",
    "--block-size", "128",
]  # fmt: skip


def test_cli_plan_synthetic_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "configs" / "planned.yaml"
    argv = ["buckets", "plan", "--synthetic", "150", *LIMIT_ARGS]
    argv += ["--graph-budget", "18", "--seed", "7", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    planned_row = next(r for r in printed.splitlines() if r.startswith("| planned"))
    assert int(planned_row.split("|")[2]) <= 18
    assert planned_row.split("|")[-2].strip() == "0"  # no fallback steps
    assert "| exponential | 17 |" in printed
    assert "| prior (default) |" in printed

    text = out.read_text()
    assert text.startswith("# Bucket lists planned by `vllm-hpu-mm buckets plan`")
    assert "# Command: vllm-hpu-mm buckets plan --synthetic 150" in text
    assert '"file": "planned.yaml"' in text
    lists = load_explicit_buckets(out)
    loaded = explicit(DESIGN, lists.prefill_tokens, lists.decode_batch, lists.blocks)
    steps = simulate_steps(prompt_lengths(150, 7), DESIGN, 2048, 7)
    assert loaded == plan_buckets(steps, DESIGN, 18)
    assert loaded.num_graphs <= 18


def test_cli_plan_step_graph_budget_per_decode_form(tmp_path: Path) -> None:
    steps = simulate_steps(prompt_lengths(150, 7), DESIGN, 2048, 7)
    for form in ("flat", "batched"):
        out = tmp_path / f"{form}.yaml"
        argv = ["buckets", "plan", "--synthetic", "150", *LIMIT_ARGS, "--seed", "7"]
        argv += ["--graph-budget", "18", "--step-graph-budget", "60"]
        argv += ["--decode-form", form, "--out", str(out)]
        assert main(argv) == 0
        lists = load_explicit_buckets(out)
        got = explicit(DESIGN, lists.prefill_tokens, lists.decode_batch, lists.blocks)
        assert (
            got
            == plan_buckets_detailed(
                steps, DESIGN, 18, step_graph_budget=60, decode_form=form
            ).buckets
        )
        assert count_graphs(got, DESIGN, form) <= 60


def test_cli_plan_from_jsonl_and_prompt_lengths(tmp_path: Path) -> None:
    steps = simulate_steps(prompt_lengths(60, 1), DESIGN, 2048, 1)
    jsonl = tmp_path / "steps.jsonl"
    lines = ["# recorded steps", ""]
    lines += [
        json.dumps({"num_reqs": s.num_reqs, "num_decodes": s.num_decodes,
                    "decode_blocks": s.decode_blocks,
                    "prefill_tokens": s.prefill_tokens,
                    "prefill_blocks": s.prefill_blocks, "ts": i})
        for i, s in enumerate(steps)
    ]  # fmt: skip
    jsonl.write_text("\n".join(lines))
    out = tmp_path / "a.yaml"
    base = ["buckets", "plan", *LIMIT_ARGS, "--graph-budget", "12", "--out", str(out)]
    assert main([*base[:2], "--samples", str(jsonl), *base[2:]]) == 0
    lists = load_explicit_buckets(out)
    got = explicit(DESIGN, lists.prefill_tokens, lists.decode_batch, lists.blocks)
    assert got == plan_buckets(steps, DESIGN, 12)

    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps(prompt_lengths(60, 1)))
    out2 = tmp_path / "b.yaml"
    argv = [*base[:2], "--samples", str(lens), "--seed", "1", *base[2:-1], str(out2)]
    assert main(argv) == 0
    assert load_explicit_buckets(out2) == lists  # the same steps, simulated


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"num_reqs": 1}\n', "line 1: missing key(s) num_decodes"),
        ('{"num_reqs": 1, "num_decodes": -1, "decode_blocks": 0, '
         '"prefill_tokens": 4, "prefill_blocks": 1}', "non-negative integers"),
        ("[1, 2]\n{oops\n", "line 2: not JSON"),
        ("[]", "the list of prompt lengths is empty"),
        ("# nothing\n", "holds no steps"),
    ],
)  # fmt: skip
def test_cli_plan_reports_bad_sample_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    argv = ["buckets", "plan", "--samples", str(path), "--out", str(tmp_path / "x")]
    assert main(argv) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_show_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["buckets", "show", *LIMIT_ARGS]) == 0
    out = capsys.readouterr().out
    assert "exponential: 17 sizes" in out
    assert "step-shape graphs" in out
    assert "batch (8): 1, 2, 4, 8, 16, 32, 64, 128" in out
    assert "linear: " in out

    bucket_file = tmp_path / "b.yaml"
    bucket_file.write_text(
        "prefill_tokens: [64, 9000]\ndecode_batch: [2]\nblocks: [4]\n"
    )
    assert main(["buckets", "show", "--file", str(bucket_file)]) == 0
    out = capsys.readouterr().out
    assert "tokens (1): 64" in out  # 9000 is above max_num_batched_tokens

    assert main(["buckets"]) == 2
    assert "plan" in capsys.readouterr().err
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["buckets", "plan", "--synthetic", "0", "--out", "x.yaml"])
