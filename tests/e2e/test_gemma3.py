"""Offline ``vllm.LLM`` on the plugin with Gemma 3 (vLLM's in-tree
``Gemma3ForConditionalGeneration``) on ``execution: static`` (Gaudi's path:
attention traced into one static graph per bucketed step shape, tiled prefill,
flat paged decode, two-pass mixed steps, an encoder graph per images bucket):
greedy parity with HF transformers, whose Gemma 3 lets the soft tokens of one
image attend to each other both ways (issue 27 item 3).

The model is ``models/tiny-gemma3`` (``tools.build_tiny_models``):
SigLIP tower pooled to 16 soft tokens per image, four text layers alternating a
12-token sliding window (shorter than an image) and global attention. Each
``<start_of_image>`` of the prompt becomes ``\\n\\n<start_of_image>`` + 16
``<image_soft_token>`` + ``<end_of_image>\\n\\n``; HF marks the soft tokens with
``token_type_ids`` and masks global layers with ``causal OR same image`` and
sliding layers with ``window AND (causal OR same image)``.

One engine for the module, in graph mode over explicit buckets, with a 24-token
step budget: prompts are chunked over several steps, shared with other
requests' chunks and decodes. An image whose placeholders would straddle a step
boundary is scheduled whole in the next step (``disable_chunked_mm_input``, set
by the platform as vLLM's CUDA platform does): a token cannot attend to keys a
later step computes. A prefix-cache hit may still end inside an image; the rest
of the image then sees the cached part. A bidirectional-image model's prefill
steps carry the rows' image spans (``prefill_tile_span_lo/hi``) and its tiles
widen to the end of their images; warmup prepares the steps with (empty) spans,
so a step with images must find its graph: the last test checks that no case of
the module compiled anything while serving. Both sides get the same prompt
text; vLLM must report HF's prompt ids. Greedy, ``ignore_eos``, 10 new tokens,
float32. Gemma 3 on the dynamic path (the CPU's default) is served by
``test_gemma3_serve.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.graph_config import image_engine_in_graph_mode
from tests.mm_reference import (
    check_vlm_parity,
    engine_lifetime,
    hf_vlm_greedy,
    load_hf_processor,
    load_hf_vlm,
    make_image,
)
from tools import tiny_model_specs as specs
from vllm_hpu_mm.metrics_reader import read_metric

pytestmark = pytest.mark.e2e

MAX_NEW = 10
# Tokens per step: more than one image's 20 placeholder ids, fewer than two.
# Consecutive images share their "\n\n\n\n" token, so the first is still live
# in the encoder cache when the second is scheduled; with vLLM's cache of one
# budget the second would never be admitted (the platform doubles the cache).
BUDGET = 24
MAX_NUM_SEQS = 4
BOI = specs.GEMMA3_BOI_TOKEN
SOFT = specs.GEMMA3_NUM_IMAGE_TOKENS
# "\n\n<start_of_image>" + 16 soft tokens + "<end_of_image>\n\n"
PLACEHOLDER_IDS = SOFT + 4


def image(name: str) -> Any:
    kind, size, variant = {
        "gradient": ("gradient", (40, 24), 0),
        "checker": ("checkerboard", (24, 40), 1),
        "stripes": ("stripes", (64, 48), 2),
        "solid": ("solid", (32, 32), 3),
    }[name]
    return make_image(kind, size, variant)


@dataclass
class Case:
    prompt: str
    images: list[Any] = field(default_factory=list)
    # False for a chat-template rendering, which writes BOS itself.
    add_special_tokens: bool = True

    def vllm_input(self) -> dict[str, Any]:
        if not self.images:
            return {"prompt": self.prompt}
        return {"prompt": self.prompt, "multi_modal_data": {"image": self.images}}


def case(question: str, *names: str, preamble: str = "") -> Case:
    """``USER: <preamble><start_of_image>...question ASSISTANT:``."""
    images = BOI * len(names)
    return Case(
        f"USER: {preamble}{images}{question} ASSISTANT:", [image(n) for n in names]
    )


# --- HF reference ---------------------------------------------------------------


def hf_model(model_dir: str) -> Any:
    return load_hf_vlm(model_dir)


def hf_processor(model_dir: str) -> Any:
    return load_hf_processor(model_dir)


def hf_inputs(model_dir: str, c: Case) -> Any:
    assert c.prompt.count(BOI) == len(c.images)
    return hf_processor(model_dir)(
        text=c.prompt,
        images=list(c.images) or None,
        add_special_tokens=c.add_special_tokens,
        return_tensors="pt",
    )


def hf_prompt_ids(model_dir: str, c: Case) -> list[int]:
    return hf_inputs(model_dir, c)["input_ids"][0].tolist()


def hf_greedy(model_dir: str, c: Case, bidirectional: bool = True) -> list[int]:
    """HF's greedy ids; ``bidirectional=False`` drops ``token_type_ids`` (plain
    causal attention over the images: what a causal-only kernel would match)."""
    inputs = dict(hf_inputs(model_dir, c))
    if not bidirectional:
        inputs.pop("token_type_ids", None)
    return hf_vlm_greedy(hf_model(model_dir), inputs, MAX_NEW)


def soft_token_runs(ids: Sequence[int], soft_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image soft tokens."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != soft_id:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


# --- engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> str:
    from tests.conftest import _tiny_model_dir

    return _tiny_model_dir("tiny-gemma3")


@pytest.fixture(scope="module")
def soft_id(model_dir: str) -> int:
    return int(hf_processor(model_dir).tokenizer.image_token_id)


@pytest.fixture(scope="module")
def llm(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = image_engine_in_graph_mode(
        model_dir,
        tmp_path_factory,
        "static_gemma3",
        f"prefill_tokens: [8, {BUDGET}]\ndecode_batch: [1, {MAX_NUM_SEQS}]\n"
        "blocks: [4, 16]\n",
        BUDGET,
        execution="static",
    )
    yield from engine_lifetime(engine)


def check_parity(llm: Any, model_dir: str, cases: Sequence[Case]) -> list[Any]:
    """Generate ``cases`` as one batch: prompt ids and greedy ids equal HF's."""
    return check_vlm_parity(
        llm,
        cases,
        lambda c: hf_prompt_ids(model_dir, c),
        lambda c: hf_greedy(model_dir, c),
        MAX_NEW,
    )


