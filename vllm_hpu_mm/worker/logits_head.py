"""Which precision the language-model head's logits get, and installing it.

vLLM's own switch is ``--hf-overrides '{"head_dtype": ...}'``: ``"model"`` keeps
the model dtype's logits, ``"float32"`` runs the head in float32 (off CUDA by
casting the whole weight every step). When the checkpoint or the user names no
``head_dtype`` and the model runs in bfloat16 or float16, the plugin computes
float32 logits for the top candidates of each row (``hpu_kernels.logits``): a
bfloat16 head rounds logits 0.125 apart at 16-32, enough to flip greedy answers
whose float32 margin is below that (SmolLM2's first answer token to "What is
the capital of France?" is one: "The" leads "L" by 0.08 nats in float32).

Installed per ``LogitsProcessor`` instance of the loaded model, so nothing of
vLLM's class changes; each shard refines its own rows before the TP gather,
which keeps the global argmax exact (it is in its shard's top ``k``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch

from hpu_kernels.logits import REFINED_TOP, refined_logits

logger = logging.getLogger("vllm.hpu_mm.logits_head")

HeadPrecision = Literal["refined", "model", "float32"]


def head_precision(model_config: Any) -> HeadPrecision:
    """``refined`` unless ``head_dtype`` is named (then vLLM's choice holds) or
    the model runs in float32 (nothing to refine)."""
    named = getattr(getattr(model_config, "hf_config", None), "head_dtype", None)
    dtype = model_config.dtype
    if named is not None:
        return "model" if model_config.head_dtype == dtype else "float32"
    if dtype not in (torch.bfloat16, torch.float16):
        return "model"
    return "refined"


def _refined_apply_head(
    processor: Any,
    lm_head: Any,
    hidden_states: torch.Tensor,
    embedding_bias: torch.Tensor | None,
) -> torch.Tensor:
    if not isinstance(lm_head.quant_method, _plain_methods()):
        # A quantized head: vLLM's own projection.
        return type(processor)._apply_head(
            processor, lm_head, hidden_states, embedding_bias
        )
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = refined_logits(flat, lm_head.weight, embedding_bias, processor.refine_k)
    return logits.reshape(*hidden_states.shape[:-1], -1)


@functools.cache
def _plain_methods() -> tuple[type, ...]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    return (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)


def install_refined_head(model: torch.nn.Module, k: int = REFINED_TOP) -> int:
    """Give every head-projecting ``LogitsProcessor`` of ``model`` the refined
    projection (a quantized head keeps vLLM's); returns how many."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    installed = 0
    for module in model.modules():
        if not isinstance(module, LogitsProcessor) or module.logits_as_input:
            continue
        module.refine_k = k  # type: ignore[assignment]
        module._apply_head = functools.partial(_refined_apply_head, module)  # type: ignore[method-assign]
        installed += 1
    return installed


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def configure_head(model: torch.nn.Module, model_config: Any) -> HeadPrecision:
    """Apply ``head_precision`` to the loaded model and log the choice."""
    precision = head_precision(model_config)
    if precision == "refined" and install_refined_head(model):
        logger.info(
            "Logits: float32 for the top %d of each row over the %s head "
            '(--hf-overrides \'{"head_dtype": "model"}\' keeps %s logits, '
            "'\"float32\"' a float32 head)",
            REFINED_TOP,
            _name(model_config.dtype),
            _name(model_config.dtype),
        )
        return precision
    if precision == "refined":
        return "model"
    logger.info("Logits: %s head (head_dtype)", _name(model_config.head_dtype))
    return precision
