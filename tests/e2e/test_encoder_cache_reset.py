"""vLLM's cache resets reach the plugin's encoder cache and Mllama's image slots.

Through ``vllm.LLM`` (one engine per class, shut down before the next starts):

- ``LLM.llm_engine.reset_encoder_cache()`` (what vLLM calls after a weight
  update) resets the scheduler's encoder-cache records and, through the worker,
  the cached encoder outputs (LLaVA) and the idle image slots (Mllama): a repeated
  image is encoded again, and the tokens are still HF's.
- ``LLM.reset_mm_cache()`` clears the input-processing caches; the scheduler keeps
  its encoder-cache records, so LLaVA's cached outputs must stay (a repeated image
  is served from them without a crash), while Mllama's slots, which only the
  worker keeps, are dropped and the image is encoded again.

Encoder runs are counted by the worker's ``vllm_hpu_mm:encoder_runs_total``. Each
repeat has a different text before the image, so no prefix-cache hit can skip the
image's placeholder and the encoder cache is what decides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.mllama_reference import hf_mllama_greedy, tiny_mllama_dir
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy,
    llava_prompt,
    make_image,
    tiny_llava_dir,
)

pytestmark = pytest.mark.e2e

MAX_NEW = 6
ENCODER_RUNS = "vllm_hpu_mm:encoder_runs_total"


def _runs() -> float:
    from vllm_hpu_mm.metrics_reader import read_metric

    return read_metric(ENCODER_RUNS)


def _llm(model_dir: str) -> Any:
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        limit_mm_per_prompt={"image": 1},
    )


def _encoder_runs_of(generate: Callable[[], list[int]]) -> tuple[float, list[int]]:
    before = _runs()
    tokens = generate()
    return _runs() - before, tokens


class TestLlava:
    IMAGE = make_image("checkerboard", (40, 24), variant=71)

    @pytest.fixture(scope="class")
    def model_dir(self) -> str:
        return tiny_llava_dir()

    @pytest.fixture(scope="class")
    def llm(self, model_dir: str) -> Iterator[Any]:
        yield from engine_lifetime(_llm(model_dir))

    def _ask(self, llm: Any, model_dir: str, preamble: str) -> Callable[[], list[int]]:
        prompt = llava_prompt(1, preamble=preamble)

        def generate() -> list[int]:
            request = {"prompt": prompt, "multi_modal_data": {"image": [self.IMAGE]}}
            out = greedy_generate(llm, [request], MAX_NEW)[0]
            got = list(out.outputs[0].token_ids)
            assert got == hf_llava_greedy(model_dir, prompt, [self.IMAGE], MAX_NEW)
            return got

        return generate

    def test_reset_encoder_cache_encodes_a_repeated_image_again(
        self, llm: Any, model_dir: str
    ) -> None:
        first, _ = _encoder_runs_of(self._ask(llm, model_dir, "One. "))
        cached, _ = _encoder_runs_of(self._ask(llm, model_dir, "Two, again. "))
        llm.llm_engine.reset_encoder_cache()
        after_reset, _ = _encoder_runs_of(self._ask(llm, model_dir, "Three. "))
        assert (first, cached, after_reset) == (1, 0, 1)

    def test_reset_mm_cache_keeps_what_the_scheduler_still_reuses(
        self, llm: Any, model_dir: str
    ) -> None:
        _encoder_runs_of(self._ask(llm, model_dir, "Four. "))  # cached, whatever ran
        llm.reset_mm_cache()
        runs, _ = _encoder_runs_of(self._ask(llm, model_dir, "Five, once more. "))
        assert runs == 0  # served from the worker's cache, as the scheduler expects


class TestMllama:
    IMAGE = make_image("stripes", (64, 64), variant=72)

    @pytest.fixture(scope="class")
    def model_dir(self) -> str:
        return tiny_mllama_dir()

    @pytest.fixture(scope="class")
    def llm(self, model_dir: str) -> Iterator[Any]:
        yield from engine_lifetime(_llm(model_dir))

    def _ask(self, llm: Any, model_dir: str, text: str) -> Callable[[], list[int]]:
        def generate() -> list[int]:
            request = {
                "prompt": f"{text}<|image|>What is this?",
                "multi_modal_data": {"image": [self.IMAGE]},
            }
            out = greedy_generate(llm, [request], MAX_NEW)[0]
            got = list(out.outputs[0].token_ids)
            ids = list(out.prompt_token_ids)
            assert got == hf_mllama_greedy(model_dir, ids, [self.IMAGE], MAX_NEW)
            return got

        return generate

    @pytest.mark.parametrize("reset", ["reset_encoder_cache", "reset_mm_cache"])
    def test_reset_encodes_a_repeated_image_again(
        self, llm: Any, model_dir: str, reset: str
    ) -> None:
        _encoder_runs_of(self._ask(llm, model_dir, f"{reset} one. "))
        cached, _ = _encoder_runs_of(self._ask(llm, model_dir, f"{reset} two. "))
        if reset == "reset_mm_cache":
            llm.reset_mm_cache()
        else:
            llm.llm_engine.reset_encoder_cache()
        after_reset, _ = _encoder_runs_of(self._ask(llm, model_dir, f"{reset} 3. "))
        assert (cached, after_reset) == (0, 1)
