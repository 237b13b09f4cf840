"""What each tiny test model is: a config, added tokens, a processor, a seed.

``build_tiny_models`` turns a ``TinyModelSpec`` into a checkpoint (tokenizer,
random weights, ``save_pretrained``, stamp); this module holds only what differs
per model. All models share the tokenizer of ``tokenizer.py`` and, for the
vision-language models, the tiny Llama as text model. float32 throughout.

- ``tiny-llama``: Llama, GQA (4 query heads, 2 KV heads of 16).
- ``tiny-mistral``: the same with a 16-token sliding window.
- ``tiny-llava``: LLaVA, a CLIP tower (32x32 images, 8x8 patches: 16 patches +
  CLS), a two-layer GELU projector; ``<image>`` expands to 16 tokens.
  ``tiny-llava-released``: the same weights in the llava-hf layout.
- ``tiny-idefics3``: Idefics3 (SmolVLM), a SigLIP-like tower (32x32, 4x4 patches),
  pixel shuffle by 2 and a linear connector; each image is
  ``<fake_token_around_image><global-img>`` + 16 ``<image>`` +
  ``<fake_token_around_image>``. (PaliGemma would have been simpler, but vLLM
  treats it as a prefix LM with bidirectional image attention; Idefics3 is causal.)
- ``tiny-mllama``: Llama 3.2 Vision shaped like the 11B model, tiny: 32x32 tiles of
  8x8 patches, up to 4 tiles, 5 local vision layers with intermediate layers
  [1, 2, 4], 2 gated global layers; 5 text layers of which 1 and 3 are gated
  cross-attention layers, Llama 3 RoPE scaling; ``<|image|>`` has id ``text
  vocab_size`` (outside the LM head, inside the 8 extra embedding rows, as 128256
  in the real model). Its tanh gates get random non-zero values (transformers
  starts them at zero: an untrained model would ignore its images).

- ``tiny-qwen2_5-vl``: Qwen2.5-VL: a 4-block vision tower (2 windowed, 2 full
  attention) on 4x4 patches merged 2x2, dynamic resolution (images resized to
  multiples of 8 pixels, 64 to 4096 pixels: 1 to 64 ``<|image_pad|>`` tokens),
  M-RoPE (sections 2/3/3) in a Qwen2 text model of the tiny Llama's sizes; its
  processor is the PIL image processor plus the tokenizer (no video processor:
  transformers' is torchvision-based), saved as ``Qwen2_5_VLProcessor`` files.
- ``tiny-qwen3-vl``: Qwen3-VL the same way: 4 vision blocks (no windows, learned
  position embeddings), deep-stack features from blocks 0 and 2 added to the
  first two decoder layers; Qwen3 text model (q/k norms), interleaved M-RoPE.
- ``tiny-gemma3``: Gemma 3 (``Gemma3ForConditionalGeneration``): a SigLIP tower
  (32x32 images, 4x4 patches, average-pooled to 16 soft tokens), four text layers
  alternating sliding-window (12 tokens, shorter than an image) and global
  attention, untied embeddings. Each image is ``\\n\\n<start_of_image>`` + 16
  ``<image_soft_token>`` + ``<end_of_image>\\n\\n``; the soft tokens of one image
  attend to each other both ways. ``tiny-gemma3-released``: the same weights
  in the released layout (``vision_tower.vision_model.*``).

A new model is one more spec: its config function, the
tokens it adds, its processor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from tools import tokenizer as tk


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """One tiny model; ``build_tiny_models`` does the rest the same for all."""

    name: str  # directory name under --out
    seed: int
    model_class: str  # transformers class, instantiated from ``config``
    config: Callable[[Any], Any]  # tokenizer -> transformers config
    added_tokens: tuple[str, ...] = ()  # special tokens added to the shared ones
    plain_tokens: tuple[str, ...] = ()  # whole-string tokens that are not special
    # (attribute, token) pairs the tokenizer exposes (``tokenizer.boi_token``)
    named_tokens: tuple[tuple[str, str], ...] = ()
    chat_template: str = tk.CHAT_TEMPLATE
    processor: Callable[[Any], Any] | None = None  # tokenizer -> processor
    post_init: Callable[[Any, int], None] | None = None  # (model, seed) after init
    # Checkpoint name prefix changes from what save_pretrained writes to the
    # layout released checkpoints use; empty when the two are the same.
    released_layout: tuple[tuple[str, str], ...] = ()
    version: int = 1  # bump to rebuild existing copies


# Small, GQA (4 query heads, 2 KV heads of size 16). initializer_range is far
# above the usual 0.02 so that random logits are spread out: greedy decoding
# then moves from token to token instead of repeating one.
BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.25,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def _special_ids(tok: Any) -> dict[str, Any]:
    ids = tok.convert_tokens_to_ids
    return {
        "bos_token_id": ids(tk.BOS),
        "eos_token_id": [ids(tk.EOS), ids(tk.EOT)],
        "pad_token_id": ids(tk.PAD),
    }


def _text_config(config_cls: str, **extra: Any) -> Callable[[Any], Any]:
    """tokenizer -> ``config_cls`` of the tiny Llama (plus ``extra``)."""

    def build(tok: Any) -> Any:
        import transformers

        cls = getattr(transformers, config_cls)
        return cls(**BASE_CONFIG, **extra, **_special_ids(tok), vocab_size=len(tok),
                   dtype="float32")  # fmt: skip

    return build


def _llama_text(tok: Any) -> Any:
    return _text_config("LlamaConfig", architectures=["LlamaForCausalLM"])(tok)


# --- LLaVA ----------------------------------------------------------------------

LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_IMAGE_SIZE = 32
LLAVA_PATCH_SIZE = 8
LLAVA_FEATURE_SELECT: Literal["default", "full"] = "default"
# CLIP adds one CLS embedding; the "default" strategy drops it again.
LLAVA_NUM_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2
# transformers 5's CLIPVisionModel has no ``vision_model`` level (its loader
# strips the prefix), so save_pretrained writes ``vision_tower.*``; llava-hf
# checkpoints (and vLLM) say ``vision_tower.vision_model.*``.
LLAVA_RELEASED_LAYOUT = (("vision_tower.", "vision_tower.vision_model."),)


def _llava_config(tok: Any) -> Any:
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH_SIZE, num_channels=3,
        hidden_size=32, intermediate_size=64, projection_dim=32,
        num_hidden_layers=2, num_attention_heads=2, hidden_act="quick_gelu",
        layer_norm_eps=1e-5, dtype="float32",
    )  # fmt: skip
    return LlavaConfig(
        vision_config=vision,
        text_config=_llama_text(tok),
        image_token_index=tok.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        image_seq_length=LLAVA_NUM_IMAGE_TOKENS,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        vision_feature_layer=-2,
        vision_feature_select_strategy=LLAVA_FEATURE_SELECT,
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
        dtype="float32",
    )


def _llava_processor(tok: Any) -> Any:
    """``LlavaProcessor`` around the PIL CLIP image processor (no torchvision)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    size = LLAVA_IMAGE_SIZE
    return LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tok,
        patch_size=LLAVA_PATCH_SIZE,
        vision_feature_select_strategy=LLAVA_FEATURE_SELECT,
        num_additional_image_tokens=1,  # CLIP's CLS embedding
        chat_template=tok.chat_template,
        image_token=LLAVA_IMAGE_TOKEN,
    )


