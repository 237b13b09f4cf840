"""Offline ``vllm.LLM`` on the plugin with the tiny LLaVA: greedy parity with HF.

Images come from Pillow (``tests/mm_reference.py``); every image becomes 16
placeholder tokens. One engine per class (shut down before the next starts):

- ``TestChunkedImages``: a 24-token step budget, so an image's 16 placeholder
  rows are cut across two steps (and shared with other requests' chunks);
- ``TestTinyChunks``: an 8-token budget (the smallest vLLM accepts with
  ``max_num_seqs=8``: it requires ``max_num_batched_tokens >= max_num_seqs``), so
  one image is cut into three pieces; the encoder compute budget and cache size
  are still ``max(budget, 16)`` = 16, one image;
- ``TestDefaultBudget``: the default budget, whole prompts in one step and
  several images per encoder call.

Each class also reads the worker's ``vllm_hpu_mm:encoder_runs_total`` counter
(prometheus_client multiprocess files, as in ``test_graph_mode.py``): each
distinct image is encoded exactly once, however many chunks its placeholder
spans. Those checks use images no earlier request has seen (the engine's encoder
cache and prefix cache outlive a ``generate`` call), and prompts whose text
before the first image differs (no prefix-cache hit can skip a placeholder).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.mm_reference import (
    NUM_IMAGE_TOKENS,
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy,
    hf_llava_prompt_ids,
    image_offsets,
    llava_prompt,
    load_hf_llava,
    make_image,
    named_image,
    tiny_llava_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

MAX_NEW = 12
LIMIT_IMAGES = 2
# Items run through the encoder, and items received in requests.
ENCODER_RUNS = "vllm_hpu_mm:encoder_runs_total"
MM_ITEMS = "vllm_hpu_mm:mm_items_total"


@dataclass
class Case:
    """One prompt: its text and its images (in ``<image>`` order)."""

    prompt: str
    images: list[Any] = field(default_factory=list)

    def vllm_input(self) -> dict[str, Any]:
        if not self.images:
            return {"prompt": self.prompt}
        return {"prompt": self.prompt, "multi_modal_data": {"image": self.images}}


def _case(num_images: int, names: Sequence[str] = (), preamble: str = "") -> Case:
    """``llava_prompt(num_images)`` with the named test images."""
    assert len(names) == num_images
    return Case(
        llava_prompt(num_images, preamble=preamble), [named_image(n) for n in names]
    )


def _fresh(variant: int) -> Any:
    """An image used by one counter test only (variant numbers are unique)."""
    kinds = ("gradient", "checkerboard", "stripes", "solid")
    sizes = ((40, 24), (24, 40), (32, 32), (64, 48))
    return make_image(kinds[variant % 4], sizes[variant % 4], variant=10 + variant)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_llava_dir()


@pytest.fixture(scope="module")
def image_token_id(model_dir: str) -> int:
    return int(load_hf_llava(model_dir).config.image_token_index)


def _engine(model_dir: str, **kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        max_num_seqs=8,
        seed=0,
        limit_mm_per_prompt={"image": LIMIT_IMAGES},
        **kwargs,
    )
    yield from engine_lifetime(llm)


def _run(llm: Any, cases: Sequence[Case]) -> list[Any]:
    return greedy_generate(llm, [c.vllm_input() for c in cases], MAX_NEW)


def _check_parity(llm: Any, model_dir: str, cases: Sequence[Case]) -> list[Any]:
    """Generate ``cases`` as one batch; prompt ids and greedy ids equal HF's."""
    outputs = _run(llm, cases)
    problems = []
    for i, (case, out) in enumerate(zip(cases, outputs, strict=True)):
        want_prompt = hf_llava_prompt_ids(model_dir, case.prompt, case.images)
        if list(out.prompt_token_ids) != want_prompt:
            problems.append(
                f"case {i} ({len(case.images)} images): prompt ids differ\n"
                f"  vllm: {list(out.prompt_token_ids)}\n  hf:   {want_prompt}"
            )
            continue
        got = list(out.outputs[0].token_ids)
        want = hf_llava_greedy(model_dir, case.prompt, case.images, MAX_NEW)
        if got != want:
            same = [a == b for a, b in zip(got, want, strict=False)]
            first = same.index(False) if False in same else len(same)
            problems.append(
                f"case {i} ({len(case.images)} images, prompt len "
                f"{len(want_prompt)}): first difference at output token {first}\n"
                f"  vllm: {got}\n  hf:   {want}"
            )
    assert not problems, "vLLM greedy != HF greedy:\n" + "\n".join(problems)
    return outputs


