"""Prepacked bfloat16 linear weights on the CPU (``worker.cpu_linear``).

The reference is ``F.linear`` on the layer's own weight: the packed path must
give the same bits at decode sizes, the plain path is taken for more rows, a
weight reload repacks, and the op compiles with a symbolic row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_hpu_mm.worker import cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.supported(), reason="this CPU's torch has no bfloat16 oneDNN"
)


class _Layer(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, seed: int) -> None:
        super().__init__()
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(out_features, in_features, generator=gen) * 0.05
        self.weight = torch.nn.Parameter(w.bfloat16(), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Layer(96, 64, 0)
        self.b = _Layer(64, 96, 1)
        self.loads = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))

    def load_weights(self, scale: float) -> None:
        """Updates the weights in place, as a weight reload does."""
        self.loads += 1
        for layer in (self.a, self.b):
            layer.weight.data.mul_(scale)


def _reference(model: _Model, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.linear(x, model.a.weight), model.b.weight)


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 300])
def test_packed_layers_equal_f_linear_bit_for_bit(rows: int) -> None:
    model = _Model()
    assert cpu_linear.pack_linear_weights(model) == 2
    x = torch.randn(rows, 64).bfloat16()
    assert torch.equal(model(x), _reference(model, x))
    assert torch.equal(model(x[None]), _reference(model, x[None]))  # 3-D input


def test_only_decode_sized_calls_read_the_packed_weight() -> None:
    model = _Model()
    cpu_linear.pack_linear_weights(model)
    # Corrupt the packed copy: small calls change, large ones do not.
    model.a.hpu_mm_packed_weight = torch.ops.mkldnn._reorder_linear_weight(
        torch.zeros_like(model.a.weight), None
    )
    small = torch.randn(cpu_linear.PACKED_MAX_ROWS, 64).bfloat16()
    large = torch.randn(cpu_linear.PACKED_MAX_ROWS + 1, 64).bfloat16()
    assert not torch.equal(model(small), _reference(model, small))
    assert torch.equal(model(large), _reference(model, large))


def test_a_weight_reload_repacks() -> None:
    model = _Model()
    cpu_linear.pack_linear_weights(model)
    x = torch.randn(4, 64).bfloat16()
    before = model(x)
    model.load_weights(scale=2.0)
    assert model.loads == 1
    after = model(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _reference(model, x))
    # Packing twice does not wrap load_weights twice.
    cpu_linear.pack_linear_weights(model)
    model.load_weights(scale=0.5)
    assert model.loads == 2
    assert torch.equal(model(x), _reference(model, x))


def test_compiled_with_a_symbolic_row_count() -> None:
    model = _Model()
    cpu_linear.pack_linear_weights(model)
    compiled = torch.compile(model, backend="eager", dynamic=True, fullgraph=True)
    for rows in (2, 16, 200):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(compiled(x), _reference(model, x))


def test_other_layers_are_left_alone() -> None:
    model = _Model()
    model.a.weight = torch.nn.Parameter(model.a.weight.float(), requires_grad=False)
    assert cpu_linear.pack_linear_weights(model) == 1  # float32: not packed
    assert not hasattr(model.a, "hpu_mm_packed_weight")
    x = torch.randn(3, 64)
    out = model.a(x)
    assert torch.equal(out, F.linear(x, model.a.weight))
