"""Mllama under tensor parallelism on the CPU fallback: TP=2 over gloo, over a
local Ray cluster (``ray start`` with two ``HPU`` slots, as in ``test_ray_tp``).
Through vLLM's multiprocessing executor Mllama runs TP=2 on the simulated Gaudi
(``test_gaudi_sim_families``, bfloat16, graph mode).

The tiny Mllama has 4 query and 2 KV heads: each rank holds 2 query heads and one
KV head of every cross-attention layer (column-parallel q/k/v, row-parallel
o_proj), and its cross-attention cache holds only that KV head. The vision
encoder and the projector are replicated: every rank encodes every image.

- greedy outputs equal transformers' token for token (the oracle the TP=1 tests
  in ``test_mllama.py`` match), for 0, 1 and 2 images with prefill cut into
  chunks by a 16-token step budget;
- each worker is one rank of a gloo group of two with the cut layers and cache.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_ray_tp import ray_address  # noqa: F401  (a fixture)
from tests.mllama_reference import hf_mllama_greedy, tiny_mllama_dir
from tests.mm_reference import engine_lifetime, greedy_generate, make_image

pytestmark = pytest.mark.e2e

TP = 2
MAX_NEW = 8
BUDGET = 16
TEXT = "The quick brown fox jumps over the lazy dog near the river bank. "


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_mllama_dir()


@pytest.fixture(scope="module", params=["ray"])
def llm(request: pytest.FixtureRequest, model_dir: str) -> Iterator[Any]:
    import cloudpickle
    from vllm import LLM

    if request.param == "ray":
        request.getfixturevalue("ray_address")
    # collective_rpc ships this module's functions to the workers, by value.
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield from engine_lifetime(
            LLM(
                model=model_dir,
                dtype="float32",
                max_model_len=512,
                max_num_seqs=4,
                max_num_batched_tokens=BUDGET,
                limit_mm_per_prompt={"image": 2},
                enforce_eager=True,
                seed=0,
                tensor_parallel_size=TP,
                distributed_executor_backend=request.param,
            )
        )
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        mp.undo()


def _request(prompt: str, images: list[Any]) -> dict[str, Any]:
    if not images:
        return {"prompt": prompt}
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def test_greedy_matches_tp1_oracle(llm: Any, model_dir: str) -> None:
    cases = [
        ("Hello there, how are you today?", []),
        (
            TEXT + "Now look: <|image|> and describe it.",
            [make_image("stripes", (30, 64), 2)],
        ),
        (
            "First <|image|> then some words in between <|image|> compare them.",
            [
                make_image("gradient", (64, 64), 3),
                make_image("checkerboard", (96, 30), 4),
            ],
        ),
        (TEXT + "<|image|>", [make_image("solid", (32, 32), 5)]),
    ]
    outs = greedy_generate(llm, [_request(p, ims) for p, ims in cases], MAX_NEW)
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * BUDGET  # chunked
    for (prompt, images), out in zip(cases, outs, strict=True):
        expected = hf_mllama_greedy(
            model_dir, list(out.prompt_token_ids), images, MAX_NEW
        )
        assert list(out.outputs[0].token_ids) == expected, prompt


def _worker_facts(worker: Any) -> dict[str, Any]:
    """Runs inside each worker (collective_rpc)."""
    import torch.distributed as dist
    from vllm.distributed import get_tensor_model_parallel_rank

    model = worker.get_model()
    cross = model.cross_attention_layers()
    return {
        "tp_rank": get_tensor_model_parallel_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "heads": sorted({c.num_heads for c in cross}),
        "kv_heads": sorted({c.num_kv_heads for c in cross}),
        "k_proj_rows": sorted({c.k_proj.weight.shape[0] for c in cross}),
        "cache_shapes": sorted({tuple(t.shape) for c in cross for t in c.cache}),
        "vision_params": sum(p.numel() for p in model.vision.parameters()),
    }


def test_workers_hold_one_kv_head_each(llm: Any, model_dir: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    text, vision = cfg.text_config, cfg.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    facts = llm.collective_rpc(_worker_facts)
    assert sorted(f["tp_rank"] for f in facts) == list(range(TP))
    for f in facts:
        assert f["world_size"] == TP and f["backend"] == "gloo"
        assert f["heads"] == [text.num_attention_heads // TP]
        assert f["kv_heads"] == [text.num_key_value_heads // TP]
        assert f["k_proj_rows"] == [text.num_key_value_heads // TP * head_dim]
        (shape,) = f["cache_shapes"]  # K and V alike: [slots, rows, kv heads, head]
        padded = -(-((vision.image_size // vision.patch_size) ** 2 + 1) // 8) * 8
        assert shape[1:] == (vision.max_num_tiles * padded, 1, head_dim)
    # The vision encoder is replicated: whole on every rank.
    assert len({f["vision_params"] for f in facts}) == 1
