"""vLLM attention backend of the plugin: pure-PyTorch paged attention.

The model's ``Attention`` layers call ``HpuMMAttentionImpl.forward`` with the
step's metadata (set by our model runner through vLLM's forward context). The
forward dispatches once, on the metadata's class (the execution plan's,
``vllm_hpu_mm.plan``), into one of two functions that each read top to bottom:

- ``_forward_static`` (``StaticAttentionMetadata``, Gaudi's path): the
  platform's ``opaque_attention_op`` is False, so vLLM's ``Attention.forward``
  calls ``unified_attention_with_output`` directly and Dynamo traces this
  function into the compiled body; the metadata holds only the bucket's
  tensors and row counts, the graph key. Flat decode, prefill tiles.
- ``_forward_dynamic`` (``DynamicAttentionMetadata``, off Gaudi): vLLM's
  opaque op between the compiled pieces (or eager mode), over the step's real
  rows and blocks: batched or dense-cache decode, prefill request by request.

Each writes this step's K/V into the paged cache first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from hpu_kernels.attention import (
    KVCache,
    SdpaFn,
    batched_decode_attention,
    causal_prefill_attention,
    decode_attention,
    dense_decode_attention,
    prefill_attention,
    request_prefill_attention,
    write_kv,
    write_kv_plain,
)
from hpu_kernels.kv_fp8 import KVQuant
from vllm_hpu_mm import device
from vllm_hpu_mm.attention.kv_dtype import (
    SUPPORTED_KV_CACHE_DTYPES,
    is_fp8_kv_cache,
    layer_scales,
)
from vllm_hpu_mm.attention.metadata import (
    DECODE_FORM,
    DynamicAttentionMetadata,
    HpuMMAttentionMetadata,
    PrefillCausalInputs,
    PrefillRequests,
    PrefillTileInputs,
    StaticAttentionMetadata,
    build_metadata,
    exact_shape,
    spans_from_doc_ranges,
)
from vllm_hpu_mm.config import load_plugin_config
from vllm_hpu_mm.plan import ExecutionPlan, current_plan, one_request_forms, plan_of


class HpuMMAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(SUPPORTED_KV_CACHE_DTYPES)
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[HpuMMAttentionImpl]:
        return HpuMMAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HpuMMAttentionMetadataBuilder]:
        return HpuMMAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """The shape of each of a layer's two cache tensors, K and V (one
        ``KVCache``: ``worker.kv_cache``), as the official plugin's (vllm-gaudi
        ``HPUAttentionBackend.get_kv_cache_shape``)."""
        return (num_blocks * block_size, num_kv_heads, head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: the kernels are plain matmuls

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        # Bidirectional image spans, from the metadata's prefill_tile_span_*.
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class HpuMMAttentionImpl(AttentionImpl[HpuMMAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported: object,
    ) -> None:
        problems = []
        if alibi_slopes is not None:
            problems.append("ALiBi slopes")
        if logits_soft_cap:
            problems.append(f"logits_soft_cap={logits_soft_cap}")
        if attn_type != AttentionType.DECODER:
            problems.append(f"attention type {attn_type!r}")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            problems.append(
                f"kv_cache_dtype={kv_cache_dtype!r} (supported: "
                f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)})"
            )
        if kv_sharing_target_layer_name is not None:
            problems.append("cross-layer KV sharing")
        problems += [f"{k}={v!r}" for k, v in unsupported.items() if v]
        if problems:
            raise NotImplementedError(
                "vllm-hpu-mm attention does not support "
                + ", ".join(problems)
                + "; supported: decoder self-attention with MHA/GQA/MQA, "
                "an optional sliding window and bidirectional image spans"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        # The SDPA kernel of the device: FusedSDPA on Gaudi, PyTorch's elsewhere.
        self.sdpa: SdpaFn = device.sdpa_kernel(_softmax_mode())
        # The execution plan (vllm_hpu_mm.plan), read under the vLLM config the
        # layers are built with; the metadata the runner builds follows it.
        self.plan: ExecutionPlan = current_plan()
        # The KV write, by the compiler that sees it (a device fact, not a
        # path): a plain in-place index_copy_ where hpu_backend compiles it
        # (Habana's graph compiler refuses the custom op's auto_functionalized
        # form); the custom op elsewhere (Inductor reinplaces it).
        self.write_kv = write_kv_plain if device.device_kind() == "hpu" else write_kv
        # An FP8 cache's conversions (Habana's cast ops on HPU), or None.
        self.fp8_casts = (
            device.kv_fp8_casts() if is_fp8_kv_cache(kv_cache_dtype) else None
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,  # type: ignore[override]
        attn_metadata: HpuMMAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # query, output: [T, H, D]; key, value: [T, Hkv, D];
        # kv_cache: K and V, [num_blocks * block_size, Hkv, D] each.
        md = attn_metadata
        if md is None:  # a run without KV cache (memory profiling)
            return output.zero_()
        if self.fp8_casts is not None:
            kv_cache, key, value = self._write_fp8(layer, kv_cache, key, value, md)
        else:
            self.write_kv(kv_cache, key, value, md.slot_mapping)
        if isinstance(md, StaticAttentionMetadata):
            return self._forward_static(query, kv_cache, md, output)
        assert isinstance(md, DynamicAttentionMetadata), type(md)
        return self._forward_dynamic(query, key, value, kv_cache, md, output)

    def _forward_static(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: StaticAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """The static plan: traced into the step's graph, it reads only the
        bucket's tensors; decode rows over the flat block list, then prefill
        rows in tiles (a part the bucket lacks is None)."""
        n_dec, n_pre = md.num_decodes, md.num_prefill_tokens
        if md.decode is not None:
            d = md.decode
            output[:n_dec] = decode_attention(
                query[:n_dec],
                kv_cache,
                d.block_list,
                d.block_req,
                d.block_bias,
                d.block_key_pos,
                d.block_mapping,
                d.seq_lens,
                self.scale,
                self.sliding_window,
            )
        if isinstance(md.prefill, PrefillCausalInputs):
            output[n_dec : n_dec + n_pre] = causal_prefill_attention(
                query[n_dec : n_dec + n_pre],
                kv_cache,
                md.prefill.blocks,
                self.scale,
                self.sliding_window,
                sdpa=self.sdpa,
            )
        elif md.prefill is not None:
            output[n_dec : n_dec + n_pre] = self._tiles(
                query[n_dec : n_dec + n_pre], kv_cache, md.prefill
            )
        return output

    def _forward_dynamic(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        md: DynamicAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """The dynamic plan off Gaudi: outside any graph, over the step's real
        rows and blocks. Decode rows read the dense decode cache (where the
        runner set it) or the batched table of their real width, padding rows
        get zeros (the bucket's padding costs as much as real work); prefill
        runs request by request (tiles only with bidirectional spans)."""
        n_dec, n_pre, real = md.num_decodes, md.num_prefill_tokens, md.real_decodes
        output[real:n_dec].zero_()
        if real and md.dense is not None:
            step = md.dense
            output[:real] = dense_decode_attention(
                query[:real],
                key[:real],
                value[:real],
                kv_cache,
                step.cache.tensor_for(kv_cache),
                step.slots,
                step.positions,
                step.fill_slots,
                step.fill_blocks,
                step.mask(self.sliding_window),
                self.scale,
                sdpa=self.sdpa,
            )
        elif real:
            output[:real] = batched_decode_attention(
                query[:real],
                kv_cache,
                md.decode_block_table,
                md.decode_seq_lens,
                self.scale,
                self.sliding_window,
                sdpa=self.sdpa,
            )
        rows = slice(n_dec, n_dec + n_pre)
        if isinstance(md.prefill, PrefillRequests):
            reqs = md.prefill
            output[rows] = request_prefill_attention(
                query[rows],
                key[rows],
                value[rows],
                kv_cache,
                reqs.rows,
                reqs.block_table,
                reqs.masks_for(self.sliding_window),
                self.scale,
                sdpa=self.sdpa,
            )
        elif md.prefill is not None:
            output[rows] = self._tiles(query[rows], kv_cache, md.prefill)
        return output

    def _write_fp8(
        self,
        layer: AttentionLayer,
        kv_cache: KVCache,
        key: torch.Tensor,
        value: torch.Tensor,
        md: HpuMMAttentionMetadata,
    ) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
        """Write this step's K/V into an FP8 cache (``k / k_scale``,
        saturated) and return the cache with the layer's scales for the reads,
        and the step's K/V as the cache holds them (quantized and read back):
        the paths that attend fresh K/V directly (a whole prompt's own keys,
        the dense decode cache's new token) then see what a later read of the
        cache sees."""
        assert self.fp8_casts is not None
        quantize, dequantize = self.fp8_casts
        k_scale, v_scale = layer_scales(layer)
        quant = KVQuant(k_scale, v_scale, quantize, dequantize)
        kv_cache = KVCache(kv_cache.key, kv_cache.value, kv_cache.block_size, quant)
        key_q, value_q = quantize(key, k_scale), quantize(value, v_scale)
        self.write_kv(kv_cache, key_q, value_q, md.slot_mapping)
        return (
            kv_cache,
            dequantize(key_q, k_scale, key.dtype),
            dequantize(value_q, v_scale, value.dtype),
        )

    def _tiles(
        self, query: torch.Tensor, kv_cache: KVCache, tiles: PrefillTileInputs
    ) -> torch.Tensor:
        """Prefill rows ``query`` ([N, H, D], N = tiles x rows) in tiles."""
        return prefill_attention(
            query,
            kv_cache,
            tiles.blocks,
            tiles.mask,
            tiles.query_pos,
            tiles.key_pos,
            self.scale,
            self.sliding_window,
            sdpa=self.sdpa,
            span_lo=tiles.span_lo,
            span_hi=tiles.span_hi,
        )


class HpuMMAttentionMetadataBuilder(AttentionMetadataBuilder[HpuMMAttentionMetadata]):
    """Builds our metadata from vLLM's CommonAttentionMetadata.

    Our own model runner calls ``build_metadata`` directly with its bucketed
    shape; this adapter serves vLLM code that builds metadata generically. It
    asks vLLM to put single-token (decode) requests first, as our layout needs.
    """

    reorder_batch_threshold: int | None = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,  # type: ignore[override]
        layer_names: list[str],
        vllm_config: object,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config  # type: ignore[assignment]
        self.device = device
        self.block_size = kv_cache_spec.block_size
        plan = plan_of(vllm_config)
        self.kind = plan.attention_metadata
        bucketing = load_plugin_config(vllm_config).bucketing
        self.prefill_forms = one_request_forms(plan, bucketing)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> StaticAttentionMetadata | DynamicAttentionMetadata:
        """Our metadata of the plan's kind (``ExecutionPlan.attention_metadata``)
        at the batch's exact shape."""
        cm = common_attn_metadata
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        query_lens = np.diff(qsl)
        seq_lens = cm.seq_lens.cpu().numpy().astype(np.int64)
        n = cm.num_actual_tokens
        # Prefix-LM models (Gemma 3): vLLM's bidirectional image ranges.
        spans = spans_from_doc_ranges(
            getattr(cm, "mm_req_doc_ranges", None), query_lens, seq_lens
        )
        shape = exact_shape(
            query_lens, seq_lens, self.block_size, DECODE_FORM[self.kind], spans=spans
        )
        if not self.prefill_forms:
            shape = dataclasses.replace(shape, prefill_form="tiles")
        return build_metadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=cm.block_table_tensor.cpu().numpy().astype(np.int64),
            slot_mapping=cm.slot_mapping[:n].cpu().numpy().astype(np.int64),
            block_size=self.block_size,
            shape=shape,
            device=self.device,
            kind=self.kind,
            spans=spans,
        )


def _softmax_mode() -> str | None:
    """FusedSDPA's softmax mode for the model being built (``hpu_mm.fused.
    softmax_mode`` and the model's type, ``hpu_kernels.fused.fused_softmax_mode``);
    read under the engine's current vLLM config, as the layers are built (none:
    the defaults)."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    from hpu_kernels.fused import fused_softmax_mode

    vllm_config = get_current_vllm_config_or_none()
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    setting = load_plugin_config(vllm_config).fused.softmax_mode
    return fused_softmax_mode(setting, getattr(hf_config, "model_type", None))
