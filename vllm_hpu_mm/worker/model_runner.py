"""The plugin's model runner: one code path for hpu, cuda and cpu.

A step, split as vLLM's worker interface expects:

- ``execute_model``: update the request table and the persistent batch from
  the scheduler's output, order the requests (decodes first), gather and pad
  the inputs to the step's shape, run the model under vLLM's forward context
  with our attention metadata, gather the logits of each request's last token
  in persistent-batch row order, collect prompt logprobs; returns None.
- ``sample_tokens(grammar_output)``: apply the structured-output bitmask (if
  any) to its requests' rows, sample with vLLM's Sampler (and its logits
  processors), and hand back the tokens.

Each part lives in its own module: ``requests`` (state), ``input_batch``
(sampler rows), ``inputs`` (layout and padding), ``sampling``, ``kv_cache``;
device calls go through ``vllm_hpu_mm.device``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.interfaces import supports_multimodal
from vllm.sequence import IntermediateTensors
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    LogprobsTensors,
    ModelRunnerOutput,
)
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask

from hpu_kernels.attention import KVCache
from vllm_hpu_mm import device as dev
from vllm_hpu_mm.attention.decode_cache import DecodeCache
from vllm_hpu_mm.attention.metadata import DynamicAttentionMetadata
from vllm_hpu_mm.multimodal.placeholders import request_chunks
from vllm_hpu_mm.plan import ExecutionPlan, one_request_forms, plan_of
from vllm_hpu_mm.platform_config import is_mm_prefix_lm
from vllm_hpu_mm.quant.memory import weight_memory_line
from vllm_hpu_mm.worker import cpu_linear
from vllm_hpu_mm.worker.async_output import AsyncStepOutput, PendingTokens
from vllm_hpu_mm.worker.buffers import DeviceBuffers
from vllm_hpu_mm.worker.cross_attention import CrossAttentionInputs
from vllm_hpu_mm.worker.graphs import GraphRunner, choose_backend
from vllm_hpu_mm.worker.input_batch import PersistentBatch
from vllm_hpu_mm.worker.inputs import StepBatch, build_step, order_requests
from vllm_hpu_mm.worker.kv_cache import (
    allocate_kv_caches,
    kv_cache_bytes,
    kv_cache_specs,
    zero_blocks,
)
from vllm_hpu_mm.worker.logits_head import configure_head
from vllm_hpu_mm.worker.lora import LoraAdapters
from vllm_hpu_mm.worker.multimodal import MultimodalInputs
from vllm_hpu_mm.worker.pipeline import PipelineStage
from vllm_hpu_mm.worker.profile import profile_peak_activation_bytes
from vllm_hpu_mm.worker.requests import RequestState, RequestTable
from vllm_hpu_mm.worker.sampler_padding import (
    counted_compiles,
    sample_padded,
    sampler_batch_sizes,
)
from vllm_hpu_mm.worker.sampling import PromptLogprobs, build_logits_processors
from vllm_hpu_mm.worker.shapes import (
    ShapePolicy,
    bucket_set,
    engine_limits,
    step_recorder,
)
from vllm_hpu_mm.worker.vision_buckets import patch_buckets
from vllm_hpu_mm.worker.warmup import warm_up

logger = logging.getLogger("vllm.hpu_mm.runner")


@dataclass(slots=True)
class _PendingSample:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: Any
    logits: torch.Tensor  # [R, V] in persistent-batch row order
    prompt_logprobs: dict[str, LogprobsTensors | None]


class HpuMMModelRunner:
    def __init__(
        self, vllm_config: VllmConfig, device: torch.device, plugin_config: Any
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.plugin_config = plugin_config
        self.block_size: int = vllm_config.cache_config.block_size
        # Pipeline parallelism (``worker.pipeline``): the first stage embeds
        # and encodes, the last computes logits and samples.
        self.stage = PipelineStage.current()
        self.requests = RequestTable(
            device, tokens_from_scheduler=not self.stage.is_last
        )
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        vocab_size = self.model_config.get_vocab_size()
        procs, procs_read_outputs = build_logits_processors(vllm_config, device)
        self.input_batch = PersistentBatch(
            vllm_config.scheduler_config.max_num_seqs,
            vocab_size,
            device,
            procs,
            procs_read_outputs,
        )
        self.prompt_logprobs = PromptLogprobs(
            vocab_size, str(self.model_config.logprobs_mode)
        )
        self._pending: _PendingSample | None = None
        # Dense per-request K/V for decode rows (``attention.decode_cache``),
        # built with the KV cache where it applies.
        self.decode_cache: DecodeCache | None = None
        # The last step's sampled tokens while they travel to the host
        # (``async_output``); read by the next step's inputs on the device.
        self._last_tokens: PendingTokens | None = None
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # The execution plan (static: Gaudi's path; dynamic: the fast path off
        # Gaudi), decided here once; every part below reads it.
        self.plan: ExecutionPlan = plan_of(vllm_config)
        logger.info(self.plan.describe())
        bucketing = plugin_config.bucketing
        self.shapes = ShapePolicy(
            bucket_set(engine_limits(vllm_config), bucketing),
            bucketing.fallback_max_pad_ratio,
            self.plan.decode_form,
            recorder=step_recorder(bucketing.record_steps),
            prefill_forms=one_request_forms(self.plan, bucketing),
        )
        self.model: torch.nn.Module | None = None
        self.graphs: GraphRunner | None = None
        self.buffers = DeviceBuffers(device)
        self.mm: MultimodalInputs | None = None  # set for multimodal models
        # set for models whose images are read by cross-attention (Mllama)
        self.cross: CrossAttentionInputs | None = None
        self.kv_caches: dict[str, KVCache] = {}
        # vLLM's adapter manager (``--enable-lora``), set by load_model.
        self.lora: LoraAdapters | None = None
        # Rotary position channels of an M-RoPE model (Qwen2-VL family), 0 for
        # one position per token: the body's positions are then [channels, T].
        self.mrope_channels: int = (
            self.model_config.mrope_num_dims if self.model_config.uses_mrope else 0
        )
        # Gemma 3: the tokens of one image attend to each other both ways.
        self.bidirectional_images = is_mm_prefix_lm(vllm_config)

    def zero_positions(self, num_tokens: int) -> np.ndarray:
        """Positions of ``num_tokens`` padding rows: [T], or [channels, T]."""
        if self.mrope_channels:
            return np.zeros((self.mrope_channels, num_tokens), np.int64)
        return np.zeros(num_tokens, np.int64)

    # ---- set-up ------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model = get_model(vllm_config=self.vllm_config)
            if self.vllm_config.lora_config is not None:
                self.lora = LoraAdapters(self.model, self.vllm_config, self.device)
                self.model = self.lora.model
        configure_head(self.model, self.vllm_config.model_config)
        dtype = self.model_config.dtype  # resolved to a torch.dtype by now
        assert isinstance(dtype, torch.dtype), dtype
        logger.info("%s", weight_memory_line(self.model, dtype))
        prepack = self.plugin_config.memory.cpu_prepacked_linear
        if prepack and self.plan.prepack_linear and cpu_linear.supported():
            packed = cpu_linear.pack_linear_weights(self.model)
            if packed:
                logger.info(
                    "Linear layers: %d bfloat16 weights prepacked for oneDNN, used "
                    "by calls of at most %d rows (decode)",
                    packed,
                    cpu_linear.PACKED_MAX_ROWS,
                )
        self.graphs = GraphRunner(
            self.model,
            self.plan,
            choose_backend(self.plan, self.plugin_config.warmup.compile_backend),
            compile_cache_dir=self.plugin_config.warmup.compile_cache_dir,
            stage=self.stage,
            dtype=self.model_config.dtype,  # type: ignore[arg-type]
        )
        if self.mrope_channels:
            self.requests.mrope_model = self.model
        if self.stage.size > 1 and getattr(
            self.model, "uses_cross_attention_cache", False
        ):
            raise RuntimeError(
                f"pipeline parallelism ({self.stage.size} stages) with a "
                "cross-attention model (Mllama): its image states are read by "
                "layers on every stage; serve it with tensor parallelism"
            )
        if getattr(self.model, "uses_cross_attention_cache", False):
            self.cross = CrossAttentionInputs(
                self.model,
                self.vllm_config,
                self.device,
                self.graphs,
                self._max_items_per_prompt(),
            )
        elif supports_multimodal(self.model) and self.stage.is_first:
            # The encoder and the merge run on the first stage only; later
            # stages start from its intermediate tensors.
            self.mm = self._multimodal_inputs()
        logger.info(
            "Loaded %s in %.1f s on %s",
            self.model_config.model,
            time.perf_counter() - start,
            self.device,
        )

    def _multimodal_inputs(self) -> MultimodalInputs:
        """The encoder and the merge. The encoder store holds as many embedding
        rows as vLLM's encoder cache (the size its scheduler admits items
        against), for each modality the model encodes."""
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.encoder_budget import MultiModalBudget

        budget = MultiModalBudget(self.vllm_config, MULTIMODAL_REGISTRY)
        mm = MultimodalInputs(
            self.model,
            self.device,
            self.graphs,  # type: ignore[arg-type]
            self._max_encoder_items(),
            hidden=self.model_config.get_hidden_size(),
            store_rows=max(int(budget.encoder_cache_size), 1),
            modalities=tuple(budget.mm_max_toks_per_item),
            # M-RoPE models (Qwen2-VL family) take flat patches + grids.
            dynamic_resolution=self.mrope_channels > 0,
            patch_buckets=self._vision_patch_buckets(),
            buffers=self.buffers,
        )
        logger.info(
            "Encoder store: %d rows x %d (%s), %.1f MiB, modalities %s",
            mm.store.capacity,
            mm.store.width,
            mm.store.rows.dtype,
            mm.store.nbytes() / 2**20,
            ", ".join(mm.modalities) or "none",
        )
        return mm

    def _max_items_per_prompt(self) -> int:
        """The per-prompt item limit of the modality with the most (1 if unset)."""
        mm_config = self.model_config.multimodal_config
        limits = getattr(mm_config, "limit_per_prompt", None) or {}
        return max(
            (
                getattr(v, "count", v)
                for v in limits.values()
                if isinstance(getattr(v, "count", v), int)
            ),
            default=1,
        )

    def _max_encoder_items(self) -> int:
        """Most items one encoder batch holds: the per-prompt limit times the
        sequences of a step, capped at 8."""
        per_prompt = self._max_items_per_prompt()
        return max(
            1, min(8, per_prompt * self.vllm_config.scheduler_config.max_num_seqs)
        )

    def _vision_patch_buckets(self) -> tuple[int, ...]:
        """Patch buckets of a dynamic-resolution vision tower (M-RoPE models):
        the bucket file's ``vision_patches``, or doubling from
        ``vision_min_patches`` up to the scheduler's encoder budget (embedding
        rows) times the patches per row (spatial merge squared). Empty for
        other models and with bucketing off (the tower then runs unpadded)."""
        bucketing = self.plugin_config.bucketing
        if not self.mrope_channels or bucketing.strategy == "off":
            return ()
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.encoder_budget import MultiModalBudget

        vision = getattr(self.model_config.hf_config, "vision_config", None)
        unit = int(getattr(vision, "spatial_merge_size", 1)) ** 2
        budget = MultiModalBudget(self.vllm_config, MULTIMODAL_REGISTRY)
        explicit = bucketing.buckets.vision_patches if bucketing.buckets else None
        return patch_buckets(
            int(budget.encoder_compute_budget) * unit,
            unit,
            bucketing.vision_min_patches,
            explicit,
        )

    def warmup(self) -> None:
        assert self.graphs is not None
        warm_up(self)
        self.shapes.start_serving()  # record and observe the served steps

    def get_model(self) -> torch.nn.Module:
        assert self.model is not None, "load_model() first"
        return self.model

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return kv_cache_specs(self.vllm_config)

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self.kv_caches = allocate_kv_caches(self.vllm_config, config, self.device)
        paged = kv_cache_bytes(self.kv_caches)
        logger.info(
            "KV cache: %d blocks of %d tokens, %d layers, %.1f MiB",
            config.num_blocks,
            self.block_size,
            len(self.kv_caches),
            paged / 2**20,
        )
        self.decode_cache = self._build_decode_cache(paged)

    def _build_decode_cache(self, paged: int) -> DecodeCache | None:
        """The dense decode cache, where the plan allows it (attention outside
        any graph, on the CPU) and it fits ``memory.decode_cache_fraction`` of
        the KV cache's ``paged`` bytes."""
        fraction = self.plugin_config.memory.decode_cache_fraction
        if not (fraction > 0 and self.plan.dense_decode_cache):
            return None
        if not self.kv_caches:
            return None
        slots = self.vllm_config.scheduler_config.max_num_seqs
        max_len = self.model_config.max_model_len
        dtype = self.model_config.dtype  # what an FP8 cache's copy holds
        assert isinstance(dtype, torch.dtype), dtype
        dense = sum(
            DecodeCache.bytes_per_layer(slots, max_len, self.block_size, t, dtype)
            for t in self.kv_caches.values()
        )
        if dense > fraction * paged:
            logger.info(
                "Dense decode cache off: %d sequences x %d tokens need %.1f MiB, "
                "more than memory.decode_cache_fraction=%g of the KV cache's "
                "%.1f MiB; decode gathers paged blocks",
                slots, max_len, dense / 2**20, fraction, paged / 2**20,
            )  # fmt: skip
            return None
        logger.info(
            "Dense decode cache: %d sequences x %d tokens, %.1f MiB",
            slots,
            max_len,
            dense / 2**20,
        )
        cache = DecodeCache(slots, max_len, self.block_size, self.device, dtype)
        for kv in self.kv_caches.values():  # allocated now, not mid-serving
            cache.tensor_for(kv)
        return cache

    def profile_peak_activation_bytes(self) -> int:
        """Peak bytes of one step at the largest shapes (``worker.profile``)."""
        return profile_peak_activation_bytes(self)

    # ---- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run the model; None means: call ``sample_tokens`` next. A pipeline
        stage before the last returns its intermediate tensors (the worker
        sends them on); a later one reads the previous stage's
        ``intermediate_tensors``."""
        if self._pending is not None:
            raise RuntimeError("execute_model() twice without sample_tokens()")
        self._update_requests(scheduler_output)
        zero_blocks(self.kv_caches, scheduler_output.new_block_ids_to_zero or [])
        if self.mm is not None:
            self.mm.on_new_requests(scheduler_output.scheduled_new_reqs)
            self.mm.run_encoders(scheduler_output, self.requests)
        if self.cross is not None:
            self.cross.update(scheduler_output, self.requests)
        scheduled = scheduler_output.num_scheduled_tokens
        self.input_batch.sync([self.requests[r] for r in scheduled])
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._resolve_last_tokens()
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = order_requests(scheduled)
        states = [self.requests[r] for r in req_ids]
        query_lens = np.array([scheduled[r] for r in req_ids], np.int64)
        batch = build_step(
            req_ids,
            states,
            query_lens,
            self.shapes,
            self.block_size,
            self.device,
            self.buffers,
            self.plan.attention_metadata,
            bidirectional_images=self.bidirectional_images,
        )
        if self.lora is not None:
            self.lora.set_step(
                [s.lora_request for s in states],
                batch.row_starts,
                batch.query_lens,
                int(batch.input_ids.shape[0]),
                int(batch.logits_rows.shape[0]),
            )
        if self.decode_cache is not None:
            md = batch.attn_metadata
            assert isinstance(md, DynamicAttentionMetadata)  # the plan's
            n_dec = md.real_decodes
            md.dense = self.decode_cache.plan(
                req_ids[:n_dec],
                batch.seq_lens[:n_dec],
                [s.block_ids for s in states[:n_dec]],
                req_ids[n_dec:],
            )
        if self._last_tokens is not None:
            # Tokens sampled last step enter as placeholders; their ids come
            # from the device tensor the sampler wrote.
            self._last_tokens.scatter_into(
                batch.input_ids,
                batch.req_ids,
                batch.row_starts,
                batch.seq_lens - batch.query_lens,
                batch.query_lens,
            )
        if not self.stage.is_last:
            return self._forward_body(batch, states, intermediate_tensors)
        hidden, logits = self.forward(batch, states, intermediate_tensors)
        # The forward is issued: now wait for last step's tokens, which the
        # sampler's penalties and vLLM's output need on the host.
        self._resolve_last_tokens()
        # Sampler rows follow the persistent batch, not the step layout.
        order = self.input_batch.order_of(batch.req_ids)
        if order != list(range(len(order))):
            logits = logits.index_select(
                0, torch.tensor(order, dtype=torch.int64, device=logits.device)
            )
        prompt_logprobs = self._prompt_logprobs(hidden, batch, scheduled)
        self._pending = _PendingSample(scheduler_output, logits, prompt_logprobs)
        return None

    def _apply_grammar_bitmask(
        self, scheduler_output: Any, grammar_output: Any, logits: torch.Tensor
    ) -> None:
        """vLLM's structured-output bitmask on ``logits [num_reqs, V]``, in place.

        On HPU it is applied to a host copy, as the official plugin does
        (vllm-gaudi ``hpu_model_runner.py``): xgrammar picks its kernel by the
        logits' device and, for one neither CPU nor CUDA, its
        ``torch.compile(dynamic=True)`` kernel, which is Inductor on HPU
        tensors (and symbolic shapes), refused by Habana's stack. The host copy
        is float32, the dtype xgrammar's CPU kernel takes (vLLM would cast a
        second copy otherwise)."""
        on_hpu = dev.device_kind() == "hpu"
        target = dev.to_host(logits, torch.float32) if on_hpu else logits
        apply_grammar_bitmask(
            scheduler_output,
            grammar_output,
            self.input_batch,  # type: ignore[arg-type]  # reads .req_ids
            target,
        )
        if target is not logits:
            logits.copy_(target)

    def _resolve_last_tokens(self) -> None:
        last, self._last_tokens = self._last_tokens, None
        if last is not None:
            last.resolve()

    def _update_requests(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.prompt_logprobs.drop(req_id)
            if self.decode_cache is not None:
                self.decode_cache.drop(req_id)
        if self.decode_cache is not None:
            # Preempted requests give their dense slots back now (they are
            # rebuilt from the paged cache if they decode again).
            for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
                self.decode_cache.drop(req_id)
        self.requests.update(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self.prompt_logprobs.add(new.req_id, new.sampling_params)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, batch: StepBatch, scheduled: dict[str, int]
    ) -> dict[str, LogprobsTensors | None]:
        if not self.prompt_logprobs.pending:
            return {}
        starts = {
            r: int(s) for r, s in zip(batch.req_ids, batch.row_starts, strict=True)
        }
        model: Any = self.get_model()
        return self.prompt_logprobs.collect(
            hidden, starts, scheduled, self.requests.states, model.compute_logits
        )

    def forward(
        self,
        batch: StepBatch,
        states: list[RequestState],
        intermediate: IntermediateTensors | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model on the padded batch.

        Returns (hidden [padded tokens, H], logits [R, V] of each request's
        last row, in batch order).
        """
        hidden = self._forward_body(batch, states, intermediate)
        assert self.graphs is not None
        logits = self.graphs.logits(hidden.index_select(0, batch.logits_rows))
        return hidden, logits[: batch.num_reqs]

    def _forward_body(
        self,
        batch: StepBatch,
        states: list[RequestState],
        intermediate: IntermediateTensors | None,
    ) -> Any:
        """The body on the padded batch: hidden states [padded tokens, H], or
        (a pipeline stage before the last) the next stage's input."""
        graphs = self.graphs
        assert graphs is not None, "load_model() first"
        if self.mm is not None:
            chunks = request_chunks(states, batch.query_lens, batch.row_starts)
            self.mm.attach_maps(batch.attn_metadata, chunks)
        if self.cross is not None:
            batch.attn_metadata.cross = self.cross.metadata(batch, states)
        return graphs.run_step(
            batch.attn_metadata,
            self.vllm_config,
            batch.input_ids,
            batch.positions,
            None if self.mm is None else self.mm.merge,
            intermediate,
            before_pass=None if self.lora is None else self.lora.select_rows,
        )

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: Any
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the step left by ``execute_model``, under the grammar bitmask
        (an ``AsyncModelRunnerOutput`` under async scheduling)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        logits = pending.logits
        if grammar_output is not None:
            self._apply_grammar_bitmask(
                pending.scheduler_output, grammar_output, logits
            )
        scheduled = pending.scheduler_output.num_scheduled_tokens
        states = self.input_batch.states()
        # A chunk that stops short of the end of the known tokens is a partial
        # prefill: its sampled token is not part of the output.
        partial = [
            s.num_computed_tokens + scheduled[s.req_id] < s.num_tokens for s in states
        ]
        # A seeded request's draw for a discarded token must not advance its
        # generator (vLLM rewinds it too), so chunking does not change its output.
        saved = {
            row: gen.get_state()
            for row, gen in self.input_batch.generators.items()
            if partial[row]
        }
        # On the static path at the batch bucket the logits head ran at
        # (``sampler_padding``); the padding rows' outputs are dropped.
        with counted_compiles(self.graphs.counter if self.graphs else None):
            out = sample_padded(
                self.sampler,
                logits,
                self.input_batch.metadata,
                sampler_batch_sizes(self.plan, self.shapes.buckets),
            )
        for row, gen_state in saved.items():
            self.input_batch.generators[row].set_state(gen_state)
        # The tokens stay on the device: each kept row gets a placeholder now,
        # the host copy is waited for when the output is built (at once,
        # unless async scheduling lets vLLM schedule the next step first).
        keeps = [not p for p in partial]
        tokens = PendingTokens.start(out.sampled_token_ids[:, 0], states, keeps)
        req_ids = self.input_batch.req_ids
        req_id_to_index = dict(self.input_batch.req_id_to_index)
        logprobs_tensors = out.logprobs_tensors
        prompt_logprobs = pending.prompt_logprobs

        def build() -> ModelRunnerOutput:
            values = tokens.resolve()
            return ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index=req_id_to_index,
                sampled_token_ids=[
                    [int(values[row])] if keep else [] for row, keep in enumerate(keeps)
                ],
                logprobs=logprobs_tensors.tolists() if logprobs_tensors else None,
                prompt_logprobs_dict=prompt_logprobs,
            )

        if not self.async_scheduling:
            return build()
        self._last_tokens = tokens
        return AsyncStepOutput(build)
