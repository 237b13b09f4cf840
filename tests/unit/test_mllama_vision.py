"""The plugin's Mllama vision encoder against transformers' ``MllamaVisionModel``.

Both run the tiny Mllama's vision weights (``models/tiny-mllama``) on Pillow-made
images of several aspect ratios (1 to 4 tiles of the 4 the model takes). The
plugin's ``forward`` writes into a preallocated ``encoder_states`` buffer and
returns a view of it; ``forward_stacked`` keeps HF's tuple-and-stack order of
work. A dispatch mode records the aten ops each path runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.mm_reference import make_image
from vllm_hpu_mm.models.mllama.vision import MllamaVisionEncoder, tile_attention_bias

PREFIX = "model.vision_model."
ATOL = RTOL = 1e-4

# (kind, (width, height)): tile grids 1x1, 1x2, 2x1, 3x1 and 2x2 of 32x32 tiles.
IMAGES = [
    ("gradient", (32, 32)),
    ("checkerboard", (64, 30)),
    ("stripes", (30, 64)),
    ("solid", (20, 90)),
    ("gradient", (70, 66)),
]


class _Ops(TorchDispatchMode):
    """Records (op, tensor args, output) of every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.calls.append((func.overloadpacket, args, out))
        return out

    def of(self, op: Any) -> list[tuple[Any, tuple[Any, ...], Any]]:
        return [c for c in self.calls if c[0] is op]


@pytest.fixture(scope="module")
def models(tiny_mllama_dir: str) -> tuple[Any, MllamaVisionEncoder]:
    """(HF ``MllamaVisionModel``, plugin encoder with the same weights)."""
    from transformers import MllamaForConditionalGeneration

    hf = MllamaForConditionalGeneration.from_pretrained(
        tiny_mllama_dir, dtype=torch.float32
    ).eval()
    weights = {
        k[len(PREFIX) :]: v for k, v in hf.state_dict().items() if k.startswith(PREFIX)
    }
    encoder = MllamaVisionEncoder(hf.config.vision_config).eval()
    encoder.load_state_dict(weights, strict=True)
    return hf.model.vision_model, encoder


@pytest.fixture(scope="module")
def pixels(tiny_mllama_dir: str) -> dict[str, torch.Tensor]:
    """HF image processor output for ``IMAGES``, one image per batch entry."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_mllama_dir)
    images = [
        make_image(kind, size, variant=i) for i, (kind, size) in enumerate(IMAGES)
    ]
    out = processor.image_processor(images=[[im] for im in images], return_tensors="pt")
    return {
        "pixel_values": out["pixel_values"],  # [N, 1, tiles, 3, 32, 32]
        "aspect_ratio_ids": out["aspect_ratio_ids"],  # [N, 1]
        "aspect_ratio_mask": out["aspect_ratio_mask"],  # [N, 1, tiles]
        "num_tiles": torch.tensor([n[0] for n in out["num_tiles"]]),
    }


@pytest.fixture(scope="module")
def reference(models: Any, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's last_hidden_state, [N, tiles, patches, output_dim]."""
    hf, _ = models
    with torch.no_grad():
        out = hf(
            pixels["pixel_values"],
            pixels["aspect_ratio_ids"],
            pixels["aspect_ratio_mask"],
        ).last_hidden_state
    return out[:, 0]


