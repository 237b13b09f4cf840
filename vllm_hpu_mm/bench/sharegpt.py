"""ShareGPT-style benchmark files through vLLM's own ``ShareGPTDataset``.

``vllm bench`` draws from a ShareGPT JSON file with ``ShareGPTDataset``; the
benchmark uses the same class, so a file gives the same prompts and output
lengths as there, and adds only what a ShareGPT4V file on local disk needs
(``sharegpt4v``). Imports vLLM (``datasets.py`` does not).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from vllm.benchmarks.datasets import ShareGPTDataset
from vllm.tokenizers import TokenizerLike

from vllm_hpu_mm.bench.datasets import IMAGE_PLACEHOLDER, BenchRequest

logger = logging.getLogger("vllm.hpu_mm.bench")


class LocalShareGPT(ShareGPTDataset):
    """vLLM's ShareGPTDataset less the entries whose image is not on disk under
    ``root`` (vLLM would send their ``file://`` URL as it is)."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        self.root, self.missing = root, 0
        super().__init__(**kwargs)

    def load_data(self) -> None:
        try:
            super().load_data()
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(
                f"{self.dataset_path}: cannot read a ShareGPT JSON list: {exc}"
            ) from exc
        assert self.data is not None
        kept = [
            e
            for e in self.data
            if e.get("image") is None or (self.root / e["image"]).is_file()
        ]
        self.missing, self.data = len(self.data) - len(kept), kept


def sharegpt4v(
    path: Path,
    num_prompts: int,
    tokenizer: TokenizerLike,
    image_token: str | None,
    *,
    output_len: int | None = None,
    image_root: Path | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests from a ShareGPT-style JSON list, drawn by vLLM's own
    ``ShareGPTDataset`` (what ``vllm bench`` draws from the same file): the first
    turn is the prompt, the second's token count the output length unless
    ``output_len``; entries with fewer than two turns, prompts or answers under 4
    tokens (answers: unless ``output_len``), prompts over 1024 tokens or prompt
    and answer over 2048 are left out; shuffled with ``seed``; drawn again at
    random up to ``num_prompts``. Added here for a ShareGPT4V file on local disk:
    image paths are relative to ``image_root`` (default: the file's folder),
    entries whose image is missing are skipped with a warning, and ``<image>``
    becomes the model's image token (vLLM's serving benchmark leaves that to
    the chat template; these prompts go to ``generate``)."""
    from PIL import Image

    root = image_root or path.parent
    data = LocalShareGPT(root, dataset_path=str(path), random_seed=seed)
    if data.missing:
        logger.warning("%s: %d entries skipped (image missing)", path, data.missing)
    samples = data.sample(
        tokenizer, num_prompts, output_len=output_len, no_oversample=True
    )
    if not samples:
        raise ValueError(
            f"{path}: no usable entries (images under {root}; vLLM's ShareGPT rules "
            "need two turns and prompts and answers of 4 to 1024 tokens)"
        )
    data.maybe_oversample_requests(samples, num_prompts)
    out = []
    for sample in samples:
        human = str(sample.prompt)
        item: Any = sample.multi_modal_data  # {"type": "image_url", ...} or None
        if not item:
            out.append(BenchRequest(sample.expected_output_len, prompt=human))
            continue
        if image_token is None:
            raise ValueError(f"{path}: entries have images but the model takes none")
        image = root / str(item["image_url"]["url"]).removeprefix("file://")
        text = human if IMAGE_PLACEHOLDER in human else IMAGE_PLACEHOLDER + human
        with Image.open(image) as im:
            picture = im.convert("RGB")
        n = text.count(IMAGE_PLACEHOLDER)
        out.append(
            BenchRequest(
                sample.expected_output_len,
                prompt=text.replace(IMAGE_PLACEHOLDER, image_token),
                images=[picture] * n,
                image_keys=[str(image)] * n,
            )
        )
    return out
