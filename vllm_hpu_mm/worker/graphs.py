"""Graph mode: the model body and the logits head, compiled per bucket.

The body is keyed by the step's token rows, the logits head by its batch rows;
attention runs inside vLLM's opaque attention op with bucketed metadata. Each
compilation goes through ``counting_backend``, which increments
``vllm_hpu_mm:graph_compiles_total``: the counter hooks the compiler itself, so
a shape that was not prepared at warmup shows up there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_hpu_mm import device as dev
from vllm_hpu_mm import metrics

logger = logging.getLogger("vllm.hpu_mm.graphs")


class CompileCounter:
    """A torch.compile backend that counts compilations, then delegates."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.count = 0
        self.phase = "warmup"  # set to "serving" once warmup ends

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.count += 1
        metrics.GRAPH_COMPILES.labels(phase=self.phase).inc()
        from torch._dynamo import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


class GraphRunner:
    """Runs the body and the logits head eagerly or compiled (one graph per
    bucket size; torch.compile with dynamic=False)."""

    def __init__(self, model: torch.nn.Module, mode: str, backend: str) -> None:
        self.model = model
        self.mode = mode
        self.counter = CompileCounter(backend)
        self._body: Callable[..., torch.Tensor] = self._run_body
        self._logits: Callable[[torch.Tensor], torch.Tensor] = self._run_logits
        if mode == "compile":
            _raise_recompile_limits()
            self._body = torch.compile(
                self._run_body, backend=self.counter, dynamic=False
            )
            self._logits = torch.compile(
                self._run_logits, backend=self.counter, dynamic=False
            )
        logger.info("vllm-hpu-mm graph mode: %s (backend %s)", mode, backend)

    def _run_body(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, positions=positions, inputs_embeds=inputs_embeds
        )

    def _run_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_rows)  # type: ignore[operator]

    def body(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids, or (multimodal models) merged input embeddings."""
        out = self._body(input_ids, positions, inputs_embeds)
        dev.mark_step()
        return out

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden_rows)

    @property
    def compiles(self) -> int:
        return self.counter.count


def _raise_recompile_limits() -> None:
    # One graph per bucket is intended, not a recompilation storm: lift Dynamo's
    # default per-function cache limit (8) so every bucket keeps its graph.
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 1024)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, 4096
    )
