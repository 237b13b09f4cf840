"""bucketing.record_steps: the served steps' exact shapes, written as the lines
``vllm-hpu-mm buckets plan --samples`` reads, and planned from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hpu_mm.attention.metadata import StepShape
from vllm_hpu_mm.bucketing.buckets import BucketSet, Limits
from vllm_hpu_mm.bucketing.policy import StepSizes
from vllm_hpu_mm.bucketing.record import StepRecorder
from vllm_hpu_mm.cli.main import main, read_samples
from vllm_hpu_mm.worker.shapes import ShapePolicy

LIMITS = Limits(
    max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, block_size=16
)
BUCKETS = BucketSet(tokens=(64, 256), batch=(2, 8), blocks=(4, 16, 64, 256))


def _read(path: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_nothing_is_recorded_before_serving_starts(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path)
    recorder.record(1, 1, 2, 0, 0)  # warmup or the memory profile
    assert not path.exists()
    recorder.start()
    recorder.record(3, 2, 9, 57, 4)
    # Line-buffered: the line is in the file while the engine still runs.
    assert _read(path) == [
        {
            "num_reqs": 3,
            "num_decodes": 2,
            "decode_blocks": 9,
            "prefill_tokens": 57,
            "prefill_blocks": 4,
        }
    ]
    recorder.close()
    again = StepRecorder(path)  # a restart appends
    again.start()
    again.record(1, 0, 0, 30, 2)
    again.close()
    assert len(_read(path)) == 2


def test_the_policy_records_the_exact_shape_not_the_padded_one(
    tmp_path: Path,
) -> None:
    recorder = StepRecorder(tmp_path / "steps.jsonl")
    recorder.start()
    policy = ShapePolicy(BUCKETS, decode_form="flat", recorder=recorder)
    padded, batch = policy(StepShape(3, 5, 40, 3), num_reqs=4)
    assert (padded.num_decodes, padded.num_prefill_tokens, batch) == (8, 64, 8)
    recorder.close()
    assert _read(tmp_path / "steps.jsonl") == [
        {
            "num_reqs": 4,
            "num_decodes": 3,
            "decode_blocks": 5,
            "prefill_tokens": 40,
            "prefill_blocks": 3,
        }
    ]


def test_the_planner_reads_and_plans_from_the_recording(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path)
    recorder.start()
    shapes = [(1, 0, 0, 100, 7), (2, 2, 6, 0, 0), (5, 4, 20, 150, 10)]
    for shape in shapes:
        recorder.record(*shape)
    recorder.close()
    steps, what = read_samples(
        path, LIMITS, budget_tokens=256, seed=0, workloads=("single",)
    )
    assert steps == [StepSizes(*s) for s in shapes]
    assert what == f"3 steps from {path}"
    out = tmp_path / "buckets.yaml"
    argv = ["buckets", "plan", "--samples", str(path), "--out", str(out)]
    argv += ["--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
    assert main(argv) == 0
    assert "prefill_tokens" in out.read_text()


def test_an_unwritable_file_is_named_in_the_error(tmp_path: Path) -> None:
    recorder = StepRecorder(tmp_path / "no-such-dir" / "steps.jsonl")
    with pytest.raises(
        OSError, match=r"hpu_mm\.bucketing\.record_steps = .*no-such-dir"
    ):
        recorder.start()
