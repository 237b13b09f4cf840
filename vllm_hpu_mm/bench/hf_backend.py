"""The same requests through HF transformers ``generate``, measured.

Batched with left padding, greedy, each batch generating its longest output
length (eos ignored); each request counts its own ``output_len`` tokens. A
stopping criterion that never stops records when each token of the batch
came out, which gives every request a real TTFT (from the start of the whole
run, as in vLLM, where every request arrives at once), TPOT and end time.

Text models load with ``AutoModelForCausalLM``; models with a vision config
(LLaVA, Idefics3, Mllama) with ``AutoProcessor`` + ``AutoModelForImageTextToText``.

Mllama's prompts are tokenized as vLLM tokenizes them (the tokenizer alone,
one BOS), not by ``MllamaProcessor``, which puts a second BOS after the
leading image tokens: both backends then run and count the same prompt
tokens. Its other inputs come from transformers' own code, as in its
processor: pixel values and aspect-ratio ids/masks from the image processor,
the cross-attention mask from ``processing_mllama`` over the left-padded ids.
On Gaudi, ``vllm_hpu_mm.device`` adapts transformers with optimum-habana
before loading and moves the model to the device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from vllm_hpu_mm.bench.datasets import BenchRequest
from vllm_hpu_mm.bench.memory import peak_rss_bytes, reset_peak_rss
from vllm_hpu_mm.bench.stats import HF, RequestRecord, backend_result
from vllm_hpu_mm.multimodal.token_ids import image_token_id

logger = logging.getLogger("vllm.hpu_mm.bench")


def batches(requests: Sequence[BenchRequest], size: int) -> list[list[int]]:
    """Indices of ``requests`` in batches of at most ``size``: grouped by
    number of images (a batch's processor call takes one shape), then by
    output length, longest first, so a batch's lengths are close."""
    if size <= 0:
        raise ValueError(f"batch size must be positive, got {size}")
    order = sorted(
        range(len(requests)),
        key=lambda i: (len(requests[i].images), -requests[i].output_len, i),
    )
    out: list[list[int]] = []
    for i in order:
        if (
            out
            and len(out[-1]) < size
            and len(requests[out[-1][0]].images) == len(requests[i].images)
        ):
            out[-1].append(i)
        else:
            out.append([i])
    return out


class _TokenClock:
    """A ``StoppingCriteria`` that never stops and notes when each step's
    tokens are out (``generate`` calls it once per new token)."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync
        self.stamps: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.sync()
        self.stamps.append(time.perf_counter())
        return torch.zeros(
            input_ids.shape[0], dtype=torch.bool, device=input_ids.device
        )


class HfRunner:
    """One HF model (and its tokenizer or processor) on this device."""

    def __init__(self, model_path: str, dtype: str = "auto") -> None:
        import torch
        from transformers import AutoConfig

        from vllm_hpu_mm import device

        device.prepare_hf_for_device()
        config = AutoConfig.from_pretrained(model_path)
        self.multimodal = getattr(config, "vision_config", None) is not None
        torch_dtype = getattr(torch, dtype) if dtype not in ("auto", None) else "auto"
        if self.multimodal:
            from transformers import AutoModelForImageTextToText

            from vllm_hpu_mm.models.qwen_processor import load_processor

            self.processor = load_processor(model_path)
            self.tokenizer = self.processor.tokenizer
            model = AutoModelForImageTextToText.from_pretrained(
                model_path, dtype=torch_dtype
            )
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.tokenizer.padding_side = "left"
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        model.eval()
        # Like vLLM's ignore_eos: never stop early.
        model.generation_config.eos_token_id = None
        self.model = device.hf_model_to_device(model)
        self.device = device.torch_device()
        self.generate_kwargs = device.hf_generate_kwargs()
        self.image_id = image_token_id(config)
        # Mllama: ids from the tokenizer, like vLLM (see the module docstring)
        self.mllama = getattr(config, "model_type", None) == "mllama"

    def inputs(self, batch: Sequence[BenchRequest]) -> dict[str, Any]:
        """The batch's tensors, left padded, on the device."""
        tensors: dict[str, Any]
        if all(r.prompt_token_ids is not None for r in batch):
            tensors = self._left_padded([list(r.prompt_token_ids or []) for r in batch])
        elif self.mllama:
            tensors = self._mllama_inputs(batch)
        elif self.processor is not None:
            texts = [r.prompt for r in batch]
            images = [list(r.images) for r in batch]
            tensors = dict(
                self.processor(
                    text=texts,
                    images=images if any(images) else None,
                    padding=True,
                    return_tensors="pt",
                )
            )
        else:
            tensors = dict(
                self.tokenizer(
                    [r.prompt for r in batch], padding=True, return_tensors="pt"
                )
            )
        return {k: v.to(self.device) for k, v in tensors.items()}

    def _left_padded(self, ids: list[list[int]]) -> dict[str, Any]:
        import torch

        width = max(map(len, ids))
        return {
            "input_ids": torch.tensor(
                [[self.pad_id] * (width - len(x)) + x for x in ids], dtype=torch.long
            ),
            "attention_mask": torch.tensor(
                [[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long
            ),
        }

    def _mllama_inputs(self, batch: Sequence[BenchRequest]) -> dict[str, Any]:
        """Mllama's batch: the prompts tokenized as vLLM does, left padded;
        the images and the cross-attention mask as ``MllamaProcessor`` makes
        them (a batch holds one number of images per prompt, see ``batches``)."""
        import torch
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        tensors = self._left_padded(
            [list(self.tokenizer(r.prompt)["input_ids"]) for r in batch]
        )
        if not any(r.images for r in batch) or self.image_id is None:
            return tensors
        assert self.processor is not None
        image_processor = self.processor.image_processor
        pix = dict(
            image_processor(images=[list(r.images) for r in batch], return_tensors="pt")
        )
        num_tiles = pix.pop("num_tiles")
        rows = tensors["input_ids"].tolist()
        mask = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(row, self.image_id) for row in rows],
            num_tiles=num_tiles,
            max_num_tiles=image_processor.max_image_tiles,
            length=len(rows[0]),
        )
        tensors.update(pix, cross_attention_mask=torch.as_tensor(mask))
        return tensors

    def generate(
        self, inputs: dict[str, Any], max_new_tokens: int
    ) -> tuple[list[float], list[list[int]]]:
        """Run one batch: the time each new token came out, and each row's new
        token ids."""
        import torch
        from transformers import StoppingCriteriaList

        from vllm_hpu_mm import device

        clock = _TokenClock(device.synchronize)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=None,
                eos_token_id=None,
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([clock]),
                **self.generate_kwargs,
            )
        sequences = getattr(out, "sequences", out)
        new = sequences[:, inputs["input_ids"].shape[1] :]
        return clock.stamps, [row.tolist() for row in new]


