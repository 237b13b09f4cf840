"""The plugin's model runner: one code path for hpu, cuda and cpu.

A step: update the request table from the scheduler's output, order the
requests (decodes first), gather and pad the inputs to the step's shape, run
the model under vLLM's forward context with our attention metadata, sample with
vLLM's Sampler, and hand back the tokens. Each part lives in its own module:
``requests`` (state), ``inputs`` (layout and padding), ``sampling``,
``kv_cache``; device calls go through ``vllm_hpu_mm.device``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.interfaces import supports_multimodal
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.sampler import Sampler

from vllm_hpu_mm import device as dev
from vllm_hpu_mm.worker.buffers import DeviceBuffers
from vllm_hpu_mm.worker.cross_attention import CrossAttentionInputs
from vllm_hpu_mm.worker.graphs import GraphRunner
from vllm_hpu_mm.worker.inputs import StepBatch, build_step, order_requests
from vllm_hpu_mm.worker.kv_cache import allocate_kv_caches, kv_cache_specs, zero_blocks
from vllm_hpu_mm.worker.multimodal import MultimodalInputs
from vllm_hpu_mm.worker.requests import RequestState, RequestTable
from vllm_hpu_mm.worker.sampling import build_sampling_metadata
from vllm_hpu_mm.worker.shapes import ShapePolicy, bucket_set, engine_limits
from vllm_hpu_mm.worker.warmup import warm_up

logger = logging.getLogger("vllm.hpu_mm.runner")


class HpuMMModelRunner:
    def __init__(
        self, vllm_config: VllmConfig, device: torch.device, plugin_config: Any
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.plugin_config = plugin_config
        self.block_size: int = vllm_config.cache_config.block_size
        self.requests = RequestTable(device)
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        bucketing = plugin_config.bucketing
        self.shapes = ShapePolicy(
            bucket_set(engine_limits(vllm_config), bucketing),
            bucketing.fallback_max_pad_ratio,
        )
        self.model: torch.nn.Module | None = None
        self.graphs: GraphRunner | None = None
        self.buffers = DeviceBuffers(device)
        self.mm: MultimodalInputs | None = None  # set for multimodal models
        # set for models whose images are read by cross-attention (Mllama)
        self.cross: CrossAttentionInputs | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}

    # ---- set-up ------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model = get_model(vllm_config=self.vllm_config)
        self.graphs = GraphRunner(self.model, self._graph_mode(), dev.compile_backend())
        if getattr(self.model, "uses_cross_attention_cache", False):
            self.cross = CrossAttentionInputs(
                self.model,
                self.vllm_config,
                self.device,
                self.graphs,
                self._max_items_per_prompt(),
            )
        elif supports_multimodal(self.model):
            self.mm = MultimodalInputs(
                self.model, self.device, self.graphs, self._max_encoder_items()
            )
        logger.info(
            "Loaded %s in %.1f s on %s",
            self.model_config.model,
            time.perf_counter() - start,
            self.device,
        )

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

    def _graph_mode(self) -> str:
        mode = self.plugin_config.graph_mode
        if mode == "auto":
            return "eager" if self.model_config.enforce_eager else "compile"
        if mode == "graphs":
            raise NotImplementedError(
                "hpu_mm.graph_mode='graphs' (captured HPU/CUDA graphs) is not "
                "implemented yet; use 'compile' (torch.compile per bucket) or "
                "'eager'"
            )
        return str(mode)

    def warmup(self) -> None:
        assert self.graphs is not None
        warm_up(self)

    def get_model(self) -> torch.nn.Module:
        assert self.model is not None, "load_model() first"
        return self.model

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return kv_cache_specs(self.vllm_config)

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self.kv_caches = allocate_kv_caches(self.vllm_config, config, self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens, %d layers, %.1f MiB",
            config.num_blocks,
            self.block_size,
            len(self.kv_caches),
            sum(t.numel() * t.element_size() for t in self.kv_caches.values()) / 2**20,
        )

    @torch.inference_mode()
    def profile_peak_activation_bytes(self) -> int:
        """Peak device bytes of one forward at the largest token budget."""
        sc = self.vllm_config.scheduler_config
        num_tokens = sc.max_num_batched_tokens
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.zeros_like(ids)
        model: Any = self.get_model()
        before = dev.peak_memory_bytes()
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            hidden = model(input_ids=ids, positions=positions)
        model.compute_logits(hidden[: sc.max_num_seqs])
        dev.synchronize()
        return max(dev.peak_memory_bytes() - before, 0)

    # ---- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        self.requests.update(scheduler_output)
        zero_blocks(self.kv_caches, scheduler_output.new_block_ids_to_zero or [])
        if self.mm is not None:
            self.mm.on_new_requests(scheduler_output.scheduled_new_reqs)
            self.mm.run_encoders(scheduler_output, self.requests)
        if self.cross is not None:
            self.cross.update(scheduler_output, self.requests)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = order_requests(scheduler_output.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        query_lens = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], np.int64
        )
        batch = build_step(
            req_ids,
            states,
            query_lens,
            self.shapes,
            self.block_size,
            self.device,
            self.buffers,
            self.shapes.decode_form,
        )
        logits = self.forward(batch, states)
        return self.sample(batch, states, logits)

    def forward(self, batch: StepBatch, states: list[RequestState]) -> torch.Tensor:
        """Run the model on the padded batch; logits of each request's last row."""
        graphs = self.graphs
        assert graphs is not None, "load_model() first"
        input_ids: torch.Tensor | None = batch.input_ids
        embeds = None
        if self.mm is not None:
            embeds, batch.attn_metadata.mm_maps = self.mm.embed(batch, states)  # type: ignore[assignment]
            input_ids = None
        if self.cross is not None:
            batch.attn_metadata.cross = self.cross.metadata(batch, states)
        hidden = graphs.run_step(
            batch.attn_metadata, self.vllm_config, input_ids, batch.positions, embeds
        )
        logits = graphs.logits(hidden.index_select(0, batch.logits_rows))
        return logits[: batch.num_reqs]

    def sample(
        self, batch: StepBatch, states: list[RequestState], logits: torch.Tensor
    ) -> ModelRunnerOutput:
        metadata = build_sampling_metadata(
            states, self.model_config.get_vocab_size(), self.device
        )
        out = self.sampler(logits, metadata)
        sampled = out.sampled_token_ids[:, 0].tolist()
        tokens: list[list[int]] = []
        for state, n, token in zip(states, batch.query_lens, sampled, strict=True):
            # A chunk that stops short of the end of the known tokens is a partial
            # prefill: its sampled token is not part of the output.
            if state.num_computed_tokens + int(n) >= state.num_tokens:
                state.output_token_ids.append(token)
                tokens.append([token])
            else:
                tokens.append([])
        logprobs = out.logprobs_tensors.tolists() if out.logprobs_tensors else None
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=tokens,
            logprobs=logprobs,
        )
