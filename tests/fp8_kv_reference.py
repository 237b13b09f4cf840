"""HF transformers' greedy tokens with an FP8 KV cache: the oracle of
``--kv-cache-dtype fp8``.

``Fp8RoundTripCache`` is HF's ``DynamicCache`` whose ``update`` rounds every
new key (after RoPE, as the model hands it over) and value through
``float8_e4m3fn`` at the layer's scale before storing it: ``k / scale``,
saturated to +-448, cast to e4m3 (round to nearest even), cast back and
multiplied by the scale. HF's attention then attends exactly the values an
FP8 cache holds, the fresh tokens of a prefill included (``update`` returns
the stored, rounded keys). Written here with plain torch ops, not with the
plugin's ``hpu_kernels.kv_fp8``, so that the oracle does not repeat the code
it checks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from tests.hf_reference import load_hf_model

E4M3_MAX = 448.0


def round_trip_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as an e4m3 cache at ``scale`` stores and returns it, in x's dtype."""
    stored = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


class Fp8RoundTripCache(DynamicCache):
    """A ``DynamicCache`` holding FP8-rounded keys and values."""

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.k_scale, self.v_scale = k_scale, v_scale

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, Hkv, S_new, D]
        return super().update(
            round_trip_fp8(key_states, self.k_scale),
            round_trip_fp8(value_states, self.v_scale),
            layer_idx,
            *args,
            **kwargs,
        )


def hf_greedy_fp8_kv(
    model_dir: str,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> list[list[int]]:
    """HF's float32 greedy continuation of each prompt over an FP8 KV cache."""
    model = load_hf_model(model_dir)
    outputs: list[list[int]] = []
    for prompt in prompts_token_ids:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=Fp8RoundTripCache(k_scale, v_scale),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