def _cuts(offset: int, budget: int) -> int:
    """Pieces an image placeholder at ``offset`` falls into when a lone
    request's prefill is chunked every ``budget`` tokens."""
    first, last = offset // budget, (offset + NUM_IMAGE_TOKENS - 1) // budget
    return last - first + 1


def _encoded(llm: Any, cases: Sequence[Case], model_dir: str) -> tuple[float, float]:
    """Run ``cases`` with parity checked; the counters' increase meanwhile."""
    runs, items = _counter(ENCODER_RUNS), _counter(MM_ITEMS)
    _check_parity(llm, model_dir, cases)
    return _counter(ENCODER_RUNS) - runs, _counter(MM_ITEMS) - items


MIXED = [
    ("text", 0, (), ""),
    ("gradient", 1, ("gradient_40x24",), ""),
    ("two images", 2, ("checker_24x40", "stripes_64x48"), "Look at this. "),
    ("long text", 0, (), "Our team meets every Tuesday to review progress. " * 3),
    ("solid", 1, ("solid_32x32",), "Here is a photo I took on holiday: "),
    ("stripes", 1, ("stripes_64x48",), "Look at this. "),
]


def _mixed_cases() -> list[Case]:
    return [_case(n, names, pre) for _, n, names, pre in MIXED]


def test_platform_is_plugin() -> None:
    from vllm.platforms import current_platform

    assert type(current_platform).__module__.startswith("vllm_hpu_mm.")


class TestChunkedImages:
    """24-token budget: placeholders cut across steps and mixed with decodes."""

    BUDGET = 24

    @pytest.fixture(scope="class")
    def llm(self, model_dir: str) -> Iterator[Any]:
        yield from _engine(
            model_dir,
            enable_chunked_prefill=True,
            max_num_batched_tokens=self.BUDGET,
        )

    @pytest.mark.parametrize("num_images", [0, 1, 2])
    def test_single_prompt(self, llm: Any, model_dir: str, num_images: int) -> None:
        names = ("gradient_40x24", "checker_24x40")[:num_images]
        _check_parity(llm, model_dir, [_case(num_images, names)])

    def test_image_cut_across_chunks(
        self, llm: Any, model_dir: str, image_token_id: int
    ) -> None:
        """Preambles that put a chunk boundary inside the first or second image."""
        cases = [
            _case(1, ("stripes_64x48",), "Look at this. "),
            _case(2, ("solid_32x32", "gradient_40x24"), "Here is a photo I took: "),
        ]
        for case in cases:
            ids = hf_llava_prompt_ids(model_dir, case.prompt, case.images)
            offsets = image_offsets(ids, image_token_id)
            assert max(_cuts(o, self.BUDGET) for o in offsets) >= 2, offsets
            _check_parity(llm, model_dir, [case])  # alone: the cut is as computed

    def test_mixed_batch(self, llm: Any, model_dir: str) -> None:
        """Text-only and image prompts, different images, in one batch."""
        _check_parity(llm, model_dir, _mixed_cases())

    def test_same_image_in_two_prompts(self, llm: Any, model_dir: str) -> None:
        image = named_image("checker_24x40")
        cases = [
            Case(llava_prompt(1, preamble="Look at this. "), [image]),
            Case(llava_prompt(1, "What colour is it?"), [image]),
        ]
        _check_parity(llm, model_dir, cases)

    def test_encoder_runs_once_per_item(
        self, llm: Any, model_dir: str, image_token_id: int
    ) -> None:
        """Fails when the encoder runs more than once per item under chunked
        prefill (a placeholder spanning two steps must be encoded once)."""
        case = Case(llava_prompt(1, preamble="Look at this. "), [_fresh(0)])
        ids = hf_llava_prompt_ids(model_dir, case.prompt, case.images)
        assert _cuts(image_offsets(ids, image_token_id)[0], self.BUDGET) == 2
        runs, items = _encoded(llm, [case], model_dir)
        assert runs == 1, f"{ENCODER_RUNS} rose by {runs} for one image"
        assert items == 1, f"{MM_ITEMS} rose by {items} for one image"

    def test_encoder_runs_two_images_one_prompt(self, llm: Any, model_dir: str) -> None:
        case = Case(
            llava_prompt(2, preamble="Here is a photo I took: "), [_fresh(1), _fresh(2)]
        )
        runs, items = _encoded(llm, [case], model_dir)
        assert runs == 2, f"{ENCODER_RUNS} rose by {runs} for two distinct images"
        assert items == 2, f"{MM_ITEMS} rose by {items} for two images"

    def test_encoder_runs_shared_image(self, llm: Any, model_dir: str) -> None:
        """One image in two prompts of a batch: encoded once, cached for both."""
        image = _fresh(3)
        cases = [
            Case(llava_prompt(1, preamble="Look at this. "), [image]),
            Case(llava_prompt(1, "What is it?", preamble="Now this one: "), [image]),
        ]
        runs, items = _encoded(llm, cases, model_dir)
        assert runs == 1, f"{ENCODER_RUNS} rose by {runs} for one image in 2 prompts"
        # Items received in requests: the shared image counts once per prompt.
        assert items == 2, f"{MM_ITEMS} rose by {items} for 2 prompts x 1 image"

    def test_encoder_cache_entries_freed_with_the_scheduler(
        self, llm: Any, model_dir: str
    ) -> None:
        """At this budget vLLM's encoder cache holds one image (24 embeddings):
        the runner must drop each output when the scheduler evicts it, or its
        own cache would keep growing."""
        for variant in (20, 21, 22):
            _encoded(llm, [Case(llava_prompt(1), [_fresh(variant)])], model_dir)
        assert _counter("vllm_hpu_mm:encoder_cache_items") <= 1