# --- Idefics3 -------------------------------------------------------------------

IDEFICS3_IMAGE_TOKEN = LLAVA_IMAGE_TOKEN  # "<image>", as in Idefics3Processor
IDEFICS3_FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IDEFICS3_GLOBAL_IMAGE_TOKEN = "<global-img>"
IDEFICS3_END_OF_UTTERANCE = "<end_of_utterance>"
# Tile tags of image splitting (off here); the released tokenizers have them.
_ROW_COL_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
IDEFICS3_IMAGE_SIZE = 32
IDEFICS3_PATCH_SIZE = 4
IDEFICS3_SCALE_FACTOR = 2
_IDEFICS3_PATCHES = (IDEFICS3_IMAGE_SIZE // IDEFICS3_PATCH_SIZE) ** 2  # 64
IDEFICS3_NUM_IMAGE_TOKENS = _IDEFICS3_PATCHES // IDEFICS3_SCALE_FACTOR**2  # 16
# Token ids of one image: <fake><global-img> <image>*16 <fake>.
IDEFICS3_NUM_PLACEHOLDER_TOKENS = IDEFICS3_NUM_IMAGE_TOKENS + 3


def _idefics3_config(tok: Any) -> Any:
    from transformers import Idefics3Config, Idefics3VisionConfig

    vision = Idefics3VisionConfig(
        image_size=IDEFICS3_IMAGE_SIZE, patch_size=IDEFICS3_PATCH_SIZE,
        num_channels=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        # As wide as the text model's: different images give clearly different
        # features (the default 0.02 leaves them nearly alike).
        initializer_range=BASE_CONFIG["initializer_range"], dtype="float32",
    )  # fmt: skip
    # pad_token_id goes through **kwargs (Idefics3Config.__post_init__ takes it,
    # with Idefics3-8B's 128002 as default).
    pad: dict[str, Any] = {"pad_token_id": tok.convert_tokens_to_ids(tk.PAD)}
    return Idefics3Config(
        vision_config=vision,
        text_config=_llama_text(tok),
        image_token_id=tok.convert_tokens_to_ids(IDEFICS3_IMAGE_TOKEN),
        scale_factor=IDEFICS3_SCALE_FACTOR,
        tie_word_embeddings=False,
        architectures=["Idefics3ForConditionalGeneration"],
        dtype="float32",
        **pad,
    )


def _idefics3_processor(tok: Any) -> Any:
    """``Idefics3Processor`` around the PIL image processor, no image splitting."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    edge = {"longest_edge": IDEFICS3_IMAGE_SIZE}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size=edge, max_image_size=edge, do_image_splitting=False
        ),
        tokenizer=tok,
        image_seq_len=IDEFICS3_NUM_IMAGE_TOKENS,
        chat_template=tok.chat_template,
    )
    assert len(tok) == len(processor.tokenizer), "the processor added tokens"
    return processor


# --- Mllama ---------------------------------------------------------------------

MLLAMA_IMAGE_TOKEN = "<|image|>"
MLLAMA_TILE_SIZE = 32
MLLAMA_MAX_NUM_TILES = 4
_MLLAMA_INTERMEDIATE = [1, 2, 4]


def _mllama_config(tok: Any) -> Any:
    from transformers import MllamaConfig, MllamaTextConfig, MllamaVisionConfig

    image_id = tok.convert_tokens_to_ids(MLLAMA_IMAGE_TOKEN)
    assert image_id == len(tok) - 1, "<|image|> must be the last token"
    vision = MllamaVisionConfig(
        hidden_size=32, hidden_act="gelu", num_hidden_layers=5, num_global_layers=2,
        attention_heads=2, intermediate_size=64,
        vision_output_dim=32 * (1 + len(_MLLAMA_INTERMEDIATE)),
        image_size=MLLAMA_TILE_SIZE, patch_size=8, max_num_tiles=MLLAMA_MAX_NUM_TILES,
        intermediate_layers_indices=_MLLAMA_INTERMEDIATE, initializer_range=0.25,
        norm_eps=1e-5, dtype="float32",
    )  # fmt: skip
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    text = MllamaTextConfig(
        hidden_size=64, num_hidden_layers=5, cross_attention_layers=[1, 3],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=2048, initializer_range=0.25, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=False, vocab_size=image_id,
        **_special_ids(tok), dtype="float32",
    )  # fmt: skip
    return MllamaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        architectures=["MllamaForConditionalGeneration"],
        dtype="float32",
    )


def _mllama_processor(tok: Any) -> Any:
    """``MllamaProcessor`` around the PIL image processor (no torchvision)."""
    from transformers import MllamaImageProcessorPil, MllamaProcessor

    image_processor = MllamaImageProcessorPil(
        size={"height": MLLAMA_TILE_SIZE, "width": MLLAMA_TILE_SIZE},
        max_image_tiles=MLLAMA_MAX_NUM_TILES,
    )
    return MllamaProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template
    )


def randomize_gates(model: Any, seed: int) -> None:
    """Give every tanh gate a random value in [0.4, 1.0): non-zero, both signs."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate", "_gate", "gate_attn", "gate_ffn")):
                mag = 0.4 + 0.6 * torch.rand(param.shape, generator=gen)
                sign = torch.where(torch.rand(param.shape, generator=gen) < 0.2, -1, 1)
                param.copy_(mag * sign)


