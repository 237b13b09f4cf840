"""HF transformers reference outputs for the tiny models (float32, CPU, greedy),
and the bfloat16 comparison up to the first near-tie (``compare_greedy_bf16``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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


# --- bfloat16: greedy comparison up to the first near-tie ---------------------------

# A step of HF's greedy path is a near-tie when its top-2 logit margin is at most
# this many bfloat16 spacings of the top logit. In bfloat16 two correct
# implementations (different summation orders, fused or unfused kernels) can
# flip such a step; after it the two sequences condition on different tokens,
# so the comparison of that sequence stops there. 3 spacings: with the tiled
# prefill kernels one LLaVA serve case split from HF at exactly 3.0 spacings (its
# float32 run is token-identical), 2 had sufficed for the earlier kernels.
BF16_TIE_SPACINGS = 3.0
_BF16_MANTISSA_BITS = 7  # bits after the leading 1 of a bfloat16 number
_BF16_MIN_NORMAL_EXP = -126  # below 2**-126 bfloat16 is subnormal: fixed spacing


def bf16_spacing(x: float) -> float:
    """The distance between adjacent bfloat16 numbers around ``x``.

    ``2 ** (floor(log2 |x|) - 7)``: 0.125 for |x| in [16, 32), 2**-10 for
    |x| in [0.125, 0.25); below the smallest normal number (and at 0) the
    subnormal spacing 2**-133."""
    a = abs(float(x))
    if a == 0.0 or not math.isfinite(a):
        exp = _BF16_MIN_NORMAL_EXP
    else:
        exp = max(math.floor(math.log2(a)), _BF16_MIN_NORMAL_EXP)
    return 2.0 ** (exp - _BF16_MANTISSA_BITS)


@dataclass(frozen=True, slots=True)
class GreedyMatch:
    """How a greedy sequence compares with HF's, up to the near-tie it left at."""

    ties: int  # near-tie steps met while the sequences were still identical
    differs_at: int | None  # the near-tie step where they parted (None: never)
    margin_spacings: float | None  # that step's margin, in bfloat16 spacings

    @property
    def needed_tolerance(self) -> bool:
        """The sequences differ (at a near-tie, else the comparison failed)."""
        return self.differs_at is not None


def compare_greedy_bf16(
    got: Sequence[int],
    hf_tokens: Sequence[int],
    hf_logits: torch.Tensor,
    tie_spacings: float = BF16_TIE_SPACINGS,
) -> GreedyMatch:
    """Compare ``got`` with HF's greedy ``hf_tokens`` (``hf_logits``:
    ``[steps, vocab]``, HF's logits at each of its steps).

    Step by step the tokens must be identical, except at a near-tie: a step
    whose HF top-2 margin is at most ``tie_spacings`` bfloat16 spacings of the
    top logit. There ``got`` must pick one of the near-tied tokens; if it picks
    another than HF, the two continue from different tokens and nothing after
    is compared (while it picks HF's, comparing goes on: both sides still
    condition on the same tokens). Raises ``AssertionError`` naming the step."""
    got, want = list(got), list(hf_tokens)
    assert len(got) == len(want) == hf_logits.shape[0], (len(got), len(want))
    ties = 0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        row = hf_logits[step].float()
        top2 = torch.topk(row, 2).values
        spacing = bf16_spacing(float(top2[0]))
        margin = float(top2[0] - top2[1]) / spacing
        if margin > tie_spacings:
            assert g == w, (
                f"step {step}: got token {g}, HF {w}; HF's top-2 margin is "
                f"{margin:.1f} bfloat16 spacings (> {tie_spacings}: not a near-tie); "
                f"got {got}, HF {want}"
            )
            continue
        ties += 1
        near = torch.nonzero(row >= top2[0] - tie_spacings * spacing).flatten()
        tied = sorted(int(t) for t in near)
        assert g in tied, (
            f"step {step}: near-tie (margin {margin:.2f} spacings) between tokens "
            f"{tied}, but got token {g}; got {got}, HF {want}"
        )
        if g != w:
            return GreedyMatch(ties, step, margin)
    return GreedyMatch(ties, None, None)


def hf_greedy_steps(
    model_dir: str, prompt: list[int], max_new_tokens: int, dtype: torch.dtype
) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation in ``dtype`` and its ``[steps, vocab]`` logits."""
    model = load_hf_model_dtype(model_dir, dtype)
    out = _generate(model, prompt, max_new_tokens)
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat([step.float() for step in out.logits], dim=0)


@functools.cache
def load_hf_model_dtype(model_dir: str, dtype: torch.dtype) -> Any:
    """The causal LM in ``dtype`` (eager attention, eos disabled)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    return model


@dataclass
class Bf16Tally:
    """The bfloat16 comparisons of one test module, for its summary line."""

    label: str
    cases: list[tuple[str, GreedyMatch]] = field(default_factory=list)

    def add(self, case: str, match: GreedyMatch) -> None:
        self.cases.append((case, match))

    def summary(self) -> str:
        needed = [c for c, m in self.cases if m.needed_tolerance]
        with_ties = sum(1 for _, m in self.cases if m.ties)
        return (
            f"bfloat16 near-tie tally, {self.label}: {len(self.cases)} cases compared "
            f"with HF (tolerance: top-2 margin <= {BF16_TIE_SPACINGS:g} bfloat16 "
            f"spacings); {len(needed)} needed the tolerance {needed}; "
            f"{with_ties} met a near-tie where both sides picked the same token"
        )

    def report(self, config: Any) -> None:
        """Print the summary line past pytest's output capture. In a
        pytest-xdist worker, whose terminal nobody reads, the line goes to the
        controller with the report of the test being torn down
        (``tests/conftest.py``), which prints it."""
        if hasattr(config, "workerinput"):
            PENDING_SUMMARIES.append(self.summary())
            return
        write_summary(config, self.summary())


# Summary lines of an xdist worker waiting for the next test report
# (``tests/conftest.py`` moves them into its ``user_properties``).
PENDING_SUMMARIES: list[str] = []


def write_summary(config: Any, line: str) -> None:
    """One line on pytest's terminal, past its output capture."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)
