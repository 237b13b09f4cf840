"""The refined head (``hpu_kernels.logits``): float32 logits for each row's top
candidates over a bfloat16 matmul, against float64 from the same bfloat16
inputs; and which precision a model gets (``worker.logits_head``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hpu_kernels.logits import REFINED_TOP, refined_logits
from vllm_hpu_mm.gaudi_sim.compiler import make_hpu_backend
from vllm_hpu_mm.worker.logits_head import head_precision


def _near_ties(rows: int = 2048, vocab: int = 96, hidden: int = 64) -> tuple:
    """Hidden states and head weights (bfloat16) whose logits sit around 20 with
    a spread of a few units: many rows have leaders closer than a bfloat16
    spacing (0.125 there)."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, hidden, generator=g) + 2.0).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) * 0.05 + 0.15).to(torch.bfloat16)
    bias = (torch.randn(vocab, generator=g) * 0.1).to(torch.bfloat16)
    return h, w, bias


def _exact(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = h.double() @ w.double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("with_bias", [False, True])
def test_greedy_choice_is_the_float64_one_where_bf16_rounding_flips_it(
    with_bias: bool,
) -> None:
    h, w, bias = _near_ties()
    b = bias if with_bias else None
    exact = _exact(h, w, b)
    plain = F.linear(h, w, b)
    flipped = (plain.float().argmax(-1) != exact.argmax(-1)).sum().item()
    # The inputs are meaningful: bfloat16 logits pick another token on some rows.
    assert flipped > 20, flipped
    refined = refined_logits(h, w, b)
    assert refined.dtype == torch.float32
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))


def test_top_candidates_carry_float32_values_the_rest_rounded_ones() -> None:
    h, w, bias = _near_ties(rows=64)
    exact = _exact(h, w, bias)
    refined = refined_logits(h, w, bias)
    plain = F.linear(h, w, bias).float()
    top = plain.topk(REFINED_TOP, -1).indices
    torch.testing.assert_close(
        refined.gather(-1, top).double(), exact.gather(-1, top), rtol=1e-6, atol=1e-5
    )
    rest = torch.ones_like(refined, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(refined[rest], plain[rest])
    # Top-k logprobs: as float64's to float32 rounding, up to the normalizer
    # (which sees the rounded tail).
    lp = torch.log_softmax(refined.double(), -1).gather(-1, top)
    ref = torch.log_softmax(exact, -1).gather(-1, top)
    assert (lp - ref).abs().max() < 0.02


def test_static_shapes_through_the_simulated_hpu_backend() -> None:
    """One graph of the head per row count, as the static plan compiles it."""
    h, w, bias = _near_ties(rows=16)
    compiled = torch.compile(
        refined_logits, backend=make_hpu_backend(lambda: False), dynamic=False
    )
    torch.testing.assert_close(compiled(h, w, bias), refined_logits(h, w, bias))


def _config(dtype: torch.dtype, named: str | None = None) -> SimpleNamespace:
    hf = SimpleNamespace() if named is None else SimpleNamespace(head_dtype=named)
    head = {None: dtype, "model": dtype, "float32": torch.float32}[named]
    return SimpleNamespace(dtype=dtype, head_dtype=head, hf_config=hf)


@pytest.mark.parametrize(
    ("dtype", "named", "want"),
    [
        (torch.bfloat16, None, "refined"),
        (torch.float16, None, "refined"),
        (torch.float32, None, "model"),
        (torch.bfloat16, "model", "model"),
        (torch.bfloat16, "float32", "float32"),
    ],
)
def test_precision_follows_vllms_head_dtype_when_named(
    dtype: torch.dtype, named: str | None, want: str
) -> None:
    assert head_precision(_config(dtype, named)) == want
