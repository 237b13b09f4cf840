"""Mllama's vision encoder, producing one ``encoder_states`` tensor per batch.

HF's encoder keeps every local layer's output in a tuple, stacks the selected
intermediate layers (``intermediate_layers_indices``) on a new last axis and
concatenates them after the final hidden state, with the padding rows of each
tile cut off: its projector input is ``[images, tiles, patches, hidden * (1 + K)]``
with feature ``hidden + d * K + k`` holding dimension ``d`` of kept layer ``k``.

Here ``encoder_states`` is ``[images, tiles, padded rows, hidden * (1 + K)]``,
layer-major: columns ``[0, hidden)`` hold the global encoder's output and
``[(1 + k) * hidden, (2 + k) * hidden)`` kept layer ``k`` (``feature_order`` maps
the columns to HF's; the projector's weight columns are permuted to match when
the checkpoint is loaded). It is what the projector consumes as is: contiguous,
padding rows included (the cross-attention kernels never read those rows), so
nothing is sliced or copied between the encoder and the cross-attention K/V.

- eager: the caller passes the buffer (the runner allocates one per images
  bucket); each kept layer's output is written into its column block as the
  layer finishes, the global output last. One write per element, no stack.
- graph mode: no buffer goes in; the compiled graph produces ``encoder_states``
  as its output with one ``cat`` of the kept layers' outputs. A mutated graph
  input would be functionalized into a ``slice_scatter`` of the whole buffer per
  write plus a copy back; a ``cat`` writes each element once.

``forward_stacked`` keeps HF's tuple-and-stack order of work (and HF's layout)
for the benchmark and the tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def rows_per_tile(num_patches: int) -> int:
    """Rows a tile occupies inside the encoder: patches + CLS, padded to 8."""
    return num_patches + (8 - num_patches % 8) % 8


def feature_order(hidden: int, kept: int) -> torch.Tensor:
    """[hidden * (1 + kept)] int64: column ``j`` of ``encoder_states`` holds HF's
    column ``feature_order(...)[j]`` (ours layer-major, HF's ``hidden + d * K + k``)."""
    # [kept, hidden] grid of HF column indices d * K + k, read row by row.
    inter = torch.arange(hidden * kept).view(hidden, kept).t().reshape(-1)
    return torch.cat([torch.arange(hidden), hidden + inter])


def tile_attention_bias(
    aspect_ratio_mask: torch.Tensor, num_patches: int, padded: int, dtype: torch.dtype
) -> torch.Tensor:
    """[N, 1, T*padded, T*padded] additive bias of the encoder's self-attention.

    Matches HF's rule: a row is "invalid" when its tile is padding or the row is
    a padding row; a pair is masked only when both rows are invalid. (HF marks
    every row invalid when no padding rows exist; kept for parity.)
    """
    n, tiles = aspect_ratio_mask.shape
    valid = aspect_ratio_mask.to(dtype).view(n, tiles, 1).expand(n, tiles, padded)
    valid = valid.clone()
    pad = padded - num_patches
    valid[:, :, padded - pad if pad else 0 :] = 0
    invalid = (1 - valid).reshape(n, tiles * padded, 1)
    bias = invalid @ invalid.transpose(-1, -2) * torch.finfo(dtype).min
    return bias.unsqueeze(1)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, s, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # bias [N, 1, S, S] additive; every query row has unmasked keys (tile 0).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(n, s, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int, eps: float, gated: bool):
        super().__init__()
        self.self_attn = VisionAttention(hidden, heads)
        self.mlp = VisionMLP(hidden, inter)
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), bias)
        x = x + (self.gate_attn.tanh() * h if self.gated else h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * h if self.gated else h)


class VisionStack(nn.Module):
    def __init__(self, n: int, hidden: int, heads: int, inter: int, eps: float,
                 gated: bool) -> None:  # fmt: skip
        super().__init__()
        self.layers = nn.ModuleList(
            VisionLayer(hidden, heads, inter, eps, gated) for _ in range(n)
        )