class TestTinyChunks:
    """8-token budget: one image's 16 rows cut into three pieces."""

    BUDGET = 8

    @pytest.fixture(scope="class")
    def llm(self, model_dir: str) -> Iterator[Any]:
        yield from _engine(
            model_dir,
            enable_chunked_prefill=True,
            max_num_batched_tokens=self.BUDGET,
        )

    def test_image_in_three_pieces(
        self, llm: Any, model_dir: str, image_token_id: int
    ) -> None:
        case = Case(llava_prompt(1), [_fresh(4)])
        ids = hf_llava_prompt_ids(model_dir, case.prompt, case.images)
        assert _cuts(image_offsets(ids, image_token_id)[0], self.BUDGET) == 3
        runs, _ = _encoded(llm, [case], model_dir)
        assert runs == 1, f"{ENCODER_RUNS} rose by {runs} for one image in 3 chunks"

    def test_mixed_batch(self, llm: Any, model_dir: str) -> None:
        _check_parity(llm, model_dir, _mixed_cases()[:4])


class TestDefaultBudget:
    """Default budget: whole prompts (and several images) in one step."""

    @pytest.fixture(scope="class")
    def llm(self, model_dir: str) -> Iterator[Any]:
        yield from _engine(model_dir)

    def test_mixed_batch(self, llm: Any, model_dir: str) -> None:
        _check_parity(llm, model_dir, _mixed_cases())

    def test_encoder_runs_distinct_images(self, llm: Any, model_dir: str) -> None:
        """Three distinct images over three prompts (one shared): encoded once
        each (one encoder call may take several; the counter counts items)."""
        a, b, c = _fresh(5), _fresh(6), _fresh(7)
        cases = [
            Case(llava_prompt(2, preamble="First: "), [a, b]),
            Case(llava_prompt(1, preamble="Second: "), [c]),
            Case(llava_prompt(1, preamble="Third: "), [a]),
        ]
        runs, items = _encoded(llm, cases, model_dir)
        assert runs == 3, f"{ENCODER_RUNS} rose by {runs} for 3 distinct images"
        assert items == 4, f"{MM_ITEMS} rose by {items} for 4 image items"
