"""A Llama-3.2-Vision checkpoint as transformers writes it serves with ``vllm serve``.

The tiny Mllama saved by transformers' own ``save_pretrained`` in shards (several
``model-0000N-of-0000M.safetensors`` and ``model.safetensors.index.json``, as the
published Llama-3.2-11B-Vision checkpoints come), in the published layout
(``language_model.model.*``, ``language_model.lm_head.*``, ``vision_model.*``,
``multi_modal_projector.*``). One server; a chat request with an image answers
with HF transformers' greedy tokens for the same prompt ids and image.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_serve import Server, serve
from tests.mllama_reference import hf_mllama_greedy, mllama_chat
from tests.mm_reference import make_image
from tools import build_tiny_models as btm

pytestmark = pytest.mark.e2e

MAX_NEW = 10
PUBLISHED_PREFIXES = (
    "language_model.model.",
    "language_model.lm_head.",
    "vision_model.",
    "multi_modal_projector.",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("published") / "tiny-mllama-sharded"
    btm.save_tiny_model(btm.model_specs()["tiny-mllama"], out, max_shard_size="300KB")
    return str(out)


@pytest.fixture(scope="module")
def server(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve_published") / "server.log"
    yield from serve(model_dir, log_path, "--limit-mm-per-prompt", '{"image": 1}')


def test_checkpoint_is_sharded_in_the_published_layout(model_dir: str) -> None:
    index = json.loads((Path(model_dir) / btm.INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 1
    assert all(name.startswith(PUBLISHED_PREFIXES) for name in index)
    assert all(any(n.startswith(p) for n in index) for p in PUBLISHED_PREFIXES)


def test_chat_with_an_image_matches_hf(server: Server, model_dir: str) -> None:
    image = make_image("stripes", (80, 40), 1)
    response = mllama_chat(server, [image], "What is in this picture?", MAX_NEW)
    assert response.status_code == 200, response.text
    data = response.json()
    got = data["choices"][0]["token_ids"]
    assert len(got) == MAX_NEW
    assert (
        hf_mllama_greedy(model_dir, data["prompt_token_ids"], [image], MAX_NEW) == got
    )