class AspectRatioEmbedding(nn.Module):
    """A gated per-tile embedding chosen by the image's aspect-ratio id."""

    def __init__(self, num_ids: int, tiles: int, hidden: int) -> None:
        super().__init__()
        self.tiles, self.hidden = tiles, hidden
        self.embedding = nn.Embedding(num_ids, tiles * hidden)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(ar_ids).view(-1, self.tiles, 1, self.hidden)
        return x + emb * self.gate.tanh()


class PositionEmbedding(nn.Module):
    """Per-row position embedding, blended by a gate with a per-tile one."""

    def __init__(self, num_ids: int, tiles: int, patches: int, hidden: int) -> None:
        super().__init__()
        self.tiles, self.patches, self.hidden = tiles, patches, hidden
        self.embedding = nn.Parameter(torch.zeros(patches, hidden))
        self.gate = nn.Parameter(torch.zeros(1))
        self.tile_embedding = nn.Embedding(num_ids, tiles * patches * hidden)

    def forward(self, x: torch.Tensor, ar_ids: torch.Tensor) -> torch.Tensor:
        g = self.gate.tanh()
        x = x + ((1 - g) * self.embedding).view(1, 1, self.patches, self.hidden)
        tile = self.tile_embedding(ar_ids).view(
            -1, self.tiles, self.patches, self.hidden
        )
        return x + g * tile