def _inputs(
    pixels: dict[str, torch.Tensor], idx: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plugin's per-image layout (no media axis) for the images ``idx``."""
    sel = torch.tensor(idx)
    return (
        pixels["pixel_values"][sel, 0],
        pixels["aspect_ratio_ids"][sel, 0],
        pixels["aspect_ratio_mask"][sel, 0],
    )


def test_images_cover_every_tile_count(pixels: dict[str, torch.Tensor]) -> None:
    assert sorted(set(pixels["num_tiles"].tolist())) == [1, 2, 3, 4]
    # 1x2 and 2x1 have the same tile count but different aspect-ratio ids.
    assert len(set(pixels["aspect_ratio_ids"][:, 0].tolist())) == len(IMAGES)


def test_forward_matches_hf(
    models: Any, pixels: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    _, encoder = models
    n = len(IMAGES)
    buf = encoder.new_states(n, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = encoder(*_inputs(pixels, list(range(n))), buf)
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)


def test_forward_stacked_matches_hf(
    models: Any, pixels: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    _, encoder = models
    with torch.no_grad():
        out = encoder.forward_stacked(*_inputs(pixels, list(range(len(IMAGES)))))
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("i", range(len(IMAGES)))
def test_single_image_matches_hf(
    models: Any, pixels: dict[str, torch.Tensor], reference: torch.Tensor, i: int
) -> None:
    _, encoder = models
    buf = encoder.new_states(1, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = encoder(*_inputs(pixels, [i]), buf)
    torch.testing.assert_close(out[0], reference[i], atol=ATOL, rtol=RTOL)


def test_forward_returns_a_view_of_the_buffer(
    models: Any, pixels: dict[str, torch.Tensor]
) -> None:
    _, encoder = models
    full = encoder.new_states(8, torch.device("cpu"), torch.float32)
    buf = full[:3]  # the runner passes the first rows of its largest buffer
    with torch.no_grad():
        out = encoder(*_inputs(pixels, [0, 1, 2]), buf)
    assert out.data_ptr() == full.data_ptr()
    assert out.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert out.shape == (3, encoder.tiles, encoder.num_patches, encoder.output_dim)
    assert out.stride() == buf.stride()
    # A write through the buffer shows in the returned tensor.
    full[1, 2, 3, 4] = 12345.0
    assert out[1, 2, 3, 4].item() == 12345.0


def test_preallocated_path_runs_no_stack_and_no_cat_of_states(
    models: Any, pixels: dict[str, torch.Tensor]
) -> None:
    _, encoder = models
    n, k = 2, len(encoder.intermediate)
    buf = encoder.new_states(n, torch.device("cpu"), torch.float32)
    with torch.no_grad(), _Ops() as ops:
        encoder(*_inputs(pixels, [1, 4]), buf)
    assert not ops.of(torch.ops.aten.stack)
    # The only concatenation is the CLS row in front of each tile's patches.
    cats = ops.of(torch.ops.aten.cat)
    assert [tuple(out.shape) for _, _, out in cats] == [
        (n * encoder.tiles, encoder.num_patches, encoder.hidden)
    ]
    # Every kept layer is written in place into the buffer, one index_copy_ each.
    copies = ops.of(torch.ops.aten.index_copy_)
    assert len(copies) == k
    storage = buf.untyped_storage().data_ptr()
    for _, args, _ in copies:
        assert args[0].untyped_storage().data_ptr() == storage


def test_stacked_path_runs_a_stack(
    models: Any, pixels: dict[str, torch.Tensor]
) -> None:
    """The dispatch-mode check above can see a stack and a cat when there is one."""
    _, encoder = models
    n, k = 2, len(encoder.intermediate)
    with torch.no_grad(), _Ops() as ops:
        encoder.forward_stacked(*_inputs(pixels, [1, 4]))
    stacks = ops.of(torch.ops.aten.stack)
    assert len(stacks) == 1
    assert len(stacks[0][1][0]) == k
    cat_shapes = [tuple(out.shape) for _, _, out in ops.of(torch.ops.aten.cat)]
    assert (n, encoder.tiles, encoder.num_patches, encoder.output_dim) in cat_shapes


def test_padded_batch_entry_does_not_change_real_entries(
    models: Any, pixels: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    """A bucket of 4 holding 2 images: the runner repeats the last image."""
    _, encoder = models
    real = [0, 3]
    outs = []
    for pad in ([3, 3], [4, 2], [1, 1]):  # repeated last image, then others
        buf = encoder.new_states(4, torch.device("cpu"), torch.float32)
        buf.fill_(float("nan"))  # stale content must not leak into the result
        with torch.no_grad():
            out = encoder(*_inputs(pixels, real + pad), buf)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:2], reference[real], atol=ATOL, rtol=RTOL)
        outs.append(out[:2].clone())
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_patches", "padded"), [(17, 24), (16, 16), (9, 16)])
def test_tile_attention_bias_matches_hf(num_patches: int, padded: int) -> None:
    from transformers.models.mllama.modeling_mllama import (
        _prepare_aspect_ratio_attention_mask,
    )

    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    got = tile_attention_bias(mask, num_patches, padded, torch.float32)
    want = _prepare_aspect_ratio_attention_mask(
        mask, num_patches=num_patches, target_length=padded, dtype=torch.float32
    )
    assert torch.equal(got, want)
