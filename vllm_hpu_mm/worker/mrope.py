"""M-RoPE positions (Qwen2-VL family): three rotary position channels per token.

The language model of these models rotates each token by a (temporal, height,
width) position instead of one index: text tokens get the same value in the
three channels, an image's tokens get their place in the merged patch grid.
As vLLM's GPU runner does, a request's prompt positions are computed once, when
it arrives, by the model's own ``get_mrope_input_positions`` (``SupportsMRoPE``),
and kept in its state with the delta of its generated tokens: the token at index
``i >= len(prompt)`` has position ``i + delta`` in every channel (``delta`` =
the prompt's largest position + 1 - prompt length, so it continues after it).

``gather_mrope`` cuts a step's rows out of that: for each request the tokens
[num_computed, num_computed + query_len), so chunked prefill (a chunk ending
inside an image), prefix-cache hits (a request starting at a cached prefix),
resumed requests and decode all read the same stored positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """One request's M-RoPE positions."""

    prompt: np.ndarray  # [channels, num_prompt_tokens] int64
    delta: int  # generated token i sits at position i + delta (all channels)

    @property
    def num_channels(self) -> int:
        return int(self.prompt.shape[0])


def compute_mrope(
    model: Any, prompt_token_ids: list[int], mm_features: Sequence[Any]
) -> MRopePositions:
    """The model's own M-RoPE positions of a prompt (``SupportsMRoPE``)."""
    features = [f for f in mm_features if f.modality != "prompt_embeds"]
    positions, delta = model.get_mrope_input_positions(prompt_token_ids, features)
    prompt = np.asarray(positions, dtype=np.int64)
    if prompt.ndim != 2 or prompt.shape[1] != len(prompt_token_ids):
        raise ValueError(
            f"get_mrope_input_positions returned shape {tuple(prompt.shape)} for "
            f"{len(prompt_token_ids)} prompt tokens; expected [channels, "
            f"{len(prompt_token_ids)}]"
        )
    return MRopePositions(prompt, int(delta))


def request_positions(entry: MRopePositions, start: int, stop: int) -> np.ndarray:
    """[channels, stop - start] positions of token indices [start, stop)."""
    num_prompt = entry.prompt.shape[1]
    from_prompt = entry.prompt[:, start : min(stop, num_prompt)]
    generated = np.arange(max(start, num_prompt), stop, dtype=np.int64) + entry.delta
    return np.concatenate(
        [from_prompt, np.broadcast_to(generated, (entry.num_channels, generated.size))],
        axis=1,
    )


def gather_mrope(
    entries: Sequence[MRopePositions], starts: np.ndarray, query_lens: np.ndarray
) -> np.ndarray:
    """[channels, sum(query_lens)] positions of a step's real tokens, in batch
    order (request i: token indices [starts[i], starts[i] + query_lens[i]))."""
    channels = entries[0].num_channels if entries else 3
    parts = [
        request_positions(e, int(a), int(a + n))
        for e, a, n in zip(entries, starts, query_lens, strict=True)
    ]
    if not parts:
        return np.zeros((channels, 0), np.int64)
    return np.concatenate(parts, axis=1)