# --- Gemma 3 ---------------------------------------------------------------------

GEMMA3_BOI_TOKEN = "<start_of_image>"
GEMMA3_EOI_TOKEN = "<end_of_image>"
GEMMA3_IMAGE_TOKEN = "<image_soft_token>"
GEMMA3_IMAGE_SIZE = 32
GEMMA3_PATCH_SIZE = 4  # 8x8 patches, pooled 2x2 -> 16 soft tokens
GEMMA3_NUM_IMAGE_TOKENS = 16
GEMMA3_SLIDING_WINDOW = 12  # shorter than an image's 16 soft tokens
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention") * 2
# Gemma 3's vocabulary has these as single tokens; vLLM's Gemma 3 processor looks
# them up (it re-joins the newlines around an image the way the tokenizer would).
GEMMA3_NEWLINE_TOKENS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")


def _gemma3_config(tok: Any) -> Any:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    ids = tok.convert_tokens_to_ids
    vision = SiglipVisionConfig(  # type: ignore[call-arg]  # vision_use_head
        image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH_SIZE, num_channels=3,
        hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        vision_use_head=False, dtype="float32",
    )  # fmt: skip
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(GEMMA3_LAYER_TYPES), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=GEMMA3_SLIDING_WINDOW, layer_types=list(GEMMA3_LAYER_TYPES),
        max_position_embeddings=2048, initializer_range=0.25, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **_special_ids(tok), dtype="float32",
    )  # fmt: skip
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_NUM_IMAGE_TOKENS,
        boi_token_index=ids(GEMMA3_BOI_TOKEN),
        eoi_token_index=ids(GEMMA3_EOI_TOKEN),
        image_token_index=ids(GEMMA3_IMAGE_TOKEN),
        # Untied (released Gemma 3 ties them): with random tied embeddings the
        # greedy next token is mostly the current one again.
        tie_word_embeddings=False,
        architectures=["Gemma3ForConditionalGeneration"],
        dtype="float32",
    )


