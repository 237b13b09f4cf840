"""``vllm-hpu-mm bench throughput`` end to end: the console command, both
backends, on the tiny models; the JSON report's figures must be sane (never
timed assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mm_reference import NUM_IMAGE_TOKENS, tiny_llava_dir
from vllm_hpu_mm.bench.stats import HF, VLLM, check_report

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 6
OUTPUT_LEN = 6


def _bench(tmp: Path, args: list[str]) -> tuple[dict[str, Any], str]:
    """Run the command in a fresh process (its own metrics dir); the report
    and the printed text."""
    out = tmp / "report.json"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp / "prom"))
    (tmp / "prom").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_hpu_mm.cli.main",
            "bench",
            "throughput",
            *args,
            "--output-json",
            str(out),
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def _common_checks(report: dict[str, Any]) -> dict[str, Any]:
    assert check_report(report) == []
    ours, hf = report["results"][VLLM], report["results"][HF]
    for r in (ours, hf):
        assert r["num_requests"] == NUM_PROMPTS
        # ignore_eos: every request runs its full output length.
        assert r["tokens"]["output"] == NUM_PROMPTS * OUTPUT_LEN
        assert all(q["output_tokens"] == OUTPUT_LEN for q in r["requests"])
        assert r["requests_per_s"] > 0 and r["tokens_per_s"]["total"] > 0
        assert r["ttft_s"]["p50"] > 0
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
        assert r["tpot_s"]["p50"] > 0
        assert r["e2e_s"]["max"] >= r["ttft_s"]["max"]
        assert r["peak_memory"]["host_rss_bytes"] > 0
    # Both backends saw the same prompts, token for token in number.
    assert ours["tokens"]["prompt_text"] == hf["tokens"]["prompt_text"]
    assert ours["tokens"]["prompt_image"] == hf["tokens"]["prompt_image"]
    # Graph mode: everything compiled at warmup, nothing after.
    assert ours["graphs_compiled"]["warmup"] > 0
    assert ours["graphs_compiled"]["after_warmup"] == 0
    assert ours["padding"]["scheduled_tokens"] > 0
    assert ours["padding"]["fallback_steps"] == 0
    ratio = report["ratio_vllm_hpu_mm_over_hf"]
    assert ratio["total_tokens_per_s"] == pytest.approx(
        ours["tokens_per_s"]["total"] / hf["tokens_per_s"]["total"]
    )
    return ours


def test_text_model_both_backends(tiny_llama_dir: str, tmp_path: Path) -> None:
    report, text = _bench(
        tmp_path,
        [
            "--model",
            tiny_llama_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--input-len",
            "24",
            "--output-len",
            str(OUTPUT_LEN),
            "--backend",
            "both",
            "--additional-config",
            '{"hpu_mm": {"graph_mode": "compile", "warmup": {"progress_bar": false}}}',
            "--plot",
            str(tmp_path / "bench.png"),
        ],
    )
    ours = _common_checks(report)
    assert ours["tokens"]["prompt_text"] == NUM_PROMPTS * 24  # exact token prompts
    assert ours["tokens"]["prompt_image"] == 0
    assert ours["encoder"]["mm_items"] == 0
    assert report["config"]["device"] == "cpu"
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "vllm-hpu-mm / hf:" in text


def test_llava_random_mm_pool_and_prefix(tmp_path: Path) -> None:
    report, _ = _bench(
        tmp_path,
        [
            "--model",
            tiny_llava_dir(),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--dataset-name",
            "random-mm",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--input-len",
            "12",
            "--output-len",
            str(OUTPUT_LEN),
            "--prefix-len",
            "40",
            "--mm-items-per-prompt",
            "1-2",
            "--mm-image-sizes",
            "40x24,24x40",
            "--mm-image-pool",
            "2",
            "--num-warmups",
            "1",
            "--enable-prefix-caching",
            "--backend",
            "both",
        ],
    )
    ours = _common_checks(report)
    images = ours["tokens"]["prompt_image"]
    assert images > 0 and images % NUM_IMAGE_TOKENS == 0
    assert NUM_PROMPTS <= images // NUM_IMAGE_TOKENS <= 2 * NUM_PROMPTS
    # Two distinct images, a shared 40-token prefix and a warm-up request: the
    # prefix cache hits, and no image is encoded more than once per request.
    pc = ours["prefix_cache"]
    assert pc["enabled"] and pc["queries"] > 0 and pc["hits"] > 0
    assert 0 < pc["hit_rate"] <= 1
    enc = ours["encoder"]
    assert enc["mm_items"] == images // NUM_IMAGE_TOKENS
    assert enc["runs"] <= enc["mm_items"]


def test_mllama_random_mm_both_backends(tiny_mllama_dir: str, tmp_path: Path) -> None:
    """Mllama: one ``<|image|>`` token per image, images read by cross-attention
    and encoded when their request arrives; each image at most once."""
    report, text = _bench(
        tmp_path,
        [
            "--model", tiny_mllama_dir, "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64",
            "--dataset-name", "random-mm", "--num-prompts", str(NUM_PROMPTS),
            "--input-len", "12", "--output-len", str(OUTPUT_LEN),
            "--prefix-len", "32", "--mm-items-per-prompt", "1-2",
            "--mm-image-sizes", "40x24,24x40,32x32", "--mm-image-pool", "2",
            "--enable-prefix-caching", "--backend", "both",
            "--additional-config", '{"hpu_mm": {"graph_mode": "eager"}}',
        ],
    )  # fmt: skip
    assert check_report(report) == []
    ours, hf = report["results"][VLLM], report["results"][HF]
    for r in (ours, hf):
        assert r["num_requests"] == NUM_PROMPTS
        assert r["tokens"]["output"] == NUM_PROMPTS * OUTPUT_LEN
        assert all(q["output_tokens"] == OUTPUT_LEN for q in r["requests"])
        assert r["requests_per_s"] > 0 and r["ttft_s"]["p50"] > 0
    # The same prompts, request by request: vLLM's tokenization on both sides
    # (one BOS), one placeholder token per image.
    for key in ("prompt_tokens", "image_tokens"):
        assert [q[key] for q in ours["requests"]] == [q[key] for q in hf["requests"]]
    enc = ours["encoder"]
    images = ours["tokens"]["prompt_image"]
    assert images == enc["mm_items"]
    assert NUM_PROMPTS <= images <= 2 * NUM_PROMPTS
    assert all(1 <= q["image_tokens"] <= 2 for q in ours["requests"])
    # A fresh engine encodes the two pooled images, each once, and reuses
    # their cross-attention K/V for every later request.
    assert enc["distinct_items"] == 2
    assert 1 <= enc["runs"] <= enc["distinct_items"]
    assert enc["runs_per_item"] is not None and enc["runs_per_item"] <= 1
    pc = ours["prefix_cache"]
    # Prompts with the same images share the prefix's blocks (the cache salt
    # names a request's images, so only those).
    assert pc["enabled"] and pc["queries"] > 0 and pc["hits"] > 0
    assert ours["padding"]["scheduled_tokens"] > 0
    assert f"{enc['distinct_items']} distinct" in text
