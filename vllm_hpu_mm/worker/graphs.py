"""Graph mode: the model compiled per step shape, region by region.

Which of the two the runner does is the execution plan's (``vllm_hpu_mm.plan``).
Attention is traced into the compiled code (``execution: static``, the default
on Gaudi), so a graph is keyed by the whole step shape: token rows,
decode rows and blocks, prefill blocks (see
``vllm_hpu_mm.bucketing.buckets.step_shapes``); or it runs as vLLM's opaque
attention op between compiled pieces (``dynamic``, the default elsewhere), so a graph
is keyed by its token rows only. A mixed step runs as a decode
pass and a prefill pass (``worker.inputs.step_passes``), so the two parts' keys
add up instead of multiplying; where the token count is symbolic (opaque
attention off Gaudi) or nothing is compiled (eager off Gaudi), as one pass,
which reads the weights once (``ExecutionPlan.split_mixed_steps``).

Regional compilation (as the official Gaudi plugin does): each decoder layer
(every child of a ``ModuleList`` holding vLLM attention layers) runs through one
compiled function, and the logits head once per batch size; the embedding and
the final norm run eagerly around them. One graph per layer shape serves every
layer: Dynamo inlines the layer modules (their weights are graph inputs), and
the only per-layer constant it would guard on, the attention layers'
``layer_name`` (the key vLLM's attention path looks the layer and its KV cache
up by in the forward context), is replaced by a per-position alias
(``hpu_mm.region.<k>``) that ``LayerRegion`` points at the running layer's
modules, in the step's own copy of the forward context's layer table, before
each call. Each compilation goes through
``counting_backend``, which increments ``vllm_hpu_mm:graph_compiles_total``: the
counter hooks the compiler itself, so a shape that was not prepared at warmup
shows up there.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.attention import Attention
from vllm.sequence import IntermediateTensors

from vllm_hpu_mm import device as dev
from vllm_hpu_mm import metrics
from vllm_hpu_mm.fused_ops import StepRope
from vllm_hpu_mm.plan import ExecutionPlan
from vllm_hpu_mm.worker.inputs import step_passes
from vllm_hpu_mm.worker.pipeline import (
    PipelineStage,
    cat_rows,
    empty_intermediate,
    slice_rows,
)

SINGLE_STAGE = PipelineStage(0, 1)

logger = logging.getLogger("vllm.hpu_mm.graphs")


AOT_EAGER = "aot_eager"


def choose_backend(plan: ExecutionPlan, configured: str = "auto") -> str:
    """The torch.compile backend of graph mode (``hpu_mm.warmup.compile_backend``):
    Habana's ``hpu_backend`` on Gaudi, whatever is asked (any other value is
    refused there); off Gaudi the configured one, and for ``auto``
    ``aot_eager`` on the CPU's static plan (every step shape is a graph, and
    Inductor spends some 10 s generating and compiling C++ for each on a
    2-core machine), Inductor otherwise."""
    if plan.device_kind == "hpu":
        if configured != "auto":
            raise RuntimeError(
                f"hpu_mm.warmup.compile_backend = {configured!r}: Gaudi compiles "
                "with Habana's hpu_backend only; leave it 'auto'"
            )
        return dev.compile_backend()
    if configured != "auto":
        return configured
    if plan.name == "static" and plan.device_kind == "cpu":
        return AOT_EAGER
    return "inductor"


def aot_eager_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``aot_eager`` as graph mode uses it: the Dynamo graph lowered through
    AOTAutograd as Habana's ``hpu_backend`` lowers it (functionalised ATen,
    input mutations kept in the graph), then Inductor's reinplacing passes,
    so the KV-cache write (a custom op that mutates the cache, traced as
    ``auto_functionalized``) writes its slots in place instead of cloning the
    whole cache and copying it back on every call; no code is generated, the
    graph runs op by op. Each graph is still one static shape, compiled once
    at warmup and counted."""
    from torch._dynamo.backends.common import aot_autograd

    lowered = aot_autograd(
        fw_compiler=_reinplaced,
        inference_compiler=_reinplaced,
        keep_inference_input_mutations=True,
    )
    return lowered(gm, example_inputs)