def _gemma3_processor(tok: Any) -> Any:
    """``Gemma3Processor`` around the PIL image processor (no pan and scan)."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    size = {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size=size, do_pan_and_scan=False),
        tokenizer=tok,
        chat_template=tok.chat_template,
        image_seq_length=GEMMA3_NUM_IMAGE_TOKENS,
    )
    assert len(tok) == len(processor.tokenizer), "the processor added tokens"
    return processor


def randomize_projector(model: Any, seed: int) -> None:
    """Gemma 3 starts its image projection at zero (every image would embed
    as 0): give it random weights of the text model's spread."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        proj.copy_(torch.randn(proj.shape, generator=gen) * 0.25)


# --- the table ------------------------------------------------------------------

LLAVA = TinyModelSpec(
    name="tiny-llava",
    seed=100,
    model_class="LlavaForConditionalGeneration",
    config=_llava_config,
    added_tokens=(LLAVA_IMAGE_TOKEN,),
    chat_template=tk.image_chat_template(LLAVA_IMAGE_TOKEN),
    processor=_llava_processor,
    version=2,
)

# --- Qwen2.5-VL -----------------------------------------------------------------

QWEN_VISION_START = "<|vision_start|>"
QWEN_VISION_END = "<|vision_end|>"
QWEN_IMAGE_PAD = "<|image_pad|>"
QWEN_VIDEO_PAD = "<|video_pad|>"
# What the chat template writes for one image (the processor expands the pad).
QWEN_IMAGE_PLACEHOLDER = QWEN_VISION_START + QWEN_IMAGE_PAD + QWEN_VISION_END
QWEN_PATCH_SIZE = 4
QWEN_MERGE_SIZE = 2
QWEN_TEMPORAL_PATCH = 2
# Resized images have sides that are multiples of patch * merge (8 pixels) and
# between these pixel counts: 64 to 4096 pixels, i.e. 1 to 64 image tokens.
QWEN_MIN_PIXELS = (QWEN_PATCH_SIZE * QWEN_MERGE_SIZE) ** 2
QWEN_MAX_PIXELS = 64 * 64
# The Qwen-VL family's vision tokens, added to the tiny tokenizer.
QWEN_ADDED_TOKENS = (QWEN_VISION_START, QWEN_VISION_END, QWEN_IMAGE_PAD, QWEN_VIDEO_PAD)


