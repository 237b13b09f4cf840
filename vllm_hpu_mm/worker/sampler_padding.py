"""vLLM's Sampler at padded batch sizes, and its warmup.

On Gaudi every new shape of an op compiles a new recipe, also for ops run
eagerly; the sampler runs once per step at the number of requests, so without
padding each new batch size compiles recipes while serving. On the static path
(``sampler_batch_sizes``) the logits head already runs at a batch bucket
(``GraphRunner.logits`` on the bucket-padded ``logits_rows``); the sampler
follows it: ``sample_padded`` pads the step's logits and sampling metadata to
the smallest batch bucket that holds them, samples, and drops the padding
rows' outputs; ``warm_up_sampler`` runs every batch bucket's sampler shapes
once at warmup (the official Gaudi plugin warms its sampler over batch sizes
and sampling configurations likewise).

Padding rows never change a real row's result:

- rows keep their indices, so per-row state addressed by row (seeded
  ``generators``, ``bad_words_token_ids``, ``logprob_token_ids``) is unchanged;
  a seeded row draws its noise from its own generator, row by row
  (``q[i].exponential_(generator=g)``), whatever the batch size;
- padding rows are neutral: zero logits, temperature 0 (greedy) in a mixed
  batch and 1 in an all-random one (so ``all_greedy`` / ``all_random`` keep
  their values), no top-k / top-p, no penalties (prompt rows of the penalty
  pad id), no output tokens, no allowed-token mask;
- logits processors (vLLM's built-ins and ``--logits-processors`` classes) hold
  per-row state sized by the real batch (``BatchUpdate.batch_size``: min-p's
  ``[R, 1]`` thresholds), so they run on the real rows' view only
  (``_RealRows``); they are the only sampler ops at the real size, and only
  while a request uses one (min_p, logit_bias, min_tokens, a custom class);
- every row's ops are row-wise (softmax, top-k, sort, argmax, gather), so a
  real row's values do not depend on its neighbours.

Unseeded random rows draw from the device's default generator, over a larger
noise tensor: their draws differ from an unpadded call's, as they differ from
run to run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_hpu_mm import metrics

if TYPE_CHECKING:
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.sampler import Sampler

logger = logging.getLogger("vllm.hpu_mm.sampler")


def sampler_batch_sizes(plan: Any, buckets: Any) -> tuple[int, ...]:
    """The batch sizes the sampler is padded to: the batch buckets where the
    execution plan pads the sampler (``ExecutionPlan.padded_sampler``: graph
    mode with every graph at a fixed shape), where the logits head runs at
    them too; empty elsewhere, where the sampler runs at the real batch size."""
    if buckets is None or not plan.padded_sampler:
        return ()
    return tuple(sorted(buckets.batch))


@contextlib.contextmanager
def counted_compiles(counter: Any) -> Iterator[None]:
    """Count the graphs Dynamo compiles inside the body (vLLM's sampler
    compiles its own helpers, e.g. ``batched_count_greater_than`` for
    logprobs, with the platform's ``simple_compile_backend``) in
    ``vllm_hpu_mm:graph_compiles_total`` under the compile counter's phase, so
    a sampler shape warmup missed shows up as a serving compilation. (Code
    compiled through ``counter`` itself is counted by the counter, not here:
    the body must not run it.)"""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    try:
        yield
    finally:
        new = counters["stats"]["unique_graphs"] - before
        if new > 0 and counter is not None:
            counter.count += new
            metrics.GRAPH_COMPILES.labels(phase=counter.phase).inc(new)


def padded_size(rows: int, batch_sizes: Sequence[int]) -> int:
    """The smallest of ``batch_sizes`` (ascending) holding ``rows``; ``rows``
    itself when none does or none is given (the sampler then runs unpadded)."""
    for size in batch_sizes:
        if size >= rows:
            return size
    return rows


def _pad_rows(t: torch.Tensor, size: int, value: float | int | bool) -> torch.Tensor:
    """``t`` ([R, ...]) with rows up to ``size`` filled with ``value``."""
    extra = size - t.shape[0]
    if extra <= 0:
        return t
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])


class _RealRows(LogitsProcessor):
    """A logits processor applied to the first ``rows`` rows of the logits
    only (its state is sized by the real batch); the padding rows pass
    through untouched."""

    def __init__(self, inner: LogitsProcessor, rows: int) -> None:
        self.inner = inner
        self.rows = rows

    def is_argmax_invariant(self) -> bool:
        return self.inner.is_argmax_invariant()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise AssertionError("state updates go to the wrapped processor")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        real = logits[: self.rows]
        out = self.inner.apply(real)
        if out is not real:  # processors may work in place or return new rows
            real.copy_(out)
        return logits


def pad_metadata(
    md: SamplingMetadata, rows: int, size: int, vocab_size: int
) -> SamplingMetadata:
    """``md`` for ``rows`` real rows, widened to ``size`` rows (module doc)."""
    if size == rows:
        return md
    temperature = md.temperature
    if temperature is not None:
        temperature = _pad_rows(temperature, size, 1.0 if md.all_random else 0.0)
    procs = md.logitsprocs
    if any(True for _ in procs.all):
        procs = LogitsProcessors(_RealRows(p, rows) for p in procs.all)
    prompt_ids = md.prompt_token_ids
    if prompt_ids is not None:  # vocab_size is the penalties' pad id
        prompt_ids = _pad_rows(prompt_ids, size, vocab_size)
    mask = md.allowed_token_ids_mask
    if mask is not None:
        mask = _pad_rows(mask[:rows], size, False)
    outputs = md.output_token_ids
    if outputs:
        outputs = [*outputs, *([] for _ in range(size - rows))]
    return dataclasses.replace(
        md,
        temperature=temperature,
        top_p=None if md.top_p is None else _pad_rows(md.top_p, size, 1.0),
        top_k=None if md.top_k is None else _pad_rows(md.top_k, size, vocab_size),
        prompt_token_ids=prompt_ids,
        frequency_penalties=_pad_rows(md.frequency_penalties, size, 0.0),
        presence_penalties=_pad_rows(md.presence_penalties, size, 0.0),
        repetition_penalties=_pad_rows(md.repetition_penalties, size, 1.0),
        output_token_ids=outputs,
        allowed_token_ids_mask=mask,
        logitsprocs=procs,
    )


def _real_logprobs(t: LogprobsTensors, rows: int, size: int) -> LogprobsTensors:
    def cut(x: torch.Tensor) -> torch.Tensor:
        return x[:rows] if x.dim() > 0 and x.shape[0] == size else x

    return t._replace(
        logprob_token_ids=cut(t.logprob_token_ids),
        logprobs=cut(t.logprobs),
        selected_token_ranks=cut(t.selected_token_ranks),
    )


def sample_padded(
    sampler: Sampler,
    logits: torch.Tensor,
    md: SamplingMetadata,
    batch_sizes: Sequence[int],
) -> SamplerOutput:
    """``sampler(logits, md)`` at the smallest of ``batch_sizes`` holding the
    ``logits`` rows ([R, V]); the output has the R real rows only."""
    rows, vocab = logits.shape
    size = padded_size(rows, batch_sizes)
    if size == rows:
        return sampler(logits, md)
    padded = _pad_rows(logits, size, 0.0)  # [size, V]
    out = sampler(padded, pad_metadata(md, rows, size, vocab))
    lp = out.logprobs_tensors
    return SamplerOutput(
        sampled_token_ids=out.sampled_token_ids[:rows],
        logprobs_tensors=None if lp is None else _real_logprobs(lp, rows, size),
    )


# ---- warmup ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WarmupCase:
    """One sampling configuration warmup runs at each batch size."""

    name: str
    greedy_rows: str  # "all" | "none" | "half": rows sampled greedily
    top_k_top_p: bool  # the sort-based top-k / top-p path
    seeded: bool  # one row with its own generator
    num_logprobs: int | None  # None: no logprobs


def warmup_cases(max_logprobs: int) -> list[WarmupCase]:
    """Greedy, random, mixed, top-k/top-p and seeded sampling without logprobs;
    and sample logprobs at every count a request may ask for (0 to
    ``max_logprobs``: each count is a ``topk`` shape). Logprob shapes follow
    the raw logits, not the sampling mode, so greedy sampling carries them.
    ``max_logprobs=-1`` (no limit: any count up to the vocabulary) warms
    0 to 20, vLLM's default limit.
    Penalties are left out: their prompt-token tensor is as wide as the
    longest prompt of the batch, a shape without a finite set."""
    cases = [
        WarmupCase("greedy", "all", False, False, None),
        WarmupCase("random", "none", False, False, None),
        WarmupCase("random seeded", "none", False, True, None),
        WarmupCase("mixed", "half", False, False, None),
        WarmupCase("top-k/top-p", "none", True, False, None),
        WarmupCase("mixed top-k/top-p", "half", True, True, None),
    ]
    cases += [
        WarmupCase(f"logprobs={k}", "all", False, False, k)
        for k in range((max_logprobs if max_logprobs >= 0 else 20) + 1)
    ]
    return cases


def warmup_metadata(
    case: WarmupCase, size: int, vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampling metadata of ``size`` rows sampled as ``case`` says (built
    from host values: nothing is read back from a tensor)."""
    n_greedy = {"all": size, "none": 0, "half": size // 2}[case.greedy_rows]
    all_greedy, all_random = n_greedy == size, n_greedy == 0
    temps = [0.0] * n_greedy + [1.0] * (size - n_greedy)
    temperature = torch.tensor(temps, dtype=torch.float32, device=device)
    generators: dict[int, torch.Generator] = {}
    if case.seeded:
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        generators[size - 1] = gen
    top = case.top_k_top_p
    return SamplingMetadata(
        temperature=None if all_greedy else temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=torch.full((size,), 0.9, device=device) if top else None,
        top_k=torch.full((size,), min(8, vocab_size), dtype=torch.int32, device=device)
        if top
        else None,
        generators=generators,
        max_num_logprobs=case.num_logprobs,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(size, device=device),
        presence_penalties=torch.zeros(size, device=device),
        repetition_penalties=torch.ones(size, device=device),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def warm_up_sampler(sampler: Sampler, logits: torch.Tensor, max_logprobs: int) -> int:
    """Run each of ``warmup_cases`` on ``logits`` ([size, V], a batch bucket's
    output of the logits head); returns the number of sampler calls. Nothing
    is read back to the host (warmup may run in Gaudi's compile-only mode)."""
    size, vocab = logits.shape
    cases = warmup_cases(max_logprobs)
    for case in cases:
        md = warmup_metadata(case, size, vocab, logits.device)
        sampler(logits.clone(), md)  # the sampler may work on its logits in place
    return len(cases)
