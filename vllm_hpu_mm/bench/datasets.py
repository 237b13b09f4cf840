"""Benchmark requests: the seeded synthetic sets (ShareGPT files: ``sharegpt.py``).

- ``random``: token-id prompts of ``input_len`` random ids (after an optional
  shared ``prefix_len`` prefix), exact lengths, text models and VLMs alike;
- ``random-mm``: text prompts with images generated locally by Pillow (seeded
  noise, sizes from a list of ``WxH`` or from aspect ratios), a number of images
  per prompt, an optional pool of distinct images shared across prompts and a
  shared text prefix (what prefix caching and the encoder cache can reuse);
- ``sharegpt4v`` (``sharegpt.py``): a JSON list of ``{"image": "rel/path.jpg",
  "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt",
  "value": ...}]}`` with the images on local disk, drawn by vLLM's own
  ``ShareGPTDataset``.

Why the two synthetic sets are not vLLM's (``vllm.benchmarks.datasets``):

- ``random`` is exact token ids: vLLM's ``RandomDataset`` decodes random ids to
  text and encodes it again, which with the tiny models' BPE tokenizer does not
  keep the lengths (``benchmarks/vs_vllm_cpu.py`` hands vLLM these prompts for
  the same reason), and the HF-parity and bucket figures need exact lengths.
- ``random-mm``: vLLM's ``RandomMultiModalDataset`` has no pool of images shared
  across prompts (what the encoder-cache and prefix-cache figures measure), draws
  items per prompt as base x (1 +- ratio) rather than MIN-MAX, returns its images
  as JPEG data URLs for the chat API (the offline backends need PIL images, the
  same for HF and vLLM) and writes no image placeholder into the prompt (the chat
  template adds it there; ``generate`` needs it in the text).

Every generator takes a seed and returns the same requests for the same
arguments. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("vllm.hpu_mm.bench")

DATASETS = ("random", "random-mm", "sharegpt4v")
IMAGE_PLACEHOLDER = "<image>"  # what ShareGPT4V files write where an image goes


class Tokenizer(Protocol):
    """The part of a HF tokenizer the generators use."""

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str: ...


@dataclass(slots=True)
class BenchRequest:
    """One request, as both backends get it.

    Exactly one of ``prompt`` (text; the model's processor expands its image
    tokens) and ``prompt_token_ids`` is set.
    """

    output_len: int  # tokens to generate (eos ignored)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    images: list[Any] = field(default_factory=list)  # PIL images, in prompt order
    image_keys: list[str] = field(default_factory=list)  # identity of each image

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("a request has either a text or a token-id prompt")
        if len(self.image_keys) != len(self.images):
            raise ValueError("one image key per image")


@dataclass(frozen=True, slots=True)
class TextSpec:
    """Lengths of the text part of the synthetic sets."""

    num_prompts: int
    input_len: int  # random tokens per prompt, after the shared prefix
    output_len: int
    prefix_len: int = 0  # shared prefix tokens, the same in every prompt
    range_ratio: float = 0.0  # lengths uniform in [L*(1-r), L*(1+r)]
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """Images of the ``random-mm`` set."""

    sizes: tuple[tuple[int, int], ...]  # (width, height) choices, uniform
    items_per_prompt: tuple[int, int] = (1, 1)  # inclusive range, uniform
    pool: int = 0  # distinct images shared by all prompts; 0: all distinct

    def __post_init__(self) -> None:
        lo, hi = self.items_per_prompt
        if not 0 <= lo <= hi:
            raise ValueError(f"items per prompt {lo}-{hi}: need 0 <= min <= max")
        if not self.sizes:
            raise ValueError("no image sizes")
        if any(w <= 0 or h <= 0 for w, h in self.sizes):
            raise ValueError(f"image sizes must be positive: {self.sizes}")
        if self.pool < 0:
            raise ValueError(f"image pool {self.pool} must be >= 0")


# --- parsing of the size flags ------------------------------------------------------


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"64x64,96x48"`` -> ``((64, 64), (96, 48))``."""
    sizes = []
    for part in text.split(","):
        w, sep, h = part.strip().lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or not int(w) or not int(h):
            raise ValueError(f"image size {part!r}: write WIDTHxHEIGHT, e.g. 336x224")
        sizes.append((int(w), int(h)))
    return tuple(sizes)


def sizes_from_ratios(text: str, long_side: int) -> tuple[tuple[int, int], ...]:
    """``"1:1,4:3,9:16"`` at ``long_side`` 64 -> ``((64, 64), (64, 48), (36, 64))``:
    the longer side is ``long_side``, the other rounded, at least 1."""
    sizes = []
    for part in text.split(","):
        a, sep, b = part.strip().partition(":")
        try:
            rw, rh = float(a), float(b)
        except ValueError:
            rw = rh = 0.0
        if not sep or not (rw > 0 and rh > 0) or math.isinf(rw * rh):
            raise ValueError(f"aspect ratio {part!r}: write W:H, e.g. 4:3")
        if rw >= rh:
            sizes.append((long_side, max(1, round(long_side * rh / rw))))
        else:
            sizes.append((max(1, round(long_side * rw / rh)), long_side))
    return tuple(sizes)


