"""Choose the padded sizes of one step from a BucketSet (pure Python).

Layout of a step (see ``vllm_hpu_mm.attention.metadata``): decode rows first,
then the prefill tokens. A step runs as a decode part and a prefill part (a
mixed step as two passes), each with its own graph key. Rules:

- decode rows = smallest batch bucket >= decodes (0 if none);
- decode blocks (flat list length, or block-table width) = smallest block
  bucket;
- prefill rows = smallest token bucket >= prefill tokens (0 if none);
- prefill blocks (context blocks of the widest tile) = smallest prefill block
  bucket (``BucketSet.prefill_blocks``: the block buckets unless the set has
  its own for prefill);
- logits rows: smallest batch bucket >= requests.

A size above every bucket of its axis takes the fallback: padded to a bounded
size (``fallback_size``), warned about once per size, and counted. Such a
size was not prepared at warmup, so it may compile while serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm_hpu_mm.bucketing.buckets import BucketSet, fallback_size, smallest_fit

logger = logging.getLogger("vllm.hpu_mm.bucketing")


@dataclass(frozen=True, slots=True)
class StepSizes:
    """Real sizes of a step (decode rows first)."""

    num_reqs: int
    num_decodes: int
    decode_blocks: int  # decode blocks (flat list length, or table width)
    prefill_tokens: int
    prefill_blocks: int  # context blocks of the widest prefill tile

    @property
    def tokens(self) -> int:
        return self.num_decodes + self.prefill_tokens


@dataclass(frozen=True, slots=True)
class PaddedSizes:
    batch: int  # logits rows
    num_decodes: int
    decode_blocks: int
    prefill_tokens: int
    prefill_blocks: int
    fallbacks: tuple[str, ...] = ()  # axes that took the fallback

    @property
    def tokens(self) -> int:
        return self.num_decodes + self.prefill_tokens


@dataclass
class Bucketer:
    """Pads steps to a BucketSet, counting and warning once per fallback size."""

    buckets: BucketSet
    max_pad_ratio: float = 2.0  # a fallback pads to at most this x the size
    fallback_count: int = 0
    _warned: set[tuple[str, int]] = field(default_factory=set)

    def _fit(self, axis: str, value: int, used: list[str]) -> int:
        if value == 0:
            return 0
        values = getattr(self.buckets, axis)
        fit = smallest_fit(value, values)
        if fit is not None:
            return fit
        size = fallback_size(value, values, self.max_pad_ratio)
        used.append(axis)
        if (axis, size) not in self._warned:
            self._warned.add((axis, size))
            logger.warning(
                "vllm-hpu-mm: %s=%d is above every prepared bucket (largest %d); "
                "padding to %d, which may compile a new graph while serving. "
                "Add it to the bucket file or plan buckets from your workload "
                "(`vllm-hpu-mm buckets plan`).",
                axis,
                value,
                values[-1],
                size,
            )
        return size

    def pad(self, s: StepSizes) -> PaddedSizes:
        used: list[str] = []
        batch = self._fit("batch", s.num_reqs, used)
        decodes = self._fit("batch", s.num_decodes, used)
        dec_blocks = self._fit("blocks", s.decode_blocks, used)
        prefill_tokens = self._fit("tokens", s.prefill_tokens, used)
        prefill_blocks = self._fit("prefill_blocks", s.prefill_blocks, used)
        if used:
            self.fallback_count += 1
        return PaddedSizes(
            batch=batch,
            num_decodes=decodes,
            decode_blocks=dec_blocks,
            prefill_tokens=prefill_tokens,
            prefill_blocks=prefill_blocks,
            fallbacks=tuple(used),
        )
