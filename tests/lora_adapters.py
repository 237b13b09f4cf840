"""Tiny LoRA adapters written by PEFT's ``save_pretrained``, and HF + PEFT
greedy references for them (float32, CPU)."""

from __future__ import annotations

import functools
from typing import Any

import torch

# The language model's attention and MLP projections.
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def write_adapter(
    base_dir: str,
    out_dir: str,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    language_prefix: str | None = None,
) -> str:
    """A LoRA adapter on every projection of ``base_dir``'s language model with
    random non-zero A and B (PEFT initialises B to zero, a no-op adapter),
    saved with ``save_pretrained`` into ``out_dir``. ``language_prefix``
    (a VLM): only modules under it are targeted, not the vision tower's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    loader = AutoModelForImageTextToText if language_prefix else AutoModelForCausalLM
    model = loader.from_pretrained(base_dir, dtype=torch.float32)
    targets: Any = list(PROJECTIONS)
    if language_prefix:
        targets = rf".*{language_prefix}.*\.({'|'.join(PROJECTIONS)})"
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@functools.cache
def _peft_model(base_dir: str, adapter_dir: str, vlm: bool) -> Any:
    from peft import PeftModel

    from tests.hf_reference import load_hf_model

    if vlm:
        from transformers import AutoModelForImageTextToText

        base = AutoModelForImageTextToText.from_pretrained(
            base_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        base.generation_config.eos_token_id = None
    else:
        base = load_hf_model.__wrapped__(base_dir)  # a fresh copy: PEFT wraps it
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(
    base_dir: str,
    adapter_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    vlm: bool = False,
) -> list[list[int]]:
    """Greedy continuations of token-id prompts by HF with the adapter."""
    model = _peft_model(base_dir, adapter_dir, vlm)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            seq = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id,
            )
        outs.append(seq[0, len(prompt) :].tolist())
    return outs


def peft_vlm_greedy(
    base_dir: str, adapter_dir: str | None, inputs: Any, max_new_tokens: int
) -> list[int]:
    """Greedy continuation of a VLM's processor ``inputs`` by HF with the
    adapter (``None``: the base model)."""
    from tests.mm_reference import hf_vlm_greedy, load_hf_vlm

    if adapter_dir is None:
        return hf_vlm_greedy(load_hf_vlm(base_dir), inputs, max_new_tokens)
    model = _peft_model(base_dir, adapter_dir, True)
    return hf_vlm_greedy(model, inputs, max_new_tokens)
