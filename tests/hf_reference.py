"""HF transformers reference outputs for the tiny models (float32, CPU, greedy)."""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def load_hf_model(model_dir: str, no_sliding_window: bool = False) -> Any:
    """The model in float32 with eager attention, eos disabled for generate.

    ``no_sliding_window`` drops the config's sliding window (full attention).
    """
    from transformers import AutoModelForCausalLM

    overrides = {"sliding_window": None} if no_sliding_window else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **overrides
    ).eval()
    # vLLM runs with ignore_eos=True in the comparisons: never stop early here,
    # and do not mask eos either (min_new_tokens would change the argmax).
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def load_hf_tokenizer(model_dir: str) -> Any:
    """The model directory's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _generate(model: Any, prompt: list[int], max_new_tokens: int) -> Any:
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )


def hf_greedy(
    model_dir: str,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    no_sliding_window: bool = False,
) -> list[list[int]]:
    """Greedy continuation of each prompt (exactly ``max_new_tokens`` ids each)."""
    model = load_hf_model(model_dir, no_sliding_window)
    outputs: list[list[int]] = []
    for prompt in prompts_token_ids:
        out = _generate(model, prompt, max_new_tokens)
        generated = out.sequences[0, len(prompt) :].tolist()
        assert len(generated) == max_new_tokens, (len(generated), max_new_tokens)
        outputs.append(generated)
    return outputs


def hf_greedy_logprobs(
    model_dir: str, prompts_token_ids: list[list[int]], max_new_tokens: int
) -> list[torch.Tensor]:
    """Per prompt, the log-softmax of HF's logits at each greedy step.

    Returns one ``[max_new_tokens, vocab]`` float32 tensor per prompt; its
    row-wise argmax is the ``hf_greedy`` output.
    """
    model = load_hf_model(model_dir)
    result: list[torch.Tensor] = []
    for prompt in prompts_token_ids:
        out = _generate(model, prompt, max_new_tokens)
        logits = torch.cat([step.float() for step in out.logits], dim=0)
        result.append(torch.log_softmax(logits, dim=-1))
    return result


def hf_greedy_text(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of a text prompt, decoded like vLLM's completions API.

    The prompt is tokenized with the tokenizer's default special tokens (as the
    OpenAI server does) and the continuation is decoded skipping special tokens.
    """
    tok = load_hf_tokenizer(model_dir)
    prompt_ids = tok(prompt)["input_ids"]
    [generated] = hf_greedy(model_dir, [prompt_ids], max_new_tokens)
    return tok.decode(generated, skip_special_tokens=True)
