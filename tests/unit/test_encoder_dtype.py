"""The encoder's dtype boundary: warmup compiles the encoder with inputs in the
model dtype; a request's pixel values arrive from the processor in float32 and
are cast where they enter the encoder, so serving reuses warmup's graph."""

from __future__ import annotations

import torch

from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.plan import build_plan
from vllm_hpu_mm.worker.graphs import GraphRunner
from vllm_hpu_mm.worker.multimodal import EncoderRunner, encoder_input, model_dtype


class TinyTower(torch.nn.Module):
    """A patch projection and a mean: ``embed_multimodal`` of a vision model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, 8)

    def embed_multimodal(
        self, pixel_values: torch.Tensor, image_sizes: torch.Tensor
    ) -> torch.Tensor:
        # pixel_values: [N, 4, 12] -> [N, 4, 8]; image_sizes: [N, 2] int64
        out = self.proj(pixel_values.to(self.proj.weight.dtype))
        return out * (image_sizes[:, :1, None] > 0)


def test_encoder_input_casts_floating_tensors_only() -> None:
    pix = torch.rand(2, 3)
    ids = torch.tensor([1, 2])
    mask = torch.tensor([True, False])
    assert encoder_input(pix, torch.bfloat16).dtype == torch.bfloat16
    assert encoder_input(ids, torch.bfloat16).dtype == torch.int64
    assert encoder_input(mask, torch.bfloat16).dtype == torch.bool
    assert encoder_input("not a tensor", torch.bfloat16) == "not a tensor"


def test_float32_request_reuses_the_graph_warmup_compiled_in_bf16() -> None:
    tower = TinyTower().to(torch.bfloat16).eval()
    assert model_dtype(tower) == torch.bfloat16
    static = HpuMMConfig(execution="static", graph_mode="compile")
    graphs = GraphRunner(tower, build_plan(static, "cpu", False), "eager")
    encoder = EncoderRunner(tower, graphs, max_items=2)
    sizes = torch.tensor([[32, 32], [32, 32]])
    with torch.inference_mode():
        # Warmup's dummy inputs, in the model dtype (as the Mllama warmup makes).
        warm = encoder(
            2,
            {
                "pixel_values": torch.zeros(2, 4, 12, dtype=torch.bfloat16),
                "image_sizes": sizes,
            },
        )
        compiled = graphs.compiles
        assert compiled >= 1
        # A request: float32 pixel values from the image processor.
        pix = torch.rand(2, 4, 12)
        out = encoder(2, {"pixel_values": pix, "image_sizes": sizes.clone()})
    assert graphs.compiles == compiled, "a float32 request compiled the encoder again"
    assert out[0].dtype == warm[0].dtype == torch.bfloat16
    want = tower.proj(pix.to(torch.bfloat16))
    torch.testing.assert_close(torch.stack(out), want)