def _qwen2_5_vl_config(tok: Any) -> Any:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLVisionConfig,
    )

    ids = tok.convert_tokens_to_ids
    # Four vision blocks, two of them windowed (window 16 px = 2x2 merged
    # units), as the released models alternate them.
    vision = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
        patch_size=QWEN_PATCH_SIZE, spatial_merge_size=QWEN_MERGE_SIZE,
        temporal_patch_size=QWEN_TEMPORAL_PATCH, window_size=16,
        fullatt_block_indexes=[1, 3], out_hidden_size=BASE_CONFIG["hidden_size"],
        initializer_range=BASE_CONFIG["initializer_range"], dtype="float32",
    )  # fmt: skip
    # M-RoPE: the 8 rotary frequency pairs of a 16-wide head split 2/3/3 over
    # the temporal, height and width position channels.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    special = _special_ids(tok)
    text = Qwen2_5_VLTextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
        initializer_range=0.25, rms_norm_eps=1e-5, rope_parameters=rope,
        vocab_size=len(tok), dtype="float32", **special,
    )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids(QWEN_IMAGE_PAD),
        video_token_id=ids(QWEN_VIDEO_PAD),
        vision_start_token_id=ids(QWEN_VISION_START),
        vision_end_token_id=ids(QWEN_VISION_END),
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        dtype="float32",
        **special,
    )


