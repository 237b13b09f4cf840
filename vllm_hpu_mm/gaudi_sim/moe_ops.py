"""The simulated Habana MoE op, ``torch.ops.hpu.mixture_of_experts``, with the
bridge's two schemas (HabanaAI gaudi-pytorch-bridge, op registrations and
``hpu_ops/mixture_of_experts.cpp``)::

    mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table,
        Tensor router_weights, Tensor[] w1, Tensor[] w2, Tensor[] w3,
        bool permuted_weights, str activation, int experts_min,
        int experts_max, *, bool? recomp=True) -> Tensor
    mixture_of_experts.fused_weights(Tensor hidden_states,
        Tensor expert_routing_table, Tensor router_weights, Tensor[] w12,
        Tensor[] w3, bool permuted_weights, str activation, int experts_min,
        int experts_max, *, bool? recomp=True) -> Tensor

``hidden_states`` is ``[T, H]``; ``expert_routing_table`` and
``router_weights`` are ``[T, k]`` (each token's experts and their weights);
the weight lists hold one tensor per expert of ``experts_min ..
experts_max``: ``w12[e]`` gate rows then up rows, ``w3[e]`` the down
projection (``w1``/``w2``/``w3``: gate, up, down apart, as optimum-habana's
Mixtral passes them). ``permuted_weights=True`` is the layout of a linear
layer's weight, ``[out, in]`` (``w12[e]`` ``[2I, H]``, ``w3[e]`` ``[H, I]``),
which is how vllm-gaudi passes vLLM's ``w13_weight[e]`` / ``w2_weight[e]``
views (``ops/hpu_fused_moe.py``, ``extension/ops.py``
``VllmMixtureOfExpertsOp``); ``False`` is the transposed ``[in, out]``.
The output is ``[T, H]`` in the dtype of ``hidden_states`` (the bridge's meta
function). A routed expert outside ``experts_min .. experts_max`` contributes
nothing: vllm-gaudi splits the experts into slices, calls the op once per
slice with the whole routing table and sums the slices (``VllmMixtureOfExpertsOp.
forward`` with ``MAX_EXPERTS_PER_SLICE``), and expert parallelism passes each
rank's range.

Refused as the real op refuses:

- an activation other than ``gelu``, ``relu``, ``silu`` (the bridge's
  ``activationModeMap``: 'Activation "..." not found among
  MoeActivationMode_t enum values.'); vllm-gaudi maps HF's tanh-GELU names to
  ``gelu``, so ``gelu`` here is the tanh approximation (its note on the Gaudi
  GELU kernel);
- weights given as one stacked tensor instead of a list (the schema's
  ``Tensor[]``: torch's dispatcher refuses it before the op runs);
- ``router_weights`` or an expert weight in another dtype than
  ``hidden_states`` (the bridge picks the kernel by ``hidden_states``' dtype,
  ``get_guid_with_precision("moe", ...)``; vllm-gaudi casts the router weights
  to ``x.dtype`` because float32 ones with bfloat16 activations failed to
  compile, synStatus 26), and a routing table that is not int64 (vllm-gaudi:
  the kernel "compiles for ... int64 routing tables");
- routing tables and weights of different shapes, or a token count other
  than ``hidden_states``'.

Also refused, where the real op's behaviour is not documented and the
simulation will not guess: weight lists whose length is not ``experts_max -
experts_min + 1`` or differs between the lists, a negative or empty range,
expert weights of the wrong shape for ``permuted_weights``. ``recomp`` is a
memory/recompute choice of the kernel and changes nothing here.

Numerics: each expert is a gated MLP in the activations' dtype (matmuls with
float32 accumulation, as on the CPU), its output weighted in that dtype, and
the top-k contributions summed in float32 and rounded once; the kernel's own
internal precision is not published.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
SCHEMA_TAIL = (
    "bool permuted_weights, str activation, int experts_min, int experts_max, "
    "*, bool? recomp=True) -> Tensor"
)
SCHEMAS = {
    "mixture_of_experts": (
        "mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table, "
        "Tensor router_weights, Tensor[] w1, Tensor[] w2, Tensor[] w3, " + SCHEMA_TAIL
    ),
    "mixture_of_experts.fused_weights": (
        "mixture_of_experts.fused_weights(Tensor hidden_states, "
        "Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, "
        "Tensor[] w3, " + SCHEMA_TAIL
    ),
}


class MoeCounts:
    """Calls of ``mixture_of_experts`` in this process and the tokens routed to
    each expert id (tests read them). The op's body runs eagerly, also when a
    compiled graph calls the op, and reads no value back to the host; Dynamo
    never traces it (``register``), so a graph that calls the op holds it as
    one node and guards on none of these counts."""

    calls = 0
    routed: dict[int, torch.Tensor] = {}  # expert id -> tokens routed to it (0-D)
    # (experts_min, experts_max, rows of w12[e], columns of w12[e]) of the calls:
    # which experts a rank ran and what slice of each one it holds
    ranges: set[tuple[int, int, int, int]] = set()


class MoeArgumentError(RuntimeError):
    """An argument the real op refuses (or whose meaning it does not define)."""


def _check(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w12: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> None:
    if activation not in ACTIVATIONS:
        raise MoeArgumentError(
            f'Activation "{activation}" not found among MoeActivationMode_t enum '
            f"values. (accepted: {', '.join(ACTIVATIONS)})"
        )
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise MoeArgumentError(
            f"mixture_of_experts: hidden_states {tuple(x.shape)} must be [T, H] and "
            f"expert_routing_table {tuple(ids.shape)} [T, k] for the same T"
        )
    if weights.shape != ids.shape:
        raise MoeArgumentError(
            f"mixture_of_experts: router_weights {tuple(weights.shape)} and "
            f"expert_routing_table {tuple(ids.shape)} differ ([T, k] both)"
        )
    if ids.dtype != torch.int64:
        raise MoeArgumentError(
            f"mixture_of_experts: expert_routing_table is {ids.dtype}, the kernel "
            "takes int64"
        )
    if weights.dtype != x.dtype:
        raise MoeArgumentError(
            f"mixture_of_experts: router_weights are {weights.dtype} but "
            f"hidden_states {x.dtype}: the kernel is chosen by hidden_states' dtype "
            "(cast the router weights to it)"
        )
    span = experts_max - experts_min + 1
    if experts_min < 0 or span < 1 or len(w12) != span or len(w3) != span:
        raise MoeArgumentError(
            f"mixture_of_experts: experts_min={experts_min}, experts_max="
            f"{experts_max} is {span} expert(s), but the weight lists hold "
            f"{len(w12)} and {len(w3)}: one weight per expert of the range"
        )
    hidden = x.shape[1]
    inter2 = w12[0].shape[0 if permuted_weights else 1]
    want12 = (inter2, hidden) if permuted_weights else (hidden, inter2)
    want3 = (hidden, inter2 // 2) if permuted_weights else (inter2 // 2, hidden)
    for e, (a, b) in enumerate(zip(w12, w3, strict=True)):
        if a.dtype != x.dtype or b.dtype != x.dtype:
            raise MoeArgumentError(
                f"mixture_of_experts: expert {experts_min + e}'s weights are "
                f"{a.dtype}/{b.dtype}, hidden_states {x.dtype}: one dtype for all"
            )
        if tuple(a.shape) != want12 or tuple(b.shape) != want3 or inter2 % 2:
            raise MoeArgumentError(
                f"mixture_of_experts: expert {experts_min + e}'s weights "
                f"{tuple(a.shape)} and {tuple(b.shape)}, expected {want12} and "
                f"{want3} (permuted_weights={permuted_weights}, H={hidden})"
            )


@torch.compiler.disable  # opaque to Dynamo for good (see ``register``)
def mixture_of_experts_fused(
    hidden_states: torch.Tensor,  # [T, H]
    expert_routing_table: torch.Tensor,  # [T, k] int64 expert ids
    router_weights: torch.Tensor,  # [T, k]
    w12: Sequence[torch.Tensor],  # per expert [2I, H] (permuted) or [H, 2I]
    w3: Sequence[torch.Tensor],  # per expert [H, I] (permuted) or [I, H]
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
    *,
    recomp: bool | None = True,
) -> torch.Tensor:  # [T, H]
    MoeCounts.calls += 1
    x, ids = hidden_states, expert_routing_table
    _check(
        x, ids, router_weights, w12, w3, permuted_weights, activation,
        experts_min, experts_max,
    )  # fmt: skip
    MoeCounts.ranges.add((experts_min, experts_max, *w12[0].shape))
    act = ACTIVATIONS[activation]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j, (up, down) in enumerate(zip(w12, w3, strict=True)):
        expert = experts_min + j
        hit = ids == expert  # [T, k]
        count = hit.sum()
        MoeCounts.routed[expert] = MoeCounts.routed.get(expert, 0) + count
        # [T]: this expert's weight for each token, 0 where it is not routed
        token_w = (router_weights * hit).sum(-1)
        if not permuted_weights:
            up, down = up.t(), down.t()
        gate_up = x @ up.t()  # [T, 2I]
        inter = gate_up.shape[1] // 2
        y = (act(gate_up[:, :inter]) * gate_up[:, inter:]) @ down.t()  # [T, H]
        out += (y * token_w[:, None]).float()
    return out.to(x.dtype)


@torch.compiler.disable
def mixture_of_experts(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w1: Sequence[torch.Tensor],  # per expert gate [I, H] (permuted)
    w2: Sequence[torch.Tensor],  # per expert up [I, H] (permuted)
    w3: Sequence[torch.Tensor],  # per expert down [H, I] (permuted)
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
    *,
    recomp: bool | None = True,
) -> torch.Tensor:
    """The three-list form: gate and up apart, joined into ``w12``."""
    if len(w1) != len(w2):
        raise MoeArgumentError(
            f"mixture_of_experts: {len(w1)} gate and {len(w2)} up weights"
        )
    dim = 0 if permuted_weights else 1
    w12 = [torch.cat([g, u], dim=dim) for g, u in zip(w1, w2, strict=True)]
    return mixture_of_experts_fused(
        hidden_states, expert_routing_table, router_weights, w12, w3,
        permuted_weights, activation, experts_min, experts_max, recomp=recomp,
    )  # fmt: skip


def _fake(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(hidden_states)


_LIBRARY: torch.library.Library | None = None


def register() -> None:
    """Register both overloads as ``torch.ops.hpu.mixture_of_experts`` (once
    per process).

    The kernels are opaque to Dynamo, as the real op's C++ kernel is: both are
    ``torch.compiler.disable``-d. A compiled graph holds the op as one node
    whatever the routing; and where the op runs eagerly inside a compiled
    region (a frame Dynamo skipped, which then intercepts the frames it calls)
    Dynamo does not take the kernel's Python body for a frame of its own to
    compile, guarding on ``MoeCounts`` and recompiling at every call."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    lib = torch.library.Library("hpu", "FRAGMENT")
    impls = {
        "mixture_of_experts": mixture_of_experts,
        "mixture_of_experts.fused_weights": mixture_of_experts_fused,
    }
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, impls[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"hpu::{name}", _fake, lib=lib)
    _LIBRARY = lib
