"""Mllama (Llama 3.2 Vision) for vLLM's V1 engine, run by the plugin's runner.

Text model: Llama self-attention layers (vLLM's ``LlamaDecoderLayer`` on the
plugin's paged attention) interleaved with gated cross-attention layers that
read image K/V from the plugin's cross-attention cache (``hpu_mm::cross_attention``).
Vision model: ``vision.MllamaVisionEncoder`` (``encoder_states`` in the layout
the projector reads), replicated on every rank under tensor parallelism.

The runner (``worker.cross_attention``) encodes each image once, when its request
arrives: ``encode_images`` runs the vision encoder and the projector, and
``write_cross_kv`` stores every cross-attention layer's K/V of the images in
their cache slots. The forward pass then needs only token ids and positions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.utils import AutoWeightsLoader
from vllm.multimodal import MULTIMODAL_REGISTRY

from hpu_kernels.cross_attention import CrossCache, write_cross_kv
from vllm_hpu_mm.attention.cross import cross_attention, cross_layer_registry
from vllm_hpu_mm.models.checkpoint_files import model_path_of
from vllm_hpu_mm.models.mllama import weights as weights_lib
from vllm_hpu_mm.models.mllama.processing import (
    IMAGE_TOKEN,
    MllamaDummyInputsBuilder,
    MllamaMultiModalProcessor,
    MllamaProcessingInfo,
)
from vllm_hpu_mm.models.mllama.vision import MllamaProjector, MllamaVisionEncoder
from vllm_hpu_mm.multimodal.token_ids import require_image_token_id


class MllamaCrossAttention(nn.Module):
    """Gated cross-attention of text tokens over the images' cached K/V.

    Under tensor parallelism each rank holds ``heads / tp`` query heads and
    ``kv heads / tp`` KV heads (column-parallel q/k/v, as vLLM's Llama shards its
    self-attention; a row-parallel ``o_proj`` sums the ranks' outputs), and its
    cross-attention cache only its own KV heads.
    """

    def __init__(self, config: Any, layer_name: str, registry: dict) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        tp = get_tensor_model_parallel_world_size()
        total_heads = int(config.num_attention_heads)
        total_kv = int(config.num_key_value_heads)
        if total_heads % tp or total_kv % tp:
            raise ValueError(
                f"Mllama cross-attention: {total_heads} query and {total_kv} KV "
                f"heads cannot be split over --tensor-parallel-size {tp} (both "
                f"must be multiples of it)"
            )
        self.num_heads, self.num_kv_heads = total_heads // tp, total_kv // tp
        self.head_dim = hidden // total_heads
        self.scale = self.head_dim**-0.5
        d = self.head_dim
        p = layer_name
        self.q_proj = ColumnParallelLinear(
            hidden, total_heads * d, bias=False, prefix=f"{p}.q_proj"
        )
        self.k_proj = ColumnParallelLinear(
            hidden, total_kv * d, bias=False, prefix=f"{p}.k_proj"
        )
        self.v_proj = ColumnParallelLinear(
            hidden, total_kv * d, bias=False, prefix=f"{p}.v_proj"
        )
        self.o_proj = RowParallelLinear(
            total_heads * d, hidden, bias=False, prefix=f"{p}.o_proj"
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.layer_name = layer_name
        # K, V [slots, rows, kv heads of this rank, head]; bound by the runner.
        self.cache = CrossCache(torch.empty(0), torch.empty(0))
        cross_layer_registry(registry, layer_name, self)

    def image_kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """states [N, rows, hidden] -> keys, values [N, rows, kv heads, head]."""
        n, rows, _ = states.shape
        shape = (n, rows, self.num_kv_heads, self.head_dim)
        key = self.k_norm(self.k_proj(states)[0].view(shape))
        return key, self.v_proj(states)[0].view(shape)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = hidden.shape[0]
        q = self.q_proj(hidden)[0].view(t, self.num_heads, self.head_dim)
        out, active, mlp_scale = cross_attention(self.q_norm(q), self.layer_name)
        return self.o_proj(out)[0], active, mlp_scale


class MllamaCrossAttentionDecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, registry: dict) -> None:
        super().__init__()
        self.cross_attn = MllamaCrossAttention(config, f"{prefix}.cross_attn", registry)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = LlamaMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            prefix=f"{prefix}.mlp",
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn, active, mlp_scale = self.cross_attn(self.input_layernorm(x))
        h = x + self.cross_attn_attn_gate.tanh() * attn
        m = self.mlp(self.post_attention_layernorm(h)) * mlp_scale
        h = h + self.cross_attn_mlp_gate.tanh() * m
        # Requests without images skip the layer, as in transformers.
        return torch.where(active > 0, h, x)


class MllamaTextModel(nn.Module):
    # q/k/v and gate/up of the checkpoint go into vLLM's fused projections.
    hf_to_vllm_mapper = weights_lib.TEXT_MAPPER

    def __init__(self, vllm_config: VllmConfig, config: Any, prefix: str) -> None:
        super().__init__()
        registry = vllm_config.compilation_config.static_forward_context
        self.cross_layer_ids = [int(i) for i in config.cross_attention_layers]
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size + 8, config.hidden_size
        )
        layers: list[nn.Module] = []
        for i in range(config.num_hidden_layers):
            p = f"{prefix}.layers.{i}"
            if i in self.cross_layer_ids:
                layers.append(MllamaCrossAttentionDecoderLayer(config, p, registry))
            else:
                layers.append(LlamaDecoderLayer(vllm_config, prefix=p, config=config))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            if isinstance(layer, MllamaCrossAttentionDecoderLayer):
                h = layer(h)
            else:
                out, residual = layer(positions, h, None)
                h = out + residual
        return self.norm(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


class MllamaModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.vision_model = MllamaVisionEncoder(config.vision_config)
        self.language_model = MllamaTextModel(
            vllm_config, config.text_config, f"{prefix}.language_model"
        )
        # Replicated on every rank, as the vision encoder (docs/architecture.md).
        self.multi_modal_projector = MllamaProjector(
            config.vision_config.vision_output_dim,
            config.text_config.hidden_size,
            self.vision_model.hidden,
        )


@MULTIMODAL_REGISTRY.register_processor(
    MllamaMultiModalProcessor,
    info=MllamaProcessingInfo,
    dummy_inputs=MllamaDummyInputsBuilder,
)
class MllamaForConditionalGeneration(nn.Module, SupportsMultiModal):
    """Out-of-tree Mllama; needs the plugin's runner (cross-attention cache)."""

    uses_cross_attention_cache: ClassVar[bool] = True
    # Published checkpoints (and save_pretrained) -> this model's module names.
    hf_to_vllm_mapper = weights_lib.LAYOUT_MAPPER
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return IMAGE_TOKEN
        raise ValueError(f"Mllama takes images, not {modality!r}")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = MllamaModel(vllm_config, "model")
        text = config.text_config
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.image_token_id = require_image_token_id(config)

    # ---- what the runner calls -----------------------------------------------------
    @property
    def vision(self) -> MllamaVisionEncoder:
        return self.model.vision_model

    def cross_attention_layers(self) -> list[MllamaCrossAttention]:
        return [
            layer.cross_attn
            for layer in self.model.language_model.layers
            if isinstance(layer, MllamaCrossAttentionDecoderLayer)
        ]

    def encode_images(
        self,
        pixel_values: torch.Tensor,
        aspect_ratio_ids: torch.Tensor,
        aspect_ratio_mask: torch.Tensor,
        encoder_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Vision encoder + projector: [N, tiles * padded rows, text hidden].

        ``encoder_states`` (eager): the buffer the encoder fills; None in graph
        mode, where the graph produces it. The projector reads it whole (padding
        rows included, contiguous: no copy); the cross-attention kernels skip
        the padding rows.
        """
        feats = self.vision(
            pixel_values, aspect_ratio_ids, aspect_ratio_mask, encoder_states
        )
        out = self.model.multi_modal_projector(feats)  # [N, tiles, padded, hidden]
        return out.view(out.shape[0], -1, out.shape[-1])

    def write_cross_kv(self, states: torch.Tensor, slots: torch.Tensor) -> None:
        """Store every cross-attention layer's K/V of the images in ``slots``."""
        for layer in self.cross_attention_layers():
            write_cross_kv(layer.cache, slots, *layer.image_kv(states))

    # ---- vLLM model interface ------------------------------------------------------
    def embed_multimodal(self, **kwargs: object) -> Any:
        raise RuntimeError(
            "Mllama images are read by cross-attention, not merged as embeddings; "
            "run it with the vllm-hpu-mm runner"
        )

    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        return self.model.language_model.embed_tokens(input_ids)

    def get_language_model(self) -> Any:
        return self.model.language_model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("Mllama takes token ids, not input embeddings")
        return self.model.language_model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the published layout or transformers' module names alike."""
        params = {name for name, _ in self.named_parameters()}
        path = model_path_of(self.config)
        loaded = AutoWeightsLoader(self).load_weights(
            weights_lib.checked(weights, params, path), mapper=self.hf_to_vllm_mapper
        )
        weights_lib.check_complete(loaded, params, path)
        return loaded