def qwen_image_processor() -> Any:
    """The PIL Qwen2-VL image processor at the tiny model's patch sizes."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS},
        patch_size=QWEN_PATCH_SIZE,
        temporal_patch_size=QWEN_TEMPORAL_PATCH,
        merge_size=QWEN_MERGE_SIZE,
    )


@dataclass(frozen=True, slots=True)
class _SavedAs:
    """A processor whose saved files name ``processor_class`` as released
    checkpoints do (``processor_config.json``, ``tokenizer_config.json``)."""

    processor: Any
    processor_class: str

    def save_pretrained(self, model_dir: Any) -> None:
        import json
        from pathlib import Path

        self.processor.save_pretrained(model_dir)
        for name in ("processor_config.json", "tokenizer_config.json"):
            file = Path(model_dir) / name
            data = json.loads(file.read_text())
            data["processor_class"] = self.processor_class
            file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _qwen2_5_vl_processor(tok: Any) -> Any:
    """The PIL image processor and the tokenizer saved as a released
    ``Qwen2_5_VLProcessor`` checkpoint has them, without its video processor:
    transformers' Qwen video processors are torchvision-based (see
    ``vllm_hpu_mm.models.qwen_vl``)."""
    from vllm_hpu_mm.models.qwen_processor import Qwen2_5_VLImageProcessor

    processor = Qwen2_5_VLImageProcessor(
        image_processor=qwen_image_processor(),
        tokenizer=tok,
        chat_template=tok.chat_template,
    )
    return _SavedAs(processor, "Qwen2_5_VLProcessor")


# --- Qwen3-VL -------------------------------------------------------------------

QWEN3_PATCH_SIZE = 4  # as Qwen2.5-VL's tiny tower; the released models use 16


def _qwen3_vl_config(tok: Any) -> Any:
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.configuration_qwen3_vl import (
        Qwen3VLTextConfig,
        Qwen3VLVisionConfig,
    )

    ids = tok.convert_tokens_to_ids
    # Four vision blocks; the outputs of blocks 0 and 2 are merged into the
    # deep-stack features added to the first two decoder layers' outputs.
    vision = Qwen3VLVisionConfig(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
        patch_size=QWEN3_PATCH_SIZE, spatial_merge_size=QWEN_MERGE_SIZE,
        temporal_patch_size=QWEN_TEMPORAL_PATCH, num_position_embeddings=64,
        deepstack_visual_indexes=[0, 2], out_hidden_size=BASE_CONFIG["hidden_size"],
        initializer_range=BASE_CONFIG["initializer_range"], dtype="float32",
    )  # fmt: skip
    rope = {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }  # fmt: skip
    special = _special_ids(tok)
    text = Qwen3VLTextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=2048, initializer_range=0.25, rms_norm_eps=1e-5,
        rope_parameters=rope, vocab_size=len(tok), dtype="float32", **special,
    )  # fmt: skip
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids(QWEN_IMAGE_PAD),
        video_token_id=ids(QWEN_VIDEO_PAD),
        vision_start_token_id=ids(QWEN_VISION_START),
        vision_end_token_id=ids(QWEN_VISION_END),
        tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"],
        dtype="float32",
        **special,
    )


def _qwen3_vl_moe_config(tok: Any) -> Any:
    """Qwen3-VL's tiny tower and text model with mixture-of-experts MLPs: 8
    experts, top-2 (Qwen3-VL-MoE renormalises the top-k weights), the second
    layer dense. The experts' width (24; gate and up 48) differs from the
    hidden size (64), so the saved and the published expert layouts differ in
    shape (``models.qwen_vl.published_expert_layout``)."""
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
        Qwen3VLMoeTextConfig,
        Qwen3VLMoeVisionConfig,
    )

    dense = _qwen3_vl_config(tok)
    vision = Qwen3VLMoeVisionConfig(**dense.vision_config.to_dict())
    text = dense.text_config.to_dict()
    text.pop("intermediate_size", None)
    text.update(
        intermediate_size=128, moe_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
    )  # fmt: skip
    config = dense.to_dict()
    for key in ("text_config", "vision_config", "architectures", "model_type"):
        config.pop(key, None)
    return Qwen3VLMoeConfig(
        text_config=Qwen3VLMoeTextConfig(**text),
        vision_config=vision,
        architectures=["Qwen3VLMoeForConditionalGeneration"],
        **config,
    )


def _qwen3_vl_processor(tok: Any) -> Any:
    """As ``_qwen2_5_vl_processor``, saved as a ``Qwen3VLProcessor`` checkpoint."""
    from vllm_hpu_mm.models.qwen_processor import Qwen3VLImageProcessor

    processor = Qwen3VLImageProcessor(
        image_processor=qwen_image_processor(),
        tokenizer=tok,
        chat_template=tok.chat_template,
    )
    return _SavedAs(processor, "Qwen3VLProcessor")


GEMMA3 = TinyModelSpec(
    name="tiny-gemma3",
    seed=400,
    model_class="Gemma3ForConditionalGeneration",
    config=_gemma3_config,
    added_tokens=(GEMMA3_BOI_TOKEN, GEMMA3_EOI_TOKEN, GEMMA3_IMAGE_TOKEN),
    plain_tokens=GEMMA3_NEWLINE_TOKENS,
    named_tokens=(
        ("boi_token", GEMMA3_BOI_TOKEN),
        ("eoi_token", GEMMA3_EOI_TOKEN),
        ("image_token", GEMMA3_IMAGE_TOKEN),
    ),
    chat_template=tk.image_chat_template(GEMMA3_BOI_TOKEN),
    processor=_gemma3_processor,
    post_init=randomize_projector,
)
# transformers 5 writes the SigLIP tower as ``vision_tower.*``; released Gemma 3
# checkpoints (and vLLM) say ``vision_tower.vision_model.*``.
GEMMA3_RELEASED_LAYOUT = (("vision_tower.", "vision_tower.vision_model."),)

SPECS: tuple[TinyModelSpec, ...] = (
    TinyModelSpec("tiny-llama", 0, "LlamaForCausalLM", _llama_text),
    TinyModelSpec(
        "tiny-mistral",
        1,
        "MistralForCausalLM",
        _text_config(
            "MistralConfig", sliding_window=16, architectures=["MistralForCausalLM"]
        ),
    ),
    LLAVA,
    # The same weights, tokenizer and processor in the llava-hf layout.
    replace(LLAVA, name="tiny-llava-released", released_layout=LLAVA_RELEASED_LAYOUT),
    TinyModelSpec(
        name="tiny-idefics3",
        seed=200,
        model_class="Idefics3ForConditionalGeneration",
        config=_idefics3_config,
        added_tokens=(
            IDEFICS3_FAKE_IMAGE_TOKEN,
            IDEFICS3_IMAGE_TOKEN,
            IDEFICS3_END_OF_UTTERANCE,
            IDEFICS3_GLOBAL_IMAGE_TOKEN,
            *_ROW_COL_TOKENS,
        ),
        chat_template=tk.image_chat_template(IDEFICS3_IMAGE_TOKEN),
        processor=_idefics3_processor,
        version=2,
    ),
    TinyModelSpec(
        name="tiny-mllama",
        seed=300,
        model_class="MllamaForConditionalGeneration",
        config=_mllama_config,
        added_tokens=(MLLAMA_IMAGE_TOKEN,),
        chat_template=tk.image_chat_template(MLLAMA_IMAGE_TOKEN),
        processor=_mllama_processor,
        post_init=randomize_gates,
        version=2,
    ),
    TinyModelSpec(
        name="tiny-qwen2_5-vl",
        seed=400,
        model_class="Qwen2_5_VLForConditionalGeneration",
        config=_qwen2_5_vl_config,
        added_tokens=QWEN_ADDED_TOKENS,
        chat_template=tk.image_chat_template(QWEN_IMAGE_PLACEHOLDER),
        processor=_qwen2_5_vl_processor,
    ),
    TinyModelSpec(
        name="tiny-qwen3-vl",
        seed=500,
        model_class="Qwen3VLForConditionalGeneration",
        config=_qwen3_vl_config,
        added_tokens=QWEN_ADDED_TOKENS,
        chat_template=tk.image_chat_template(QWEN_IMAGE_PLACEHOLDER),
        processor=_qwen3_vl_processor,
    ),
    TinyModelSpec(
        name="tiny-qwen3-vl-moe",
        seed=510,
        model_class="Qwen3VLMoeForConditionalGeneration",
        config=_qwen3_vl_moe_config,
        added_tokens=QWEN_ADDED_TOKENS,
        chat_template=tk.image_chat_template(QWEN_IMAGE_PLACEHOLDER),
        processor=_qwen3_vl_processor,
    ),
    GEMMA3,
    # The same weights, tokenizer and processor in the released layout.
    replace(
        GEMMA3, name="tiny-gemma3-released", released_layout=GEMMA3_RELEASED_LAYOUT
    ),
)
