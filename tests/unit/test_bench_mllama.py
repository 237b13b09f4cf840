"""``vllm-hpu-mm bench throughput`` on the tiny Mllama without an engine: the
prompts the datasets build (one ``<|image|>`` token per image, one BOS, as
vLLM tokenizes them) and the HF backend's batched, left-padded inputs, whose
greedy tokens must equal the oracle's (``tests/mllama_reference.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.mllama_reference import IMAGE_TOKEN, hf_mllama_greedy
from vllm_hpu_mm.bench import datasets as ds


@pytest.fixture(scope="module")
def tokenizer(tiny_mllama_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mllama_dir)


def _requests(model: str, *flags: str) -> list[ds.BenchRequest]:
    from vllm_hpu_mm.bench.cli import build_parser, make_requests

    return make_requests(build_parser().parse_args(["--model", model, *flags]))


def _check_prompt(tokenizer: Any, req: ds.BenchRequest) -> list[int]:
    """The prompt as vLLM tokenizes it: one BOS, one image token per image."""
    ids = list(tokenizer(req.prompt)["input_ids"])
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert ids.count(image_id) == len(req.images)
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    return ids


def test_image_token_is_the_model_classes_placeholder(tiny_mllama_dir: str) -> None:
    from vllm_hpu_mm.bench.cli import _image_token
    from vllm_hpu_mm.models.mllama.model import MllamaForConditionalGeneration

    token = _image_token(tiny_mllama_dir)
    assert token == IMAGE_TOKEN
    assert token == MllamaForConditionalGeneration.get_placeholder_str("image", 1)


def test_random_mm_prompts(tiny_mllama_dir: str, tokenizer: Any) -> None:
    reqs = _requests(
        tiny_mllama_dir,
        "--dataset-name", "random-mm", "--num-prompts", "40",
        "--input-len", "24", "--prefix-len", "16", "--output-len", "3",
        "--mm-items-per-prompt", "0-2", "--mm-image-sizes", "40x24,24x40",
        "--mm-image-pool", "3",
    )  # fmt: skip
    assert {len(r.images) for r in reqs} == {0, 1, 2}
    prefixes = set()
    for r in reqs:
        ids = _check_prompt(tokenizer, r)
        prefixes.add(tuple(ids[:8]))
        assert r.output_len == 3
    assert len(prefixes) == 1  # the shared prefix comes first


def test_sharegpt4v_prompts(
    tiny_mllama_dir: str, tokenizer: Any, tmp_path: Path
) -> None:
    ds.synthetic_image((48, 32), 1).save(tmp_path / "a.png")
    entries = [
        {
            "image": "a.png",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is in the picture?"},
                {"from": "gpt", "value": "A gradient of colours with some noise."},
            ],
        },
        {
            "conversations": [
                {"from": "human", "value": "Only text, and no picture at all."},
                {"from": "gpt", "value": "Then there is nothing to describe."},
            ]
        },
    ]
    (tmp_path / "data.json").write_text(json.dumps(entries))
    reqs = _requests(
        tiny_mllama_dir,
        "--dataset-name", "sharegpt4v", "--dataset-path", str(tmp_path / "data.json"),
        "--num-prompts", "4",
    )  # fmt: skip
    assert len(reqs) == 4  # vLLM's ShareGPTDataset draws the two again at random
    assert {len(r.images) for r in reqs} == {0, 1}
    for r in reqs:
        _check_prompt(tokenizer, r)
    assert any(r.prompt == IMAGE_TOKEN + "\nWhat is in the picture?" for r in reqs)


def test_hf_batches_match_the_oracle(tiny_mllama_dir: str, tokenizer: Any) -> None:
    """Batched and left padded (prompts of different lengths, images with
    different tile counts, two images per prompt, text only), the HF backend's
    greedy tokens are those of transformers on each prompt alone, and its
    prompt ids are vLLM's (the tokenizer's, one BOS)."""
    from vllm_hpu_mm.bench.hf_backend import HfRunner, batches

    a, b = ds.synthetic_image((40, 24), 1), ds.synthetic_image((24, 40), 2)

    def req(prompt: str, *images: Any) -> ds.BenchRequest:
        keys = [str(id(im)) for im in images]
        return ds.BenchRequest(
            output_len=5, prompt=prompt, images=list(images), image_keys=keys
        )

    reqs = [
        req("<|image|>What is it?", a),
        req("A longer text before <|image|> the image, and more words after", b),
        req("<|image|><|image|>Two", a, b),
        req("One <|image|> then some words <|image|> end", b, a),
        req("No image here, only words"),
        req("Short"),
    ]
    runner = HfRunner(tiny_mllama_dir, "float32")
    groups = batches(reqs, 4)
    assert all(len(g) == 2 for g in groups)  # every batch pads one row
    for group in groups:
        batch = [reqs[i] for i in group]
        inputs = runner.inputs(batch)
        _, tokens = runner.generate(inputs, 5)
        for row, r in enumerate(batch):
            ids = _check_prompt(tokenizer, r)
            mask = inputs["attention_mask"][row].bool()
            assert inputs["input_ids"][row][mask].tolist() == ids
            want = hf_mllama_greedy(tiny_mllama_dir, ids, r.images, 5)
            assert tokens[row] == want, (r.prompt, tokens[row], want)
