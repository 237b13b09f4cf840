"""``vllm-hpu-mm bench throughput`` without an engine: datasets, statistics,
the report's layout, the plot and the command line's routing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_hpu_mm.bench import datasets as ds
from vllm_hpu_mm.bench.stats import (
    HF,
    SCHEMA,
    VLLM,
    BackendResult,
    Report,
    RequestRecord,
    VllmResult,
    backend_result,
    build_report,
    check_report,
    format_report,
    percentile,
    summarize,
)

IMAGE = "<image>"


class WordTokenizer:
    """A real, tiny tokenizer: id ``i`` is the word ``w{i} ``."""

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        return "".join(f"w{i} " for i in ids)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return [int(w[1:]) for w in text.split() if w.startswith("w")]

    def __call__(self, text: str, *args: Any, **kwargs: Any) -> Any:
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": self.encode(text)})


VOCAB = list(range(10, 110))


# --- datasets -----------------------------------------------------------------------


def test_random_text_is_seeded_and_exact() -> None:
    spec = ds.TextSpec(num_prompts=20, input_len=30, output_len=7, prefix_len=5, seed=3)
    a, b = ds.random_text(spec, VOCAB), ds.random_text(spec, VOCAB)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    other = ds.random_text(ds.TextSpec(20, 30, 7, 5, seed=4), VOCAB)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in other]
    for r in a:
        assert r.prompt_token_ids is not None and r.prompt is None
        assert len(r.prompt_token_ids) == 35 and r.output_len == 7
        assert set(r.prompt_token_ids) <= set(VOCAB)
    # One shared prefix, then prompts that differ.
    prefixes = {tuple(r.prompt_token_ids[:5]) for r in a if r.prompt_token_ids}
    assert len(prefixes) == 1
    assert len({tuple(r.prompt_token_ids or []) for r in a}) == 20


def test_random_text_range_ratio_bounds() -> None:
    spec = ds.TextSpec(num_prompts=200, input_len=100, output_len=10, range_ratio=0.5)
    reqs = ds.random_text(spec, VOCAB)
    lens = [len(r.prompt_token_ids or []) for r in reqs]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 10
    assert all(5 <= r.output_len <= 15 for r in reqs)


def test_text_vocab_leaves_out_special_ids() -> None:
    assert ds.text_vocab(6, [0, 5, 2]) == [1, 3, 4]
    with pytest.raises(ValueError, match="no ordinary tokens"):
        ds.text_vocab(2, [0, 1])


def test_parse_sizes_ratios_and_ranges() -> None:
    assert ds.parse_sizes("64x64, 96X48") == ((64, 64), (96, 48))
    for bad in ("64", "64x", "0x4", "ax3"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
            ds.parse_sizes(bad)
    assert ds.sizes_from_ratios("1:1,4:3,9:16", 64) == ((64, 64), (64, 48), (36, 64))
    with pytest.raises(ValueError, match="W:H"):
        ds.sizes_from_ratios("4-3", 64)
    assert ds.parse_range("2") == (2, 2)
    assert ds.parse_range("0-3") == (0, 3)
    with pytest.raises(ValueError):
        ds.parse_range("x")
    with pytest.raises(ValueError, match="min <= max"):
        ds.ImageSpec(sizes=((8, 8),), items_per_prompt=(3, 1))


def _mm(seed: int = 0, pool: int = 0, items: tuple[int, int] = (1, 2)) -> list[Any]:
    text = ds.TextSpec(
        num_prompts=12, input_len=6, output_len=4, prefix_len=3, seed=seed
    )
    images = ds.ImageSpec(
        sizes=((40, 24), (24, 40), (32, 32)), items_per_prompt=items, pool=pool
    )
    return ds.random_mm(text, images, WordTokenizer(), VOCAB, IMAGE)


def test_random_mm_is_seeded() -> None:
    a, b, c = _mm(seed=1), _mm(seed=1), _mm(seed=2)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.image_keys for r in a] == [r.image_keys for r in b]
    for ra, rb in zip(a, b, strict=True):
        for ia, ib in zip(ra.images, rb.images, strict=True):
            assert ia.size == ib.size
            assert np.array_equal(np.asarray(ia), np.asarray(ib))
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_random_mm_sizes_items_and_placeholders() -> None:
    reqs = _mm(items=(0, 3))
    sizes = {im.size for r in reqs for im in r.images}
    assert sizes <= {(40, 24), (24, 40), (32, 32)} and len(sizes) > 1
    counts = [len(r.images) for r in reqs]
    assert min(counts) >= 0 and max(counts) <= 3 and len(set(counts)) > 1
    for r in reqs:
        assert r.prompt is not None and r.prompt.count(IMAGE) == len(r.images)
        assert all(im.mode == "RGB" for im in r.images)
        # Prefix (3 words), then the images, then about input_len words of text.
        assert r.prompt.startswith(reqs[0].prompt.split(IMAGE)[0][:12])
        assert len(WordTokenizer().encode(r.prompt.replace(IMAGE, " "))) == 3 + 6


class SpellingTokenizer(WordTokenizer):
    """Decodes id 13 as the image token's text, as a real tokenizer's pieces
    can spell ``<|image|>`` or ``<image>`` by chance."""

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        return "".join(IMAGE if i == 13 else f"w{i} " for i in ids)


def test_random_mm_one_image_token_per_image() -> None:
    spec = ds.TextSpec(num_prompts=30, input_len=20, output_len=2, prefix_len=8)
    images = ds.ImageSpec(sizes=((8, 8),), items_per_prompt=(0, 2), pool=2)
    spelled = [SpellingTokenizer().decode(list(range(10, 110)))]
    assert spelled[0].count(IMAGE) == 1  # the tokenizer does spell it
    for r in ds.random_mm(spec, images, SpellingTokenizer(), VOCAB, IMAGE):
        assert r.prompt is not None and r.prompt.count(IMAGE) == len(r.images)


def test_random_mm_without_pool_every_image_is_new() -> None:
    reqs = _mm(pool=0, items=(2, 2))
    keys = [k for r in reqs for k in r.image_keys]
    assert len(keys) == 24 and len(set(keys)) == 24
    pixels = {np.asarray(im).tobytes() for r in reqs for im in r.images}
    assert len(pixels) == 24


def test_random_mm_pool_repeats_images() -> None:
    reqs = _mm(pool=3, items=(2, 2))
    keys = [k for r in reqs for k in r.image_keys]
    assert set(keys) <= {"pool-0", "pool-1", "pool-2"} and len(set(keys)) == 3
    for r in reqs:  # distinct within a prompt while the pool allows
        assert len(set(r.image_keys)) == 2
    # The same key is the same picture, everywhere.
    by_key: dict[str, bytes] = {}
    for r in reqs:
        for key, im in zip(r.image_keys, r.images, strict=True):
            data = np.asarray(im).tobytes()
            assert by_key.setdefault(key, data) == data
    assert len(set(by_key.values())) == 3
    # More items than the pool: repeats within the prompt.
    crowded = _mm(pool=1, items=(2, 2))
    assert all(r.image_keys == ["pool-0", "pool-0"] for r in crowded)


def test_synthetic_image_seeded() -> None:
    a = ds.synthetic_image((17, 9), 5)
    assert a.size == (17, 9)
    assert np.array_equal(np.asarray(a), np.asarray(ds.synthetic_image((17, 9), 5)))
    assert not np.array_equal(np.asarray(a), np.asarray(ds.synthetic_image((17, 9), 6)))


def test_sharegpt4v_file(tmp_path: Path) -> None:
    """vLLM's ShareGPTDataset draws the entries (its rules: two turns, prompts and
    answers of at least 4 tokens); the local images and the image token are ours."""
    from vllm_hpu_mm.bench.sharegpt import sharegpt4v

    ds.synthetic_image((20, 10), 1).save(tmp_path / "a.png")
    entries = [
        {
            "id": "1",
            "image": "a.png",
            "conversations": [
                {"from": "human", "value": "<image>\nw1 w2 w3 w4 ?"},
                {"from": "gpt", "value": "w1 w2 w3 w4 w5"},
            ],
        },
        {  # its image is missing: skipped
            "id": "2",
            "image": "missing.png",
            "conversations": [
                {"from": "human", "value": "<image>\nw1 w2 w3 w4"},
                {"from": "gpt", "value": "w1 w2 w3 w4"},
            ],
        },
        {
            "id": "3",
            "conversations": [
                {"from": "human", "value": "Text w1 w2 w3 w4 only"},
                {"from": "gpt", "value": "w5 w6 w7 w8"},
            ],
        },
        {  # an answer of 1 token: vLLM leaves it out
            "id": "4",
            "conversations": [
                {"from": "human", "value": "w1 w2 w3 w4"},
                {"from": "gpt", "value": "w5"},
            ],
        },
    ]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(entries))
    reqs = sharegpt4v(path, 4, WordTokenizer(), "<IMG>", seed=0)
    assert len(reqs) == 4  # two usable entries, drawn again up to 4
    assert all(r.output_len >= 4 for r in reqs)  # entry 4 left out, as vLLM does
    with_image = [r for r in reqs if r.images]
    text_only = [r for r in reqs if not r.images]
    assert with_image and text_only
    assert with_image[0].prompt == "<IMG>\nw1 w2 w3 w4 ?"
    assert with_image[0].images[0].size == (20, 10)
    assert with_image[0].output_len == 5 and text_only[0].output_len == 4
    fixed = sharegpt4v(path, 2, WordTokenizer(), "<IMG>", output_len=9)
    assert all(r.output_len == 9 for r in fixed)
    only_images = tmp_path / "images.json"
    only_images.write_text(json.dumps(entries[:2]))
    with pytest.raises(ValueError, match="no usable entries"):
        sharegpt4v(only_images, 2, WordTokenizer(), "<IMG>", image_root=tmp_path / "x")


# --- statistics ---------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(size=37).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert math.isclose(percentile(values, q), float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([], 50)
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s == {
        "mean": 3.0,
        "p50": 3.0,
        "p90": 4.6,
        "p99": pytest.approx(4.96),
        "max": 5.0,
    }
    assert summarize([]) == dict.fromkeys(("mean", "p50", "p90", "p99", "max"))


def _records() -> list[RequestRecord]:
    # 4 requests: 10 prompt tokens (4 of them image placeholders) and 5 output each.
    return [
        RequestRecord(
            prompt_tokens=10,
            image_tokens=4,
            output_tokens=5,
            ttft_s=0.1 * (i + 1),
            tpot_s=0.01 * (i + 1),
            e2e_s=0.1 * (i + 1) + 0.04 * (i + 1),
            cached_tokens=2,
        )
        for i in range(4)
    ]


def test_tokens_per_second_from_known_timings() -> None:
    r = backend_result(HF, _records(), elapsed_s=2.0)
    assert r["num_requests"] == 4 and r["requests_per_s"] == 2.0
    assert r["tokens"] == {
        "prompt_text": 24,
        "prompt_image": 16,
        "output": 20,
        "total": 60,
        "prompt_cached": 8,
    }
    assert r["tokens_per_s"] == {"total": 30.0, "output": 10.0, "text": 22.0}
    assert r["ttft_s"]["p50"] == pytest.approx(0.25)
    assert r["tpot_s"]["max"] == pytest.approx(0.04)
    with pytest.raises(ValueError):
        backend_result(HF, _records(), elapsed_s=0.0)


def _vllm_extra() -> dict[str, Any]:
    return {
        "startup_s": 3.0,
        "warmup_s": 1.5,
        "graphs_compiled": {"warmup": 6, "after_warmup": 0},
        "padding": {
            "scheduled_tokens": 60,
            "padded_tokens": 20,
            "waste_pct": 25.0,
            "fallback_steps": 0,
            "by_bucket": {"32": {"scheduled_tokens": 28, "padded_tokens": 4}},
        },
        "encoder": {
            "runs": 2,
            "mm_items": 4,
            "distinct_items": 3,
            "runs_per_item": 0.5,
            "vision_patches": 96,
            "vision_padding_patches": 32,
            "vision_padding_pct": 25.0,
        },
        "prefix_cache": {"enabled": True, "queries": 40, "hits": 8, "hit_rate": 0.2},
        "peak_memory": {"device_bytes": 0, "host_rss_bytes": 2**30},
    }


def _report() -> dict[str, Any]:
    ours = backend_result(VLLM, _records(), 1.0, _vllm_extra())
    theirs = backend_result(
        HF, _records(), 4.0, {"peak_memory": {"device_bytes": 0, "host_rss_bytes": 1}}
    )
    return build_report({"model": "m", "num_prompts": 4}, [ours, theirs])


def test_report_schema_and_ratio() -> None:
    report = json.loads(json.dumps(_report()))  # what --output-json writes
    assert check_report(report) == []
    assert report["schema"] == SCHEMA
    assert report["ratio_vllm_hpu_mm_over_hf"] == {
        "requests_per_s": 4.0,
        "total_tokens_per_s": 4.0,
        "output_tokens_per_s": 4.0,
    }
    text = format_report(report)
    assert "4.00x" in text and "Padding waste: 25.0 %" in text
    assert "hit rate 20.0 %" in text
    assert "Encoder: 2 runs for 4 items, 3 distinct (0.50 per item)" in text


def test_report_schema_catches_problems() -> None:
    report = _report()
    del report["results"][VLLM]["padding"]["waste_pct"]
    report["results"][HF]["tokens"]["output"] = "20"
    report["results"][HF]["requests_per_s"] = True
    problems = check_report(report)
    assert "results.vllm-hpu-mm.padding.waste_pct: missing" in problems
    assert any(p.startswith("results.hf.tokens.output: str") for p in problems)
    assert any(p.startswith("results.hf.requests_per_s: a boolean") for p in problems)
    single = build_report({}, [backend_result(HF, _records(), 1.0, {})])
    assert "results.hf.peak_memory: missing" in check_report(single)
    assert "ratio_vllm_hpu_mm_over_hf" not in single
    assert check_report({"schema": "x", "config": {}, "results": {}}) == [
        f"schema is 'x', expected {SCHEMA!r}",
        "results: no backend ran",
    ]


def test_report_json_schema_names_every_key_the_builder_writes() -> None:
    """The pydantic models are the report's schema: their JSON Schema lists
    exactly the keys ``backend_result`` and ``build_report`` write, so a key
    added to one and not the other shows here."""
    report = json.loads(json.dumps(_report()))
    schema = Report.model_json_schema(by_alias=True)
    assert set(schema["properties"]) == set(report)
    ours, theirs = report["results"][VLLM], report["results"][HF]
    assert set(VllmResult.model_json_schema()["properties"]) == set(ours)
    hf_only = {"peak_memory"}  # the hf backend's extra section the schema knows
    assert set(BackendResult.model_json_schema()["properties"]) == (
        set(backend_result(HF, _records(), 1.0)) | hf_only
    )
    assert set(theirs) >= hf_only
    ratio = schema["$defs"]["Ratio"]["properties"]
    assert set(ratio) == set(report["ratio_vllm_hpu_mm_over_hf"])


# --- plot ---------------------------------------------------------------------------


def test_plot_is_written(tmp_path: Path) -> None:
    from PIL import Image

    from vllm_hpu_mm.bench.plot import write_plot

    out = write_plot(_report(), tmp_path / "sub" / "bench.png")
    assert out.is_file()
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size[0] > 500
    # Without per-bucket counters and with HF only, it still draws.
    report = _report()
    report["results"][VLLM]["padding"]["by_bucket"] = {}
    write_plot(report, tmp_path / "b.png")
    del report["results"][VLLM]
    write_plot(report, tmp_path / "c.png")
    assert (tmp_path / "b.png").stat().st_size > 0
    assert (tmp_path / "c.png").stat().st_size > 0


# --- command line -------------------------------------------------------------------


def test_dispatcher_routes_bench_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_hpu_mm.bench import cli as bench_cli
    from vllm_hpu_mm.cli import main as cli

    seen: list[list[str]] = []
    monkeypatch.setattr(bench_cli, "main", lambda argv: seen.append(argv) or 0)
    argv = ["bench", "throughput", "--model", "m", "--max-num-seqs", "4", "-h"]
    assert cli.main(argv) == 0
    assert seen == [["--model", "m", "--max-num-seqs", "4", "-h"]]
    # Other commands still refuse arguments they do not know.
    with pytest.raises(SystemExit):
        cli.main(["buckets", "show", "--model", "m"])


def test_full_parser_takes_engine_args() -> None:
    from vllm_hpu_mm.bench.cli import build_parser

    args = build_parser().parse_args(
        [
            "--model",
            "m",
            "--dataset-name",
            "random-mm",
            "--mm-items-per-prompt",
            "1-3",
            "--mm-image-sizes",
            "64x32",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "4",
            "--backend",
            "both",
        ]
    )
    assert args.mm_items_per_prompt == (1, 3)
    assert args.mm_image_sizes == ((64, 32),)
    assert args.enable_prefix_caching is False and args.max_num_seqs == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--mm-image-sizes", "64"])


# --- encoder figures ----------------------------------------------------------------


def _snapshot(
    runs: int, items: int, patches: int = 0, padding: int = 0
) -> dict[str, Any]:
    return {
        "encoder_runs": runs,
        "mm_items": items,
        "vision_patches": patches,
        "vision_padding": padding,
    }


def test_encoder_items_are_the_requests_images() -> None:
    """Items are counted from the timed requests, also for a runner that does
    not count them (Mllama's cross-attention runner leaves the counter)."""
    from vllm_hpu_mm.bench.vllm_backend import _encoder

    def req(*keys: str) -> ds.BenchRequest:
        return ds.BenchRequest(
            output_len=1,
            prompt="x",
            images=[object()] * len(keys),
            image_keys=list(keys),
        )

    reqs = [req("a"), req("a", "b"), req(), req("b", "a")]
    enc = _encoder(_snapshot(5, 7), _snapshot(7, 7), reqs)
    assert enc == {
        "runs": 2,
        "mm_items": 5,
        "distinct_items": 2,
        "runs_per_item": 0.4,
        "items_counter": 0,
        "vision_patches": 0,
        "vision_padding_patches": 0,
        "vision_padding_pct": None,
    }
    text_only = _encoder(_snapshot(0, 0), _snapshot(0, 0), [req(), req()])
    assert text_only["mm_items"] == 0 and text_only["runs_per_item"] is None
    # A patch-bucketed vision tower (Qwen): padding share of the patches run.
    qwen = _encoder(_snapshot(0, 0, 100, 10), _snapshot(2, 2, 160, 30), [req("a", "b")])
    assert (qwen["vision_patches"], qwen["vision_padding_patches"]) == (60, 20)
    assert qwen["vision_padding_pct"] == 25.0
