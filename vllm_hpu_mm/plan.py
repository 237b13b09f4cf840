"""The execution plan: which path the engine runs, decided once at start-up.

Two paths (``hpu_mm.execution``):

- ``static``, Gaudi's path (the official plugin's layouts): attention traced
  into one static graph per bucketed step shape, prefill in tiles, decode over
  the flat block list, a mixed step as a decode pass then a prefill pass,
  Mllama's flat cross-attention layout, one encoder graph per image bucket, no
  dense decode cache, no prepacked linear weights. Selectable on every device,
  so the CPU and CUDA run what Gaudi runs; with ``graph_mode: eager`` the same
  layouts run without graphs.
- ``dynamic``, the fast path off Gaudi: attention as vLLM's opaque op between
  compiled pieces (keyed by the token count, a symbolic size on the CPU and
  CUDA), and off Gaudi attention reads host-side lengths: prefill request by
  request, decode over the real rows and blocks of the batched table (the
  dense decode cache on the CPU), prepacked bfloat16 linear weights on the CPU.
  On Gaudi, where every shape is a graph, ``dynamic`` keeps attention opaque
  with static token counts and Gaudi's layouts.

``auto`` is ``static`` on Gaudi and ``dynamic`` elsewhere. The deprecated
``graph_attention`` maps onto it (``traced``: static, ``opaque``: dynamic; the
config refuses a contradiction). Everything else (metadata, attention backend,
runner, warmup, encoder inputs) reads an ``ExecutionPlan`` and decides nothing.
Pure Python: the device kind is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from vllm_hpu_mm.config import HpuMMConfig

if TYPE_CHECKING:
    from vllm_hpu_mm.attention.metadata import DecodeForm, MetadataKind

PlanName = Literal["static", "dynamic"]
GraphMode = Literal["eager", "compile"]


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """The facts of one plan on one device; every field is derived in
    ``build_plan`` and nowhere else."""

    name: PlanName
    reason: str  # why this plan: the setting that chose it
    device_kind: str  # "hpu", "cuda" or "cpu"
    graph_mode: GraphMode
    """``compile``: torch.compile graphs per bucket; ``eager``: none."""
    opaque_attention: bool
    """Attention runs as vLLM's opaque op between the compiled pieces (the
    platform's ``opaque_attention_op``); False: traced into the graphs, or
    called directly in eager mode."""
    symbolic_tokens: bool
    """Graphs keyed by the token count alone take it as a symbolic size (one
    graph for every count, two per region); the encoder's image count likewise.
    False: every bucket is its own static graph."""
    host_attention: bool
    """Attention never runs under a graph and may read host-side lengths: the
    real decode rows and blocks (padding skipped) and the prefill requests."""
    per_request_prefill: bool
    """Prefill attention request by request (one SDPA each) instead of tiles."""
    dense_decode_cache: bool
    """The dense decode cache may be built (if ``memory.decode_cache_fraction``
    lets it)."""
    split_mixed_steps: bool
    """A mixed step runs as a decode pass and a prefill pass (each its own
    graph key), not one pass over all rows."""
    per_request_cross: bool
    """Mllama: prefill cross-attention request by request over its own images'
    rows; False: the flat ``[T, N x rows]`` layout."""
    decode_form: DecodeForm
    """Decode metadata: the flat block list (Gaudi's) or the batched table."""
    prepack_linear: bool
    """bfloat16 linear weights may be prepacked for oneDNN (the CPU; if
    ``memory.cpu_prepacked_linear`` and the CPU supports it)."""
    padded_sampler: bool
    """The sampler runs on logits padded to a batch bucket (warmed up), as the
    logits head does: graph mode with every graph at a fixed shape. False: at
    the real batch size."""
    static_encoder_attention: bool
    """Vision encoders' attention (vLLM's ``MMEncoderAttention``) runs as one
    masked SDPA a layer over the whole padded patch sequence, FusedSDPA on
    Gaudi (``attention.encoder``); False: vLLM's form, which reads the segment
    offsets on the host and runs one SDPA per segment."""

    @property
    def attention_metadata(self) -> MetadataKind:
        """The attention metadata the steps carry (``attention.metadata``):
        ``dynamic`` (host-side lengths) where attention never runs under a
        graph (``host_attention``); ``static`` (graph inputs only) otherwise,
        the dynamic plan on Gaudi included (every shape is a graph there)."""
        return "dynamic" if self.host_attention else "static"

    def describe(self) -> str:
        """One start-up log line: the plan, why, and its facts."""
        facts = [
            f"graph mode {self.graph_mode}",
            "attention "
            + (
                "opaque op"
                if self.opaque_attention
                else "traced"
                if self.graph_mode == "compile"
                else "direct"
            ),
            "symbolic token count" if self.symbolic_tokens else "static token counts",
            "prefill per request" if self.per_request_prefill else "tiled prefill",
            f"{self.decode_form} decode"
            + (" over real rows" if self.host_attention else ""),
            "dense decode cache allowed"
            if self.dense_decode_cache
            else "no dense cache",
            "mixed steps in two passes"
            if self.split_mixed_steps
            else "mixed in one pass",
            "cross-attention per request"
            if self.per_request_cross
            else "flat cross-attention",
            "prepacked linear allowed" if self.prepack_linear else "no prepacking",
            "sampler at batch buckets"
            if self.padded_sampler
            else "sampler at the real batch",
            "encoder attention masked, one call a layer"
            if self.static_encoder_attention
            else "encoder attention per segment",
        ]
        return (
            f"vllm-hpu-mm execution plan: {self.name} ({self.reason}) on "
            f"{self.device_kind}: " + ", ".join(facts)
        )


def _choose(config: HpuMMConfig, kind: str) -> tuple[PlanName, str]:
    """The plan's name and the reason, from ``execution`` and the deprecated
    ``graph_attention`` (the config already refused their contradictions)."""
    if config.execution == "static" or config.execution == "dynamic":
        return config.execution, f"hpu_mm.execution = {config.execution!r}"
    if config.graph_attention != "auto":
        legacy: PlanName = "static" if config.graph_attention == "traced" else "dynamic"
        return legacy, (
            f"deprecated hpu_mm.graph_attention = {config.graph_attention!r}; "
            f"use hpu_mm.execution = {legacy!r}"
        )
    if kind == "hpu":
        return "static", "execution auto on hpu"
    return "dynamic", f"execution auto on {kind}"


def build_plan(config: HpuMMConfig, kind: str, enforce_eager: bool) -> ExecutionPlan:
    """The plan for ``config`` on a device of ``kind``; ``enforce_eager``
    (vLLM's ``--enforce-eager``) decides ``graph_mode: auto``."""
    name, reason = _choose(config, kind)
    mode: GraphMode
    if config.graph_mode == "auto":
        mode = "eager" if enforce_eager else "compile"
    else:
        mode = "eager" if config.graph_mode == "eager" else "compile"
    dynamic = name == "dynamic"
    opaque = dynamic and mode == "compile"
    # Gaudi's graph compiler takes static shapes only: on HPU every shape is
    # its own graph (lazy or compiled), so attention never reads host lengths.
    host = dynamic and kind != "hpu"
    return ExecutionPlan(
        name=name,
        reason=reason,
        device_kind=kind,
        graph_mode=mode,
        opaque_attention=opaque,
        symbolic_tokens=opaque and kind != "hpu",
        host_attention=host,
        per_request_prefill=host,
        # On an accelerator the KV cache fills the memory left: no extra copy.
        dense_decode_cache=host and kind == "cpu",
        split_mixed_steps=not host,
        per_request_cross=host,
        decode_form="batched" if host else "flat",
        prepack_linear=dynamic and kind == "cpu",
        padded_sampler=mode == "compile" and not (opaque and kind != "hpu"),
        # Where attention may not read host lengths, neither may the encoder's.
        static_encoder_attention=not host,
    )


def plan_of(vllm_config: Any, kind: str | None = None) -> ExecutionPlan:
    """The plan of a ``VllmConfig``: its ``hpu_mm`` settings, its
    ``enforce_eager``, on this process's device (or ``kind``)."""
    from vllm_hpu_mm.config import load_plugin_config

    if kind is None:
        from vllm_hpu_mm import device

        kind = device.device_kind()
    model_config = getattr(vllm_config, "model_config", None)
    eager = bool(getattr(model_config, "enforce_eager", False))
    return build_plan(load_plugin_config(vllm_config), kind, eager)


def current_plan() -> ExecutionPlan:
    """The plan of vLLM's current config (for objects vLLM builds under it:
    the platform's ``opaque_attention_op``, the attention layers); the
    default settings where vLLM has none set."""
    from vllm.config import get_current_vllm_config

    try:
        vllm_config = get_current_vllm_config()
    except AssertionError:  # none set (a layer built by hand): the defaults
        vllm_config = None
    return plan_of(vllm_config)


def one_request_forms(plan: ExecutionPlan, bucketing: Any) -> bool:
    """Whether one-request prefill parts run in their own forms
    (``layout.PrefillForm``): ``bucketing.prefill_one_request`` on a plan whose
    attention is traced into the graphs with the static metadata (the static
    plan); graphs keyed by token rows alone (opaque attention) keep tiles."""
    return bool(
        bucketing.prefill_one_request
        and plan.attention_metadata == "static"
        and not plan.opaque_attention
    )
