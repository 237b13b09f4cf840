"""The plugin's Mllama vision encoder against transformers' ``MllamaVisionModel``.

Both run the tiny Mllama's vision weights (``models/tiny-mllama``) on Pillow-made
images of several aspect ratios (1 to 4 tiles of the 4 the model takes). The
plugin's ``forward`` fills a preallocated ``encoder_states`` buffer (eager) or
builds it with one ``cat`` (graph mode), layer-major and with each tile's padding
rows; ``hf_layout`` cuts the padding rows and reorders the columns to HF's for the
comparison. ``forward_stacked`` keeps HF's tuple-and-stack order of work. A
dispatch mode records the aten ops each path runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.mm_reference import make_image
from vllm_hpu_mm.models.mllama.vision import (
    MllamaProjector,
    MllamaVisionEncoder,
    feature_order,
    tile_attention_bias,
)

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
    """Records (op, tensor args, output) of every aten op run under it, views
    (which move no data) left out."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
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


def hf_layout(encoder: MllamaVisionEncoder, states: torch.Tensor) -> torch.Tensor:
    """[N, tiles, padded, D] layer-major -> HF's [N, tiles, patches, D]."""
    # ours[..., j] is HF's column order[j]: HF's column c is ours[..., argsort[c]].
    order = feature_order(encoder.hidden, len(encoder.intermediate))
    return states[:, :, : encoder.num_patches][..., torch.argsort(order)]


def test_feature_order_matches_stack_then_flatten() -> None:
    hidden, k = 3, 2
    layers = [torch.arange(hidden) + 10 * (1 + j) for j in range(k)]
    final = torch.arange(hidden)
    hf = torch.cat([final, torch.stack(layers, dim=-1).flatten()])  # HF's order
    ours = torch.cat([final, *layers])  # layer-major
    assert torch.equal(ours, hf[feature_order(hidden, k)])


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
    assert out is buf
    torch.testing.assert_close(hf_layout(encoder, out), reference, atol=ATOL, rtol=RTOL)


def test_graph_mode_form_equals_the_buffer(
    models: Any, pixels: dict[str, torch.Tensor]
) -> None:
    """No buffer in (graph mode's form): the same tensor, made by one cat."""
    _, encoder = models
    n = len(IMAGES)
    buf = encoder.new_states(n, torch.device("cpu"), torch.float32)
    with torch.no_grad(), _Ops() as ops:
        made = encoder(*_inputs(pixels, list(range(n))))
    with torch.no_grad():
        filled = encoder(*_inputs(pixels, list(range(n))), buf)
    assert made.is_contiguous() and made.shape == buf.shape
    assert torch.equal(made, filled)
    cats = [tuple(out.shape) for _, _, out in ops.of(torch.ops.aten.cat)]
    rows = encoder.tiles * encoder.padded
    assert (n, rows, encoder.output_dim) in cats  # the buffer: one cat
    assert not ops.of(torch.ops.aten.stack)
    assert not ops.of(torch.ops.aten.copy_)


def test_projector_reads_the_layout_as_hf_does(
    models: Any, pixels: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    """The checkpoint's projector weight, loaded through the permuting loader,
    gives HF's projection of HF's layout on the real rows."""
    _, encoder = models
    gen = torch.Generator().manual_seed(0)
    hf_proj = torch.nn.Linear(encoder.output_dim, 48)
    with torch.no_grad():
        hf_proj.weight.copy_(torch.randn(hf_proj.weight.shape, generator=gen))
    proj = MllamaProjector(encoder.output_dim, 48, encoder.hidden)
    proj.weight.weight_loader(proj.weight, hf_proj.weight.detach())  # type: ignore[attr-defined]
    with torch.no_grad():
        proj.bias.copy_(hf_proj.bias)
        n = len(IMAGES)
        states = encoder(*_inputs(pixels, list(range(n))))
        got = proj(states)[:, :, : encoder.num_patches]
        torch.testing.assert_close(got, hf_proj(reference), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="checkpoint shape"):
        proj.weight.weight_loader(proj.weight, hf_proj.weight[:, 1:])  # type: ignore[attr-defined]


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
    got = hf_layout(encoder, out)[0]
    torch.testing.assert_close(got, reference[i], atol=ATOL, rtol=RTOL)


def test_forward_fills_a_view_of_the_largest_buffer(
    models: Any, pixels: dict[str, torch.Tensor]
) -> None:
    _, encoder = models
    full = encoder.new_states(8, torch.device("cpu"), torch.float32)
    buf = full[:3]  # the runner passes the first rows of its largest buffer
    assert buf.is_contiguous()  # what the projector's matmul reads as is
    with torch.no_grad():
        out = encoder(*_inputs(pixels, [0, 1, 2]), buf)
    assert out.data_ptr() == full.data_ptr()
    assert out.shape == (3, encoder.tiles, encoder.padded, encoder.output_dim)
    assert out.is_contiguous()


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
    # Each kept layer and the global output are written once into the buffer,
    # one layer's worth each: nothing copies the buffer or a slice of it.
    storage = buf.untyped_storage().data_ptr()
    layer = (n, encoder.tiles * encoder.padded, encoder.hidden)
    writes = [c for c in ops.calls if c[1] and _in(c[1][0], storage)]
    assert [c[0] for c in writes] == [torch.ops.aten.copy_] * (k + 1)
    for _, args, _ in writes:
        assert tuple(args[0].shape) == tuple(args[1].shape) == layer
    for _, args, _ in ops.calls:
        reads = [a for a in args[1:] if isinstance(a, torch.Tensor)]
        assert not any(_in(a, storage) for a in reads)


def _in(t: Any, storage: int) -> bool:
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage


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
        assert torch.isfinite(out).all()  # padding rows included
        got = hf_layout(encoder, out)[:2]
        torch.testing.assert_close(got, reference[real], atol=ATOL, rtol=RTOL)
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