def _reinplaced(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    from functorch.compile import make_boxed_func
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V

    # The passes build nodes under Inductor's fake mode (a write through a
    # view becomes a generalized scatter): the graph's own.
    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(placeholders) or detect_fake_mode(example_inputs)
    with V.set_fake_mode(fake_mode):
        reinplace_inplaceable_ops(FakeTensorUpdater(gm), gm.graph)
    decompose_auto_functionalized(gm.graph)
    for node in list(gm.graph.nodes):  # copy_(x, x): the write-back, now in place
        if node.target is torch.ops.aten.copy_.default and node.args[0] is node.args[1]:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return make_boxed_func(gm.forward)


class CompileCounter:
    """A torch.compile backend that counts compilations, then delegates."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.count = 0
        self.phase = "warmup"  # set to "serving" once warmup ends

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.count += 1
        metrics.GRAPH_COMPILES.labels(phase=self.phase).inc()
        if self.inner == AOT_EAGER:
            return aot_eager_backend(gm, example_inputs)
        from torch._dynamo import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


class LayerRegion:
    """Runs decoder layers through one compiled function shared by all layers.

    Each layer's named sublayers (modules with a ``layer_name`` registered in
    vLLM's static forward context: attention, cross-attention) get the alias
    of their position inside the layer; before a layer runs, the aliases in the
    current forward context's layer table point at that layer's sublayers.
    """

    def __init__(self, layers: list[torch.nn.Module], compiled: Callable[..., Any]):
        self.compiled = compiled
        self.named: dict[int, list[torch.nn.Module]] = {}
        for layer in layers:
            subs = [m for m in layer.modules() if isinstance(_name_of(m), str)]
            for k, sub in enumerate(subs):
                sub.layer_name = f"{ALIAS}{k}"  # type: ignore[assignment]
            self.named[id(layer)] = subs
            layer.forward = self._bind(layer)  # type: ignore[method-assign]

    def _bind(self, layer: torch.nn.Module) -> Callable[..., Any]:
        original = layer.forward
        subs = self.named[id(layer)]
        signature = inspect.signature(original)

        def forward(*args: Any, **kwargs: Any) -> Any:
            table = _step_layer_table()
            if table is not None:
                for k, sub in enumerate(subs):
                    table[f"{ALIAS}{k}"] = sub
            bound = signature.bind(*args, **kwargs)
            _zero_first_residual(bound.arguments)
            return self.compiled(original, *bound.args, **bound.kwargs)

        return forward


def _zero_first_residual(arguments: dict[str, Any]) -> None:
    """The first layer gets ``residual=None`` where later ones get a tensor,
    which would make it a graph of its own. A zero residual gives the same
    values (the fused add-norm adds 0 exactly, and the new residual is the
    hidden state itself), so every layer shares one graph."""
    if "residual" in arguments and arguments["residual"] is None:
        hidden = arguments.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            arguments["residual"] = torch.zeros_like(hidden)


ALIAS = "hpu_mm.region."


def _name_of(module: torch.nn.Module) -> object:
    name = module.__dict__.get("layer_name")
    return name if isinstance(name, str) else None


def _call_layer(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


class _StepLayers(dict):  # type: ignore[type-arg]
    """A forward context's own copy of vLLM's layer table (name -> layer)."""


def _step_layer_table() -> dict[str, Any] | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    _own_layer_table()
    return get_forward_context().no_compile_layers


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of every ModuleList that holds vLLM attention layers (the
    decoder layer stacks), found by structure rather than by class name."""
    layers: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and any(
            isinstance(m, Attention) for m in module.modules()
        ):
            layers += [child for child in module if child not in layers]
    return layers


def has_attention(model: torch.nn.Module) -> bool:
    """Whether the model holds vLLM attention layers."""
    return any(isinstance(m, Attention) for m in model.modules())


def attention_is_opaque(model: torch.nn.Module) -> bool:
    """Whether the model's attention layers call vLLM's opaque attention op (the
    platform's ``opaque_attention_op``) rather than the backend directly."""
    return any(
        not m.use_direct_call for m in model.modules() if isinstance(m, Attention)
    )


class GraphRunner:
    """Runs the body and the logits head eagerly or compiled.

    Traced attention: one graph per step shape and region (torch.compile with
    dynamic=False). Opaque attention, where a graph sees the token rows alone:
    on Gaudi the same, one graph per token count; on the CPU and CUDA the token
    count is a symbolic size (``dynamic``: torch's automatic dynamic shapes), so
    each region compiles once for a single row (torch specialises sizes 0 and 1)
    and once for every larger count, and the batch sizes of the logits head
    likewise. Warmup still runs every bucket, and serving still pads to them."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: ExecutionPlan,
        backend: str,
        regional: bool = True,
        compile_cache_dir: str | None = None,
        stage: PipelineStage = SINGLE_STAGE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.plan = plan
        # Pipeline parallelism: a later stage's body starts from the previous
        # stage's intermediate tensors (``dtype``), an earlier one's ends there.
        self.stage = stage
        self.dtype = dtype
        self.mode = mode = plan.graph_mode
        self.counter = CompileCounter(backend)
        # fused RoPE (HPU): cos/sin gathered once per body call, not per layer
        layers = decoder_layers(model)
        self.rope = StepRope(layers or [model])
        if self.rope.modules:
            logger.info(
                "vllm-hpu-mm fused RoPE: cos/sin gathered once per step for %d "
                "rotary module(s) (%s), shared by %d layers",
                len(self.rope.modules),
                ", ".join(sorted({type(m).__name__ for m in self.rope.modules})),
                len(layers),
            )
        self.regions = 0
        self.cache_dir: str | None = None
        opaque = attention_is_opaque(model)
        if has_attention(model) and plan.opaque_attention != opaque:
            raise RuntimeError(
                f"the model's attention layers are "
                f"{'' if opaque else 'not '}vLLM's opaque op, "
                f"but the execution plan ({plan.name}, graph mode {mode}) says "
                f"opaque_attention={plan.opaque_attention}: the model was built "
                "under another vLLM config than the runner's"
            )
        # torch.compile's ``dynamic``: None lets a second token count recompile
        # the region with the count symbolic; False keeps every count static.
        self.dynamic: bool | None = None if plan.symbolic_tokens else False
        self._body: Callable[..., torch.Tensor] = self._run_body
        self._logits: Callable[[torch.Tensor], torch.Tensor] = self._run_logits
        if mode == "compile":
            _raise_recompile_limits()
            self.cache_dir = use_compile_cache(compile_cache_dir)
            if not regional:
                layers = []
            if layers:
                compiled = torch.compile(
                    _call_layer, backend=self.counter, dynamic=self.dynamic
                )
                self.region = LayerRegion(layers, compiled)
            self.regions = len(layers)
            if not layers:  # whole body as one graph
                self._body = torch.compile(
                    self._run_body, backend=self.counter, dynamic=self.dynamic
                )
            self._logits = torch.compile(
                self._run_logits, backend=self.counter, dynamic=self.dynamic
            )
        logger.info(
            "vllm-hpu-mm graph mode: %s (backend %s, %s%s)",
            mode,
            backend,
            f"{self.regions} compiled decoder layers" if self.regions else "whole body",
            f", compile cache {self.cache_dir}" if self.cache_dir else "",
        )

    def _run_body(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        intermediate: IntermediateTensors | None = None,
    ) -> Any:
        if intermediate is None:  # the first (or only) stage
            return self.model(
                input_ids=input_ids, positions=positions, inputs_embeds=inputs_embeds
            )
        return self.model(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate,
            inputs_embeds=inputs_embeds,
        )

    def _run_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_rows)  # type: ignore[operator]

    def body(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        intermediate: IntermediateTensors | None = None,
    ) -> Any:
        """Token ids, or (multimodal models) merged input embeddings; a later
        pipeline stage's ``intermediate`` tensors. Hidden states, or (a stage
        before the last) the intermediate tensors for the next stage."""
        with self.rope.step(positions):
            if intermediate is None:
                out = self._body(input_ids, positions, inputs_embeds)
            else:
                out = self._body(input_ids, positions, inputs_embeds, intermediate)
        dev.mark_step()
        return out

    def run_step(
        self,
        attn_metadata: Any,
        vllm_config: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        merge: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor] | None = None,
        intermediate: IntermediateTensors | None = None,
        before_pass: Callable[[int, int], None] | None = None,
    ) -> Any:
        """The body over a step's token rows, in one pass, or (a mixed step
        where the plan's ``split_mixed_steps``) one pass per part, decode rows
        then prefill rows, each under its own forward context.
        Multimodal models: ``merge(input_ids, mm_maps)`` turns each pass's
        token ids into its input embeddings, reading the maps of the pass's
        metadata. ``before_pass(start, stop)`` is told each pass's rows first
        (LoRA: the adapter slots of those rows). Returns the hidden states of
        every token row, in row order;
        a pipeline stage before the last, its intermediate tensors instead.
        A later stage reads the rows of each pass from ``intermediate``
        (``[T, H]`` per tensor, T the step's padded rows; zeros where none is
        given: warmup)."""
        if not self.stage.is_first:
            if merge is not None:
                raise RuntimeError("only the first pipeline stage merges embeddings")
            if intermediate is None:
                intermediate = empty_intermediate(
                    self.model, input_ids.shape[0], self.dtype, input_ids.device
                )
        outs = []
        for p in step_passes(attn_metadata, split=self.plan.split_mixed_steps):
            if before_pass is not None:
                before_pass(p.start, p.stop)
            ids = input_ids[p.start : p.stop]
            with set_forward_context(
                p.attn_metadata, vllm_config, num_tokens=p.stop - p.start
            ):
                _own_layer_table()
                # positions: [T] or (M-RoPE) [channels, T]; a pass's columns of
                # the latter are copied out contiguous, the layout warmup
                # compiled for (a strided view would be a new graph).
                pos = positions[..., p.start : p.stop].contiguous()
                if intermediate is not None:
                    rows = slice_rows(intermediate, p.start, p.stop)
                    outs.append(self.body(ids, pos, None, rows))
                elif merge is None:
                    outs.append(self.body(ids, pos))
                else:
                    embeds = merge(ids, p.attn_metadata.mm_maps)
                    outs.append(self.body(None, pos, embeds))
        if not self.stage.is_last:
            return cat_rows(outs)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden_rows)

    @property
    def compiles(self) -> int:
        return self.counter.count


def _own_layer_table() -> None:
    """Give the current forward context its own copy of the layer table, so
    the region aliases never enter vLLM's static forward context (whose keys
    are the model's layers, e.g. for KV-cache specs)."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    if not isinstance(ctx.no_compile_layers, _StepLayers):
        ctx.no_compile_layers = _StepLayers(ctx.no_compile_layers)