class MllamaVisionEncoder(nn.Module):
    """Parameter names follow transformers' ``MllamaVisionModel``."""

    def __init__(self, config: object) -> None:
        super().__init__()
        c: Any = config
        hidden = int(c.hidden_size)
        self.hidden = hidden
        self.tiles = int(c.max_num_tiles)
        patch = int(c.patch_size)
        self.tile_size = int(c.image_size)
        self.num_patches = (int(c.image_size) // patch) ** 2 + 1
        self.padded = rows_per_tile(self.num_patches)
        self.intermediate = [int(i) for i in c.intermediate_layers_indices]
        num_ids = len(c.supported_aspect_ratios) + 1
        heads, inter = int(c.attention_heads), int(c.intermediate_size)
        eps = float(c.norm_eps)

        self.patch_embedding = nn.Conv2d(
            int(c.num_channels),
            hidden,
            patch,
            stride=patch,
            bias=False,
        )
        self.class_embedding = nn.Parameter(torch.zeros(hidden))
        self.gated_positional_embedding = PositionEmbedding(
            num_ids, self.tiles, self.num_patches, hidden
        )
        self.pre_tile_positional_embedding = AspectRatioEmbedding(
            num_ids, self.tiles, hidden
        )
        self.post_tile_positional_embedding = AspectRatioEmbedding(
            num_ids, self.tiles, hidden
        )
        self.layernorm_pre = nn.LayerNorm(hidden)
        self.layernorm_post = nn.LayerNorm(hidden)
        self.transformer = VisionStack(
            int(c.num_hidden_layers),
            hidden,
            heads,
            inter,
            eps,
            gated=False,
        )
        self.global_transformer = VisionStack(
            int(c.num_global_layers),
            hidden,
            heads,
            inter,
            eps,
            gated=True,
        )

    @property
    def output_dim(self) -> int:
        return self.hidden * (1 + len(self.intermediate))

    def new_states(
        self, num_images: int, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """An ``encoder_states`` buffer for ``num_images`` images."""
        return torch.empty(
            num_images,
            self.tiles,
            self.padded,
            self.output_dim,
            device=device,
            dtype=dtype,
        )

    # ---- shared front and back ------------------------------------------------------
    def _embed(
        self, pixel_values: torch.Tensor, ar_ids: torch.Tensor, ar_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, t = pixel_values.shape[:2]
        x = self.patch_embedding(
            pixel_values.flatten(0, 1).to(self.class_embedding.dtype)
        )
        x = x.flatten(2).transpose(1, 2)  # [n*t, patches-1, hidden]
        x = self.pre_tile_positional_embedding(x.view(n, t, -1, self.hidden), ar_ids)
        cls = self.class_embedding.expand(n * t, 1, self.hidden)
        x = torch.cat([cls, x.view(n * t, -1, self.hidden)], dim=1)
        x = self.gated_positional_embedding(x.view(n, t, -1, self.hidden), ar_ids)
        x = self.layernorm_pre(x)
        x = F.pad(x, (0, 0, 0, self.padded - self.num_patches))
        bias = tile_attention_bias(ar_mask, self.num_patches, self.padded, x.dtype)
        return x.view(n, t * self.padded, self.hidden), bias

    def _global(
        self, x: torch.Tensor, ar_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        x = self.layernorm_post(x).view(n, self.tiles, self.padded, self.hidden)
        x = self.post_tile_positional_embedding(x, ar_ids)
        x = x.view(n, self.tiles * self.padded, self.hidden)
        for layer in self.global_transformer.layers:
            x = layer(x, bias)
        return x

    # ---- the two ways of keeping the intermediate states ----------------------------
    def forward(
        self,
        pixel_values: torch.Tensor,  # [N, tiles, C, H, W]
        aspect_ratio_ids: torch.Tensor,  # [N]
        aspect_ratio_mask: torch.Tensor,  # [N, tiles]
        encoder_states: torch.Tensor | None = None,  # [N, tiles, padded, output_dim]
    ) -> torch.Tensor:
        """``encoder_states`` [N, tiles, padded rows, output_dim], layer-major.

        Given (eager), it is filled in place and returned; None (graph mode), it
        is built by one ``cat`` and returned as the graph's output.
        """
        n = pixel_values.shape[0]
        x, bias = self._embed(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        kept: dict[int, torch.Tensor] = {}  # layer index -> its output
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, bias)  # [N, tiles * padded, hidden]
            if i not in self.intermediate:
                continue
            if encoder_states is None:
                kept[i] = x
                continue
            for k in (k for k, j in enumerate(self.intermediate) if j == i):
                self._block(encoder_states, 1 + k).copy_(x)
        x = self._global(x, aspect_ratio_ids, bias)
        if encoder_states is None:
            parts = [x, *(kept[i] for i in self.intermediate)]
            out = torch.cat(parts, dim=-1)  # [N, tiles * padded, output_dim]
            return out.view(n, self.tiles, self.padded, self.output_dim)
        self._block(encoder_states, 0).copy_(x)
        return encoder_states

    def _block(self, states: torch.Tensor, b: int) -> torch.Tensor:
        """[N, tiles * padded, hidden] view of column block ``b`` of ``states``."""
        rows = states.view(states.shape[0], self.tiles * self.padded, -1)
        return rows[..., b * self.hidden : (b + 1) * self.hidden]

    def forward_stacked(
        self,
        pixel_values: torch.Tensor,
        aspect_ratio_ids: torch.Tensor,
        aspect_ratio_mask: torch.Tensor,
    ) -> torch.Tensor:
        """The tuple-and-stack baseline (HF's order of work and layout):
        [N, tiles, patches, output_dim], padding rows cut off."""
        n = pixel_values.shape[0]
        x, bias = self._embed(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        states: tuple[torch.Tensor, ...] = ()
        for layer in self.transformer.layers:
            x = layer(x, bias)
            states = (*states, x)
        x = self._global(x, aspect_ratio_ids, bias)
        x = x.view(n, self.tiles, self.padded, self.hidden)[:, :, : self.num_patches]
        kept = torch.stack([states[i] for i in self.intermediate], dim=-1)
        kept = kept.view(n, self.tiles, self.padded, -1)[:, :, : self.num_patches]
        return torch.cat([x, kept], dim=-1)


class MllamaProjector(nn.Linear):
    """``multi_modal_projector``: [..., output_dim] layer-major -> [..., text hidden].

    Checkpoints hold HF's weight, whose columns follow HF's feature order; its
    ``weight_loader`` permutes them to ``encoder_states``' layer-major columns
    (``feature_order``), so the projector reads the buffer as it is.
    """

    def __init__(self, in_features: int, out_features: int, hidden: int) -> None:
        super().__init__(in_features, out_features)
        kept = in_features // hidden - 1
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        self.columns: torch.Tensor
        self.register_buffer("columns", feature_order(hidden, kept), persistent=False)

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(
                f"multi_modal_projector.weight: checkpoint shape "
                f"{tuple(loaded.shape)}, model {tuple(param.shape)}"
            )
        with torch.no_grad():
            cols = self.columns.to(loaded.device)
            param.copy_(loaded.index_select(1, cols))