def run_hf(
    model_path: str,
    requests: Sequence[BenchRequest],
    *,
    batch_size: int,
    dtype: str = "auto",
    warmups: Sequence[BenchRequest] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Load the model, run one untimed batch of ``warmups``, then every
    request in batches; the ``hf`` result section of the report."""
    from tqdm import tqdm

    from vllm_hpu_mm import device

    reset_peak_rss()
    runner = HfRunner(model_path, dtype)
    groups = batches(requests, batch_size)
    if warmups:  # untimed, like the engine's warm-up requests
        warm = [warmups[i] for i in batches(warmups, batch_size)[0]]
        runner.generate(runner.inputs(warm), max(r.output_len for r in warm))
    records: dict[int, RequestRecord] = {}
    bar = tqdm(total=len(requests), desc="HF generate", disable=not progress)
    start = time.perf_counter()
    for group in groups:
        batch = [requests[i] for i in group]
        inputs = runner.inputs(batch)
        stamps, _ = runner.generate(inputs, max(r.output_len for r in batch))
        mask = inputs["attention_mask"]
        ids = inputs["input_ids"]
        for row, (i, req) in enumerate(zip(group, batch, strict=True)):
            n = min(req.output_len, len(stamps))
            real = ids[row][mask[row].bool()]
            first, last = stamps[0] - start, stamps[n - 1] - start
            records[i] = RequestRecord(
                prompt_tokens=int(real.numel()),
                image_tokens=int((real == runner.image_id).sum())
                if runner.image_id is not None
                else 0,
                output_tokens=n,
                ttft_s=first,
                tpot_s=(last - first) / (n - 1) if n > 1 else None,
                e2e_s=last,
            )
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    extra = {
        "batch_size": batch_size,
        "num_batches": len(groups),
        "peak_memory": {
            "device_bytes": device.peak_memory_bytes(),
            "host_rss_bytes": peak_rss_bytes(),
        },
    }
    return backend_result(
        HF, [records[i] for i in range(len(requests))], elapsed, extra
    )