def default_compile_cache_dir() -> str:
    """``$XDG_CACHE_HOME/vllm-hpu-mm/torch-compile`` (``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "vllm-hpu-mm", "torch-compile")


def use_compile_cache(configured: str | None) -> str:
    """Point Inductor's on-disk caches (its FX graph cache and AOTAutograd's,
    both under ``TORCHINDUCTOR_CACHE_DIR``) at a persistent directory, so that
    on the CPU and CUDA a later start of the same model loads its compiled
    code instead of generating it again (Dynamo still traces every graph at
    each start). A configured directory wins; else an existing
    ``TORCHINDUCTOR_CACHE_DIR`` is kept; else the user's cache directory
    (torch's own default is under the temporary directory). The cache keys on
    the graph, its input shapes (the KV cache's among them) and torch's
    version, so a changed model, bucket set or KV-cache size compiles afresh;
    not on the CPU kernels in use, so the graphs go into a subdirectory named
    by them (``device.cpu_kernel_tag``): a start with other instruction-set
    limits (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``) compiles its own.

    On Gaudi this directory does nothing: ``hpu_backend`` does not use
    Inductor, and the only on-disk cache of compiled graphs is Habana's recipe
    cache, ``PT_HPU_RECIPE_CACHE_CONFIG`` (which the platform points at
    ``<compile_cache_dir>/hpu-recipes`` when it is unset:
    ``device.gaudi_compile_env``); the log line says which cache applies.

    Torch writes its default into ``TORCHINDUCTOR_CACHE_DIR`` the first time it
    resolves the directory (vLLM may do so before the model loads), so a value
    equal to torch's default counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = configured or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path and not configured and _same_path(path, default_cache_dir()):
        path = None
    path = os.path.abspath(os.path.expanduser(path or default_compile_cache_dir()))
    tag = dev.cpu_kernel_tag()
    if os.path.basename(path) != tag:  # not chosen already by this process
        path = os.path.join(path, tag)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    if dev.device_kind() == "hpu":
        recipes = os.environ.get(dev.RECIPE_CACHE_ENV)
        logger.info(
            "Compile cache on Gaudi: %s (TORCHINDUCTOR_CACHE_DIR is not read by "
            "hpu_backend)",
            f"recipes in {dev.RECIPE_CACHE_ENV}={recipes}"
            if recipes
            else f"none: {dev.RECIPE_CACHE_ENV} is unset, so every start compiles "
            "every graph (set hpu_mm.warmup.compile_cache_dir)",
        )
    return path


def _same_path(a: str, b: str) -> bool:
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(b)


def _raise_recompile_limits() -> None:
    # One graph per step shape (and region) is intended, not a recompilation
    # storm: lift Dynamo's default per-function cache limit (8) so every shape
    # keeps its graph.
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4096)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, 65536
    )
