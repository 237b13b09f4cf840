"""Prefix caching with images (tiny LLaVA, CPU block size 16): greedy parity with
HF, prefix-cache hits on vLLM's metrics, and no needless encoder runs.

How vLLM 0.33 caches (the facts the expectations below are built from):

- prefix caching is on by default for generation models (``EngineArgs`` takes
  ``model_config.is_prefix_caching_supported``) and the plugin leaves it on; the
  engines here still pass ``enable_prefix_caching=True`` to say what is tested;
- only whole blocks are cached, keyed by the chain of their token ids *and* the
  hashes of the multimodal items whose placeholders they touch: the same text
  with another image shares only the blocks wholly before the image;
- a hit is the longest run of leading blocks equal to cached ones, and never
  covers the last prompt token (it is recomputed to get logits): a hit is
  ``16 * (common_prefix // 16)`` with ``common_prefix <= len(prompt) - 1``;
- an earlier request caches its prompt and every generated token but the last
  (which was sampled, never run through the model).

The engine's step budget (24 tokens) makes vLLM's encoder cache hold a single
image (24 embeddings), so one request with another image evicts an earlier
image's encoder output (``_evict_encoder_cache``). Without that, vLLM's encoder
cache alone would spare the second encoder run and the counters could not tell
whether the prefix cache did.

The prompt ``llava_prompt(1)`` is 49 tokens with its image at positions
[7, 23): blocks 0 and 1 hold the image, block 1 also the first 9 tokens of the
question. A second prompt with the same image and another question therefore
matches block 0 only: its cached prefix ends at position 16, inside the image,
and the runner must merge encoder rows 9..15 into the first step of a request
that starts at position 16 (``TestPrefixCache.test_cache_boundary_inside_image``).
"""

from __future__ import annotations

import os
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
    load_hf_processor,
    make_image,
    png_data_url,
    tiny_llava_dir,
)
from vllm_hpu_mm.metrics_reader import read_metric as _counter

pytestmark = pytest.mark.e2e

BLOCK = 16  # the plugin's KV block size on the CPU
BUDGET = 24  # tokens per step: chunked prefill, encoder cache of one image
MAX_NEW = 8
ENCODER_RUNS = "vllm_hpu_mm:encoder_runs_total"
MM_ITEMS = "vllm_hpu_mm:mm_items_total"
WARMUP_COMPILES = ("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"})
OTHER_QUESTION = "What colour is the top left corner of the picture?"


def _counter_or_zero(args: tuple[str, dict[str, str]]) -> float:
    """``_counter``, or 0 before any engine of the session registered the
    plugin (which sets PROMETHEUS_MULTIPROC_DIR)."""
    return _counter(*args) if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else 0.0


def _fresh(variant: int, kind: str = "gradient") -> Any:
    """An image no other test of the session uses (variants 100+ are unique).
    Gradients by default: no two of an image's encoder rows are alike, so a
    merge that takes the wrong rows changes the answer (a periodic image,
    stripes or a checkerboard, can hide it)."""
    sizes = ((40, 24), (24, 40), (32, 32), (64, 48))
    return make_image(kind, sizes[variant % 4], variant=100 + variant)


def _prefix_cache_counters(llm: Any) -> tuple[float, float]:
    """vLLM's ``vllm:prefix_cache_hits`` and ``vllm:prefix_cache_queries``
    (tokens), from ``LLM.get_metrics()``."""
    values = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for metric in llm.get_metrics():
        if metric.name in values:
            values[metric.name] += float(metric.value)
    return values["vllm:prefix_cache_hits"], values["vllm:prefix_cache_queries"]