# --- tests ----------------------------------------------------------------------


def test_images_are_scheduled_whole_on_the_static_plan(llm: Any) -> None:
    from vllm.platforms import current_platform

    assert type(current_platform).__module__.startswith("vllm_hpu_mm.")
    config = llm.llm_engine.vllm_config
    assert config.model_config.is_mm_prefix_lm
    assert config.scheduler_config.disable_chunked_mm_input
    assert config.additional_config["hpu_mm"]["execution"] == "static"
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0


def test_text_only(llm: Any, model_dir: str, soft_id: int) -> None:
    c = case("What is the capital of France?")
    assert soft_token_runs(hf_prompt_ids(model_dir, c), soft_id) == []
    check_parity(llm, model_dir, [c])


def test_one_image_across_a_step_boundary(
    llm: Any, model_dir: str, soft_id: int
) -> None:
    """The image's placeholders would straddle the first 24-token step: it is
    computed whole in the second; bidirectional attention changes the output
    (HF with causal image attention gives other tokens)."""
    c = case("Describe the picture.", "gradient", preamble="Look at this: ")
    ids = hf_prompt_ids(model_dir, c)
    ((start, end),) = soft_token_runs(ids, soft_id)
    assert end - start == SOFT
    assert start < BUDGET < end, (start, end)
    (out,) = check_parity(llm, model_dir, [c])
    assert list(out.outputs[0].token_ids) != hf_greedy(
        model_dir, c, bidirectional=False
    ), "this case does not tell bidirectional from causal image attention"


def test_two_images(llm: Any, model_dir: str, soft_id: int) -> None:
    """Two consecutive images, 40 placeholder ids at a 24-token budget: each is
    scheduled whole in its own step (this hung with a one-budget encoder cache)."""
    c = case("What differs between them?", "checker", "stripes")
    runs = soft_token_runs(hf_prompt_ids(model_dir, c), soft_id)
    assert [e - s for s, e in runs] == [SOFT, SOFT], runs
    check_parity(llm, model_dir, [c])


def test_batch_of_mixed_prompts(llm: Any, model_dir: str) -> None:
    """Text, one and two images, in one batch: chunks of several requests and
    decodes share steps."""
    cases = [
        case("What is in this image?", "solid"),
        case("Please answer in a single clear sentence."),
        case("Compare the two pictures.", "gradient", "checker"),
        case("What is in this image?", "stripes", preamble="Here: "),
    ]
    outputs = check_parity(llm, model_dir, cases)
    # Same question, different images: the image features reach the logits.
    assert outputs[0].outputs[0].token_ids != outputs[3].outputs[0].token_ids


def test_prefix_cache_hit_inside_an_image(
    llm: Any, model_dir: str, soft_id: int
) -> None:
    """A second prompt sharing text and image with a first one reuses the first's
    cached blocks up to a block boundary inside the image: the image's remaining
    tokens attend to the cached part and to each other."""
    preamble = "Please look at the next picture. "
    first = case("Describe it.", "checker", preamble=preamble)
    second = case("What colour is it?", "checker", preamble=preamble)
    ((start, end),) = soft_token_runs(hf_prompt_ids(model_dir, second), soft_id)
    check_parity(llm, model_dir, [first])
    (out,) = check_parity(llm, model_dir, [second])
    assert start < out.num_cached_tokens < end, (start, out.num_cached_tokens, end)


def test_nothing_compiled_while_serving(llm: Any) -> None:
    """Run last: every step of the cases above (text, images cut by the step
    budget, mixed batches, a prefix hit inside an image) found a warmed graph."""
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
    assert read_metric("vllm_hpu_mm:fallback_buckets_total") == 0