def parse_range(text: str) -> tuple[int, int]:
    """``"2"`` -> ``(2, 2)``; ``"0-3"`` -> ``(0, 3)``."""
    lo, sep, hi = text.strip().partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ValueError(f"{text!r}: write N or MIN-MAX, e.g. 1-2")
    return int(lo), int(hi if sep else lo)


# --- generators ---------------------------------------------------------------------


def _length(rng: random.Random, length: int, ratio: float) -> int:
    if ratio <= 0:
        return length
    lo = max(1, math.floor(length * (1 - ratio)))
    return rng.randint(lo, max(lo, math.ceil(length * (1 + ratio))))


def text_vocab(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Token ids random prompts draw from: every id but the special ones."""
    special = set(special_ids)
    vocab = [i for i in range(vocab_size) if i not in special]
    if not vocab:
        raise ValueError("the tokenizer has no ordinary tokens")
    return vocab


def random_text(spec: TextSpec, vocab: Sequence[int]) -> list[BenchRequest]:
    """``num_prompts`` token-id prompts: the shared prefix, then random ids."""
    rng = random.Random(spec.seed)
    prefix = [rng.choice(vocab) for _ in range(spec.prefix_len)]
    out = []
    for _ in range(spec.num_prompts):
        n_in = _length(rng, spec.input_len, spec.range_ratio)
        n_out = _length(rng, spec.output_len, spec.range_ratio)
        body = [rng.choice(vocab) for _ in range(n_in)]
        out.append(BenchRequest(output_len=n_out, prompt_token_ids=prefix + body))
    return out


def synthetic_image(size: tuple[int, int], seed: int) -> Any:
    """A seeded RGB ``PIL.Image`` of ``size`` = (width, height): a random colour
    gradient with noise, so two seeds give two different images."""
    import numpy as np
    from PIL import Image

    w, h = size
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3).astype(np.float32)  # [3]
    ramp = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]  # [1, W, 1]
    noise = rng.integers(0, 64, size=(h, w, 3)).astype(np.float32)  # [H, W, 3]
    rgb = (base[None, None, :] + 128.0 * ramp + noise) % 256.0
    return Image.fromarray(rgb.astype(np.uint8), mode="RGB")


def random_mm(
    text: TextSpec,
    images: ImageSpec,
    tokenizer: Tokenizer,
    vocab: Sequence[int],
    image_token: str,
) -> list[BenchRequest]:
    """Text prompts ``prefix + image tokens + random text`` with their images.

    The text parts are random ids decoded to text, so the model's prompt is
    about, not exactly, ``input_len`` tokens (the report counts the real ones);
    any ``image_token`` the decoded pieces happen to spell is taken out, so a
    prompt holds exactly one ``image_token`` per image (LLaVA's processor
    expands each; Mllama keeps it as the image's one ``<|image|>`` token).
    With ``images.pool`` = N, N images are made once and every prompt picks
    from them (distinct within a prompt while N allows); otherwise every image
    is new.
    """
    rng = random.Random(text.seed)

    def words(n: int) -> str:
        return tokenizer.decode([rng.choice(vocab) for _ in range(n)]).replace(
            image_token, ""
        )

    prefix = words(text.prefix_len)
    pool = [
        (f"pool-{i}", rng.choice(images.sizes), rng.randrange(2**31))
        for i in range(images.pool)
    ]
    cache: dict[str, Any] = {}
    out = []
    for p in range(text.num_prompts):
        n_items = rng.randint(*images.items_per_prompt)
        if pool:
            picks = (
                rng.sample(range(len(pool)), n_items)
                if n_items <= len(pool)
                else [rng.randrange(len(pool)) for _ in range(n_items)]
            )
            chosen = [pool[i] for i in picks]
        else:
            chosen = [
                (f"p{p}-i{i}", rng.choice(images.sizes), rng.randrange(2**31))
                for i in range(n_items)
            ]
        ims = []
        for key, size, seed in chosen:
            if key not in cache:
                cache[key] = synthetic_image(size, seed)
            ims.append(cache[key])
        n_in = _length(rng, text.input_len, text.range_ratio)
        n_out = _length(rng, text.output_len, text.range_ratio)
        body = words(n_in)
        out.append(
            BenchRequest(
                output_len=n_out,
                prompt=prefix + image_token * n_items + body,
                images=ims,
                image_keys=[key for key, _, _ in chosen],
            )
        )
    return out