def _expected_hit(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` vLLM serves from blocks holding ``cached`` (the
    token ids whose K/V an earlier request with the same items computed)."""
    common = 0
    for a, b in zip(cached, prompt[:-1], strict=False):
        if a != b:
            break
        common += 1
    return BLOCK * (common // BLOCK)


@dataclass
class Run:
    """One request's output and what it changed on the counters."""

    prompt_ids: list[int]
    token_ids: list[int]
    num_cached_tokens: int
    encoder_runs: float
    mm_items: float
    hits: float
    queries: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def computed_ids(self) -> list[int]:
        """Ids whose K/V this request left in cached blocks (all but the last
        generated token)."""
        return self.prompt_ids + self.token_ids[:-1]


def _measured(llm: Any, call: Any) -> Run:
    """Run ``call()`` (one request) and read the counters around it."""
    runs, items = _counter(ENCODER_RUNS), _counter(MM_ITEMS)
    hits, queries = _prefix_cache_counters(llm)
    (out,) = call()
    hits2, queries2 = _prefix_cache_counters(llm)
    return Run(
        prompt_ids=list(out.prompt_token_ids),
        token_ids=list(out.outputs[0].token_ids),
        num_cached_tokens=int(out.num_cached_tokens or 0),
        encoder_runs=_counter(ENCODER_RUNS) - runs,
        mm_items=_counter(MM_ITEMS) - items,
        hits=hits2 - hits,
        queries=queries2 - queries,
    )


def _generate(llm: Any, prompt: str, images: Sequence[Any]) -> Run:
    request: dict[str, Any] = {"prompt": prompt}
    if images:
        request["multi_modal_data"] = {"image": list(images)}
    return _measured(llm, lambda: greedy_generate(llm, [request], MAX_NEW))


def _check_hf(model_dir: str, run: Run, prompt: str, images: Sequence[Any]) -> None:
    assert run.prompt_ids == hf_llava_prompt_ids(model_dir, prompt, images)
    want = hf_llava_greedy(model_dir, prompt, images, MAX_NEW)
    assert run.token_ids == want, f"vLLM {run.token_ids} != HF {want}"


def _image_span(model_dir: str, run: Run) -> tuple[int, int]:
    token = int(load_hf_llava(model_dir).config.image_token_index)
    (offset,) = image_offsets(run.prompt_ids, token)
    return offset, offset + NUM_IMAGE_TOKENS


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_llava_dir()


def _engine(model_dir: str, **kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        limit_mm_per_prompt={"image": 1},
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=BUDGET,
        disable_log_stats=False,  # else LLM.get_metrics() has no vllm: stats
        **kwargs,
    )
    yield from engine_lifetime(llm)


class TestPrefixCache:
    """Eager engine; every test uses its own images."""

    @pytest.fixture(scope="class")
    def llm(self, model_dir: str) -> Iterator[Any]:
        yield from _engine(model_dir, enforce_eager=True)

    @staticmethod
    def _evict_encoder_cache(llm: Any, variant: int) -> None:
        """Encode another image: vLLM's one-image encoder cache evicts the
        earlier one and the runner drops it when the scheduler says so."""
        run = _generate(
            llm, llava_prompt(1, "Say a word.", "Unrelated: "), [_fresh(variant)]
        )
        assert run.encoder_runs == 1, run
        assert _counter("vllm_hpu_mm:encoder_cache_items") <= 1

    def test_prefix_caching_is_on(self, llm: Any) -> None:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching

    def test_identical_request_hits_and_encodes_nothing(
        self, llm: Any, model_dir: str
    ) -> None:
        prompt, images = llava_prompt(1), [_fresh(0)]
        cold = _generate(llm, prompt, images)
        _check_hf(model_dir, cold, prompt, images)
        assert (cold.encoder_runs, cold.mm_items, cold.num_cached_tokens) == (1, 1, 0)
        self._evict_encoder_cache(llm, 1)

        warm = _generate(llm, prompt, images)
        start, end = _image_span(model_dir, warm)
        hit = _expected_hit(cold.computed_ids, warm.prompt_ids)
        assert hit == BLOCK * ((len(warm.prompt_ids) - 1) // BLOCK) >= end > start
        assert warm.num_cached_tokens == hit
        assert (warm.hits, warm.queries) == (hit, len(warm.prompt_ids))
        # The image lies wholly in cached blocks: not encoded again, although
        # vLLM's encoder cache no longer holds it.
        assert warm.encoder_runs == 0, warm
        assert warm.mm_items == 1
        assert warm.token_ids == cold.token_ids

    @pytest.mark.parametrize("preamble", ["", "Look at this. "])
    def test_same_text_other_image_no_false_hit(
        self, llm: Any, model_dir: str, preamble: str
    ) -> None:
        """Same prompt text, another image: only blocks wholly before the
        image are shared (none without a preamble: block 0 holds image
        tokens; one with it: the image starts at position 16)."""
        prompt = llava_prompt(1, preamble=preamble)
        variant = 10 if preamble else 20
        first = _generate(llm, prompt, [_fresh(variant)])
        second = _generate(llm, prompt, [_fresh(variant + 1)])
        assert second.prompt_ids == first.prompt_ids  # identical placeholder ids
        start, _ = _image_span(model_dir, second)
        assert second.num_cached_tokens == BLOCK * (start // BLOCK)
        assert second.hits == BLOCK * (start // BLOCK)
        assert second.encoder_runs == 1
        _check_hf(model_dir, second, prompt, [_fresh(variant + 1)])
        # Else a false hit (the first image's blocks) could go unnoticed.
        assert second.token_ids != first.token_ids, "pick images that answer apart"

    @pytest.mark.parametrize(
        "evicted", [True, False], ids=["evicted", "encoder-cached"]
    )
    def test_cache_boundary_inside_image(
        self, llm: Any, model_dir: str, evicted: bool
    ) -> None:
        """The second request's cached prefix ends inside its image: the image
        is encoded once (again, when vLLM's encoder cache evicted it; not at
        all when it still holds it) and only its uncached rows are merged."""
        variant = 30 if evicted else 40
        image = _fresh(variant)
        first = _generate(llm, llava_prompt(1), [image])
        if evicted:
            self._evict_encoder_cache(llm, variant + 1)
        prompt = llava_prompt(1, OTHER_QUESTION)
        second = _generate(llm, prompt, [image])
        start, end = _image_span(model_dir, second)
        hit = _expected_hit(first.computed_ids, second.prompt_ids)
        assert start < hit < end, (start, hit, end)  # the design of the prompts
        assert second.num_cached_tokens == hit
        assert second.hits == hit
        assert second.encoder_runs == (1 if evicted else 0)
        _check_hf(model_dir, second, prompt, [image])

    def test_full_hit_on_a_prompt_ending_in_an_image(
        self, llm: Any, model_dir: str
    ) -> None:
        """33 tokens, image at [17, 33): the repeat is cached but for its last
        token, an image token, so its first step is one row (laid out as a
        decode row) that merges the image's last embedding row, after
        encoding the evicted image again."""
        prompt, images = "USER: Here is a photo: <image>", [_fresh(70)]
        cold = _generate(llm, prompt, images)
        _check_hf(model_dir, cold, prompt, images)
        start, end = _image_span(model_dir, cold)
        assert end == len(cold.prompt_ids) == 2 * BLOCK + 1, (start, end)
        self._evict_encoder_cache(llm, 71)
        warm = _generate(llm, prompt, images)
        assert warm.num_cached_tokens == warm.hits == 2 * BLOCK
        assert warm.encoder_runs == 1, warm
        assert warm.token_ids == cold.token_ids

    def test_multi_turn_chat_reencodes_nothing(self, llm: Any, model_dir: str) -> None:
        """Turn 2 repeats turn 1 (image and question), the assistant's answer
        and a new question: the image's blocks come from the cache."""
        image = _fresh(50)
        url = png_data_url(image)
        turn1: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe the picture."},
                ],
            }
        ]
        # A fixed answer (not the random model's, which may hold special tokens).
        turn2: list[dict[str, Any]] = [
            *turn1,
            {"role": "assistant", "content": "It is a small picture."},
            {"role": "user", "content": [{"type": "text", "text": OTHER_QUESTION}]},
        ]
        first = self._chat(llm, turn1)
        self._check_chat_hf(model_dir, first, turn1, image)
        self._evict_encoder_cache(llm, 51)
        second = self._chat(llm, turn2)
        _, end = _image_span(model_dir, second)
        hit = _expected_hit(first.computed_ids, second.prompt_ids)
        assert hit >= BLOCK * (len(first.prompt_ids) // BLOCK) >= end
        assert second.num_cached_tokens == hit
        assert second.encoder_runs == 0, second
        self._check_chat_hf(model_dir, second, turn2, image)

    @staticmethod
    def _chat(llm: Any, messages: list[dict[str, Any]]) -> Run:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        return _measured(llm, lambda: llm.chat(messages, params, use_tqdm=False))

    @staticmethod
    def _check_chat_hf(
        model_dir: str, run: Run, messages: list[dict[str, Any]], image: Any
    ) -> None:
        """HF greedy on the prompt the chat template renders (it writes BOS)."""
        hf_messages = [
            {
                "role": m["role"],
                "content": m["content"]
                if isinstance(m["content"], str)
                else [
                    {"type": "image"}
                    if p["type"] == "image_url"
                    else {"type": "text", "text": p["text"]}
                    for p in m["content"]
                ],
            }
            for m in messages
        ]
        prompt = load_hf_processor(model_dir).apply_chat_template(
            hf_messages, add_generation_prompt=True, tokenize=False
        )
        want_ids = hf_llava_prompt_ids(
            model_dir, prompt, [image], add_special_tokens=False
        )
        assert run.prompt_ids == want_ids
        want = hf_llava_greedy(
            model_dir, prompt, [image], MAX_NEW, add_special_tokens=False
        )
        assert run.token_ids == want, f"vLLM {run.token_ids} != HF {want}"


class TestPrefixCacheGraphMode:
    """Graph mode, explicit buckets: prefills whose first blocks come from the
    cache (their context blocks counted in the step's bucket) run prepared
    shapes only, and match HF."""

    warmup_before = 0.0  # warmup compilations counted before this engine

    @pytest.fixture(scope="class")
    def llm(
        self, model_dir: str, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Any]:
        buckets = tmp_path_factory.mktemp("buckets") / "prefix.yaml"
        buckets.write_text(
            "prefill_tokens: [8, 24]\ndecode_batch: [1, 4]\nblocks: [4, 16]\n"
        )
        type(self).warmup_before = _counter_or_zero(WARMUP_COMPILES)
        yield from _engine(
            model_dir,
            additional_config={
                "hpu_mm": {
                    "graph_mode": "compile",
                    "bucketing": {"strategy": "explicit", "file": str(buckets)},
                    "warmup": {"progress_bar": False},
                }
            },
        )

    def test_cached_prefills_compile_nothing(self, llm: Any, model_dir: str) -> None:
        # Compile mode is on: this engine's warmup compiled its buckets.
        assert _counter(*WARMUP_COMPILES) > type(self).warmup_before
        serving = {"phase": "serving"}
        compiles = _counter("vllm_hpu_mm:graph_compiles_total", serving)
        fallbacks = _counter("vllm_hpu_mm:fallback_buckets_total")
        image = _fresh(60)
        cold = _generate(llm, llava_prompt(1), [image])
        _check_hf(model_dir, cold, llava_prompt(1), [image])
        warm = _generate(llm, llava_prompt(1), [image])  # all but the last token
        assert warm.num_cached_tokens > 0 and warm.token_ids == cold.token_ids
        prompt = llava_prompt(1, OTHER_QUESTION)  # cached prefix ends mid-image
        cut = _generate(llm, prompt, [image])
        start, end = _image_span(model_dir, cut)
        assert start < cut.num_cached_tokens < end
        _check_hf(model_dir, cut, prompt, [image])
        assert _counter("vllm_hpu_mm:graph_compiles_total", serving) == compiles
        assert _counter("vllm_hpu_mm:fallback_buckets_total") == fallbacks
