"""The only module that touches habana_frameworks or torch.cuda.

Everything device-specific goes through here: which device the plugin runs on,
synchronisation, HPU's lazy-mode step marker, memory figures and seeding. The rest
of the package is device-free and runs unchanged on hpu, cuda and cpu, which is
how CI without a Gaudi exercises the HPU code path.

On Gaudi the process model is Habana's (see docs/gaudi.md): one card per
process, chosen by ``HABANA_VISIBLE_MODULES`` when the process first touches the
device; the device is the un-indexed ``torch.device("hpu")``; nothing here
queries the card before the worker claims it (``claim_device``), so the
API-server process never takes one.

Device choice (``select_device``):

1. ``VLLM_HPU_MM_DEVICE`` = ``hpu`` | ``cuda`` | ``cpu`` forces a device (an
   unavailable forced device is an error, not a silent fallback);
2. else ``hpu`` when ``habana_frameworks.torch`` imports;
3. else ``cuda`` when ``torch.cuda.is_available()``;
4. else ``cpu``.

``VLLM_HPU_MM_DEVICE=hpu VLLM_HPU_MM_GAUDI_SIM=1`` installs the simulated Gaudi
stack (``vllm_hpu_mm.gaudi_sim``) first, unless a real ``habana_frameworks`` is
importable: the device kind is then ``hpu`` and every call below goes to the
simulated bridge; only the tensors stay on the host (``torch_device``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from hpu_kernels.fused import RopeKernel, SdpaFn
    from hpu_kernels.kv_fp8 import DequantizeFn, QuantizeFn

DeviceKind = Literal["hpu", "cuda", "cpu"]
DEVICE_ENV = "VLLM_HPU_MM_DEVICE"
# Habana's per-process card selection (module ids, comma-separated).
VISIBLE_MODULES_ENV = "HABANA_VISIBLE_MODULES"
_KINDS: tuple[DeviceKind, ...] = ("hpu", "cuda", "cpu")

# Default KV-cache size on the CPU fallback when --kv-cache-memory-bytes is unset:
# host RAM is shared with everything else, so take a modest fixed slice.
CPU_DEFAULT_KV_CACHE_BYTES = 512 * 1024**2

logger = logging.getLogger("vllm.hpu_mm.device")


class DeviceError(RuntimeError):
    """The requested device cannot be used on this host."""


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    kind: DeviceKind
    reason: str  # one human sentence: why this device was chosen


def _habana() -> Any | None:
    """``habana_frameworks.torch`` if it imports, else None."""
    try:
        return importlib.import_module("habana_frameworks.torch")
    except Exception:  # ImportError, or a broken Habana install
        return None


def _hpu_core() -> Any:
    return importlib.import_module("habana_frameworks.torch.core")


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def _available(kind: DeviceKind) -> bool:
    if kind == "hpu":
        return _habana() is not None
    if kind == "cuda":
        return _cuda_available()
    return True


def _install_simulated_gaudi() -> bool:
    """Install ``vllm_hpu_mm.gaudi_sim`` when asked for and no real Habana
    stack is importable; whether the simulation is on."""
    from vllm_hpu_mm import gaudi_sim

    if gaudi_sim.installed() is not None:
        return True
    if not gaudi_sim.requested():
        return False
    if gaudi_sim.real_habana_importable():
        logger.warning(
            "vllm-hpu-mm: %s=1 ignored: a real habana_frameworks is installed",
            gaudi_sim.SIM_ENV,
        )
        return False
    gaudi_sim.install()
    return True


def simulated() -> bool:
    """The simulated Gaudi (``vllm_hpu_mm.gaudi_sim``) runs this process."""
    from vllm_hpu_mm import gaudi_sim

    return gaudi_sim.installed() is not None


@functools.cache
def select_device() -> DeviceChoice:
    """Pick the device once per process and log the choice with its reason."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced == "hpu" and _install_simulated_gaudi():
        _habana()  # as on Gaudi: registers torch.hpu and hpu_backend
        choice = DeviceChoice(
            "hpu", f"forced by {DEVICE_ENV}=hpu, simulated Gaudi (host tensors)"
        )
        logger.info("vllm-hpu-mm: running on hpu (%s)", choice.reason)
        return choice
    if forced:
        if forced not in _KINDS:
            raise DeviceError(
                f"{DEVICE_ENV}={forced!r} is not one of {', '.join(_KINDS)} "
                "(unset it to choose automatically)"
            )
        if not _available(forced):  # type: ignore[arg-type]
            raise DeviceError(
                f"{DEVICE_ENV}={forced} but that device is not available here "
                f"({'habana_frameworks.torch does not import' if forced == 'hpu' else 'torch.cuda.is_available() is False'})"  # noqa: E501
            )
        choice = DeviceChoice(forced, f"forced by {DEVICE_ENV}={forced}")  # type: ignore[arg-type]
    elif _habana() is not None:
        choice = DeviceChoice("hpu", "habana_frameworks.torch imports")
    elif _cuda_available():
        choice = DeviceChoice(
            "cuda", "no habana_frameworks; torch.cuda.is_available() is True"
        )
    else:
        choice = DeviceChoice("cpu", "no habana_frameworks and no CUDA device")
    logger.info("vllm-hpu-mm: running on %s (%s)", choice.kind, choice.reason)
    return choice


def device_kind() -> DeviceKind:
    return select_device().kind


def torch_device(local_rank: int = 0) -> torch.device:
    """The torch device this worker computes on.

    HPU: un-indexed ``hpu`` (a Habana process drives one card, picked by
    ``HABANA_VISIBLE_MODULES``; indexed ``hpu:N`` devices are not how the stack is
    driven); ``cpu`` on the simulated Gaudi, whose tensors are host tensors.
    CUDA: ``cuda:<local_rank>``. CPU: ``cpu``.
    """
    kind = device_kind()
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "hpu":
        return torch.device("cpu" if simulated() else "hpu")
    return torch.device(kind, local_rank)


def set_device(device: torch.device) -> None:
    """CUDA: make ``device`` current. HPU: nothing to do (the card is chosen per
    process by ``HABANA_VISIBLE_MODULES``, see ``select_card``)."""
    if device_kind() == "cuda":
        torch.cuda.set_device(device)


def select_card(local_index: int, local_ranks: int = 1) -> str | None:
    """Narrow ``HABANA_VISIBLE_MODULES`` to this worker's module (HPU only).

    vLLM's multiprocessing executor starts every worker of a node with the same
    environment. When the operator lists several modules and the node runs
    several workers (``local_ranks``), the worker with host-local index ``i``
    (vLLM's ``ParallelConfig.get_local_gpu_index``: the local rank, offset by
    the data-parallel engine) keeps the ``i``-th module, so the workers take
    distinct, predictable cards (vLLM maps local index to physical id the same
    way, ``Platform.device_id_to_physical_device_id``). Otherwise the
    variable is kept: one listed module (Ray sets one per actor) is that card;
    a single worker takes the first free listed card; unset leaves the choice to
    Habana's runtime (the first free card). Must run before the process first
    touches the device. Returns the module id this process will use, or None
    when the runtime picks it.
    """
    if device_kind() != "hpu":
        return None
    listed = [m.strip() for m in os.environ.get(VISIBLE_MODULES_ENV, "").split(",")]
    listed = [m for m in listed if m]
    if len(listed) == 1:
        return listed[0]
    if not listed or local_ranks <= 1:
        return None
    if max(local_ranks, local_index + 1) > len(listed):
        raise DeviceError(
            f"{local_ranks} workers on this node (this one: local index "
            f"{local_index}) but {VISIBLE_MODULES_ENV}={','.join(listed)} lists "
            f"{len(listed)} module(s): list one module per local worker, or unset it"
        )
    os.environ[VISIBLE_MODULES_ENV] = listed[local_index]
    return listed[local_index]


def claim_device(local_index: int, local_ranks: int = 1) -> torch.device:
    """The worker's device, with this worker's card selected first (HPU; see
    ``select_card``).

    In HPU lazy mode Dynamo is switched off for the process, as the official
    Gaudi plugin does: vLLM's own ``@torch.compile`` helpers (sampler logprobs,
    vocab-parallel embedding) then run eagerly instead of failing in a mode
    that cannot compile.
    """
    card = select_card(local_index, local_ranks)
    if device_kind() == "hpu":
        lazy = is_lazy_mode()
        if lazy:
            import torch._dynamo.config as dynamo_config

            dynamo_config.disable = True
        logger.info(
            "vllm-hpu-mm: local worker %d of %d uses %s, %s mode",
            local_index,
            local_ranks,
            f"module {card} ({VISIBLE_MODULES_ENV})"
            if card is not None
            else "the first free card",
            "lazy (PT_HPU_LAZY_MODE=1, Dynamo off)" if lazy else "eager",
        )
    return torch_device(local_index)


def device_count() -> int:
    kind = device_kind()
    if kind == "cuda":
        return int(torch.cuda.device_count())
    if kind == "hpu":
        return int(torch.hpu.device_count())  # type: ignore[attr-defined]
    return 1


def device_name(index: int = 0) -> str:
    """CUDA: the card's name. HPU: the static name ``hpu``, as the official
    Gaudi plugin returns (vLLM asks in the API-server process, which must not
    touch the card). CPU: ``cpu``."""
    kind = device_kind()
    if kind == "cuda":
        return str(torch.cuda.get_device_name(index))
    return kind


def synchronize() -> None:
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "hpu":
        torch.hpu.synchronize()  # type: ignore[attr-defined]


def host_copy_event() -> Any | None:
    """An event recorded on the current stream, after a non-blocking
    device-to-host copy was issued; ``event.synchronize()`` waits for it.
    None on the CPU, where a copy is done when it returns."""
    kind = device_kind()
    if kind == "cuda":
        event = torch.cuda.Event()
    elif kind == "hpu":
        event = torch.hpu.Event()  # type: ignore[attr-defined]
    else:
        return None
    event.record()
    return event


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` in host memory, cast to ``dtype`` if given: a new host tensor on
    HPU and CUDA; on the CPU ``t`` itself unless a cast makes a new one.

    On the simulated Gaudi the card's tensors are host tensors, so ``.cpu()``
    would hand back the card tensor itself and nothing could tell it from a
    host copy; the simulated stack makes a real copy and records it as on the
    host (``gaudi_sim.grammar.HostCopies``, weakly held), so what chooses its
    path by the tensor's device (xgrammar's bitmask kernel) sees what it
    would see on Gaudi."""
    from vllm_hpu_mm import gaudi_sim

    sim = gaudi_sim.installed()
    if sim is not None:
        return sim.host_copy(t, dtype)
    return t.to("cpu", dtype=dtype or t.dtype)


def mark_step() -> None:
    """End an HPU lazy-mode graph segment; a no-op elsewhere."""
    if device_kind() == "hpu":
        _hpu_core().mark_step()


def empty_cache() -> None:
    if device_kind() == "cuda":
        torch.cuda.empty_cache()


def manual_seed_all(seed: int) -> None:
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.manual_seed_all(seed)
    elif kind == "hpu":
        torch.hpu.manual_seed_all(seed)  # type: ignore[attr-defined]


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host RAM (psutil: ``MemAvailable`` and
    ``MemTotal`` of /proc/meminfo on Linux)."""
    import psutil

    mem = psutil.virtual_memory()
    return int(mem.available), int(mem.total)


def memory_info() -> tuple[int, int]:
    """(free, total) bytes on the device (host RAM on the CPU fallback)."""
    kind = device_kind()
    if kind == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    if kind == "hpu":
        free, total = torch.hpu.mem_get_info()  # type: ignore[attr-defined]
        return int(free), int(total)
    return _host_memory()


def peak_memory_bytes() -> int:
    """Peak bytes allocated by torch on the device since start (0 on the CPU)."""
    kind = device_kind()
    if kind == "cuda":
        return int(torch.cuda.max_memory_allocated())
    if kind == "hpu":
        return int(torch.hpu.max_memory_allocated())  # type: ignore[attr-defined]
    return 0


def allocated_memory_bytes() -> int:
    """Bytes torch holds allocated on the device now (0 on the CPU)."""
    kind = device_kind()
    if kind == "cuda":
        return int(torch.cuda.memory_allocated())
    if kind == "hpu":
        return int(torch.hpu.memory_allocated())  # type: ignore[attr-defined]
    return 0


def reset_peak_memory() -> None:
    """Start ``peak_memory_bytes`` afresh from what is allocated now."""
    kind = device_kind()
    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif kind == "hpu":
        torch.hpu.reset_peak_memory_stats()  # type: ignore[attr-defined]


def total_memory(index: int = 0) -> int:
    """Total device memory for vLLM's start-up defaults. HPU: 0 without a
    query, as the official Gaudi plugin does (vLLM asks in the API-server
    process; a query there would take the card). 0 sends vLLM to its
    small-device defaults (``EngineArgs.get_batch_defaults``)."""
    if device_kind() == "hpu":
        return 0
    return memory_info()[1]


def compile_backend() -> str:
    """torch.compile backend for graph mode on this device."""
    if device_kind() == "hpu":
        _hpu_core()  # registers the "hpu_backend" with torch.compile
        return "hpu_backend"
    return "inductor"


ONEDNN_ISA_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_kernel_tag() -> str:
    """A directory name for the CPU kernels this process compiles for and runs,
    e.g. ``cpu-avx512-amx-onednn-all``: PyTorch's vectorized-kernel level (its
    ``ATEN_CPU_CAPABILITY`` ceiling, which is also the instruction set inductor
    generates code for), whether the CPU has AMX tiles, and oneDNN's
    instruction-set ceiling (``ONEDNN_MAX_CPU_ISA``). Inductor's on-disk graph
    cache does not key on these: a graph compiled under one setting and loaded
    under another runs code built for the other's kernels (bfloat16 Mllama's
    compiled vision encoder then returned NaN). The tag keeps their caches
    apart."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    amx = "amx" if torch.cpu._is_amx_tile_supported() else "noamx"
    onednn = next((os.environ[e] for e in ONEDNN_ISA_ENVS if os.environ.get(e)), "all")
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in onednn.lower())
    return f"cpu-{capability}-{amx}-onednn-{safe}"


def dist_backend() -> str:
    return {"hpu": "hccl", "cuda": "nccl", "cpu": "gloo"}[device_kind()]


def is_lazy_mode() -> bool:
    """HPU lazy mode (``PT_HPU_LAZY_MODE=1``), as the loaded Habana bridge reports
    it; False on every other device. Lazy mode and torch.compile are mutually
    exclusive."""
    if device_kind() != "hpu":
        return False
    internal = importlib.import_module("habana_frameworks.torch.utils.internal")
    return bool(internal.is_lazy())


# --- fused Gaudi kernels (pure PyTorch everywhere else) -------------------------


def sdpa_kernel(softmax_mode: str | None = "fast") -> SdpaFn:
    """Scaled dot-product attention for prefill-style attention
    (``q [B, Hq, S, D]``, ``k``/``v`` ``[B, Hkv, K, D]``): Habana's FusedSDPA with
    ``softmax_mode`` on HPU (None: PyTorch's SDPA there too),
    ``F.scaled_dot_product_attention`` elsewhere. Same call on both:
    ``sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa)``."""
    from hpu_kernels.fused import fused_sdpa, sdpa_native

    if device_kind() != "hpu" or softmax_mode is None:
        return sdpa_native
    kernels = importlib.import_module("habana_frameworks.torch.hpex.kernels")
    return fused_sdpa(kernels.FusedSDPA, softmax_mode)


def rms_norm_kernel() -> Any | None:
    """Habana's ``FusedRMSNorm`` on HPU (``.apply(x, weight, eps)``), else None
    (the layer's PyTorch code runs)."""
    if device_kind() != "hpu":
        return None
    norm = importlib.import_module("habana_frameworks.torch.hpex.normalization")
    return norm.FusedRMSNorm


def rope_kernel() -> RopeKernel | None:
    """Habana's fused rotary embedding on HPU (``apply_rotary_pos_emb`` and its
    ``RotaryPosEmbeddingMode``), else None (the layer's PyTorch code runs)."""
    from hpu_kernels.fused import RopeKernel

    if device_kind() != "hpu":
        return None
    kernels = importlib.import_module("habana_frameworks.torch.hpex.kernels")
    return RopeKernel(
        apply=kernels.apply_rotary_pos_emb,
        blockwise=kernels.RotaryPosEmbeddingMode.BLOCKWISE,
        pairwise=kernels.RotaryPosEmbeddingMode.PAIRWISE,
    )


@dataclass(frozen=True, slots=True)
class Fp8Ops:
    """Habana's FP8 ops as the official Gaudi plugin calls them (vllm-gaudi
    ``extension/ops.py`` ``apply_fp8_linear_hpu``): ``cast(x, 1 / scale, False,
    False, torch.float8_e4m3fn)[0]`` and ``gemm(A=, trans_A=, B=, trans_B=, D=,
    out_dtype=, A_scale_inv=, B_scale_inv=, bias=, accumulate=)``."""

    cast: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gemm: Callable[..., torch.Tensor]


def fp8_ops() -> Fp8Ops | None:
    """``torch.ops.hpu.cast_to_fp8_v2`` and ``fp8_gemm_v2`` on HPU (registered
    by ``habana_frameworks.torch``, or by the simulated stack), else None: the
    FP8 linear layers then dequantize their weights per call
    (``hpu_kernels.fp8``)."""
    if device_kind() != "hpu":
        return None
    _habana()
    return Fp8Ops(cast=torch.ops.hpu.cast_to_fp8_v2, gemm=torch.ops.hpu.fp8_gemm_v2)


def kv_fp8_casts() -> tuple[QuantizeFn, DequantizeFn]:
    """The FP8 KV cache's write and read conversions (``hpu_kernels.kv_fp8``):
    on HPU Habana's ``cast_to_fp8_v2(x, 1 / scale, False, False, e4m3)`` and
    ``cast_from_fp8(x, scale, dtype)``, as the official plugin's FP8 KV cache
    calls them (vllm-gaudi ``extension/utils.py`` ``VLLMFP8KVCache``); the
    pure-PyTorch forms elsewhere."""
    from hpu_kernels.kv_fp8 import FP8_KV_DTYPE, dequantize_kv, quantize_kv

    if device_kind() != "hpu":
        return quantize_kv, dequantize_kv
    _habana()
    cast_to, cast_from = torch.ops.hpu.cast_to_fp8_v2, torch.ops.hpu.cast_from_fp8

    def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return cast_to(x, 1.0 / scale, False, False, FP8_KV_DTYPE)[0]

    def dequantize(
        x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return cast_from(x, scale, dtype)

    return quantize, dequantize


@dataclass(frozen=True, slots=True)
class HabanaMoe:
    """Habana's MoE op, ``torch.ops.hpu.mixture_of_experts``, called as the
    official Gaudi plugin calls it (vllm-gaudi ``ops/hpu_fused_moe.py`` and
    ``extension/ops.py`` ``VllmMixtureOfExpertsOp``): the routing table as
    int64 and the router weights in the activations' dtype, one ``[2I, H]``
    gate+up and one ``[H, I]`` down weight per expert as lists of views of
    vLLM's stacked ``w13_weight`` / ``w2_weight`` (``permuted_weights=True``:
    the linear layout), ``experts_min`` / ``experts_max`` the experts this
    rank holds (all of them, each sliced, under tensor parallelism; under
    expert parallelism the rank's contiguous range of global ids,
    ``experts_min`` the first, with the routing table of global ids: the op
    skips the others, as vllm-gaudi passes its ``ep_rank``'s range). All local
    experts go in one call, as vllm-gaudi does unless
    ``MAX_EXPERTS_PER_SLICE`` is set (a workaround for Gaudi software 1.20);
    no ``chunk_size`` (vllm-gaudi passes one only when ``VLLM_MOE_CHUNK`` is
    configured: a speed setting)."""

    op: Callable[..., torch.Tensor]

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows
        w2: torch.Tensor,  # [E, H, I]
        topk_weights: torch.Tensor,  # [T, k]
        topk_ids: torch.Tensor,  # [T, k], global expert ids
        activation: str = "silu",
        experts_min: int = 0,  # global id of w13[0]
    ) -> torch.Tensor:  # [T, H]
        return self.op(
            hidden_states=x,
            expert_routing_table=topk_ids.to(torch.int64),
            router_weights=topk_weights.to(x.dtype),
            w12=list(w13.unbind(0)),
            w3=list(w2.unbind(0)),
            permuted_weights=True,
            activation=activation,
            experts_min=experts_min,
            experts_max=experts_min + w13.shape[0] - 1,
        )


def habana_moe() -> HabanaMoe | None:
    """Habana's MoE op on HPU (registered by ``habana_frameworks.torch``, or by
    the simulated stack), else None: the MoE layers then run
    ``hpu_kernels.moe`` (pure PyTorch)."""
    if device_kind() != "hpu":
        return None
    _habana()
    return HabanaMoe(op=torch.ops.hpu.mixture_of_experts)


# --- HF transformers as the benchmark's reference (vllm-hpu-mm bench --backend hf)


def prepare_hf_for_device() -> None:
    """Call before loading an HF transformers model: on Gaudi, optimum-habana
    swaps in its Gaudi model classes and ``generate``; a no-op elsewhere."""
    if device_kind() == "hpu":
        _habana()
        gaudi = importlib.import_module("optimum.habana.transformers.modeling_utils")
        gaudi.adapt_transformers_to_gaudi()


def hf_model_to_device(model: Any) -> Any:
    """The HF model on this device: on Gaudi moved to ``hpu``, and wrapped in
    HPU graphs in lazy mode only (HPU graphs need lazy mode); on CUDA moved to
    ``cuda``; unchanged on the CPU."""
    kind = device_kind()
    if kind == "hpu":
        model = model.to("hpu")
        if not is_lazy_mode():
            return model
        hpu = importlib.import_module("habana_frameworks.torch.hpu")
        return hpu.wrap_in_hpu_graph(model)
    if kind == "cuda":
        return model.to("cuda")
    return model


def hf_generate_kwargs() -> dict[str, Any]:
    """Extra ``generate`` arguments of the Gaudi adaptation, matching the mode
    the bridge runs in: lazy mode with HPU graphs, or eager without them
    (optimum-habana refuses ``hpu_graphs`` without ``lazy_mode``); none
    elsewhere."""
    if device_kind() == "hpu":
        lazy = is_lazy_mode()
        return {"lazy_mode": lazy, "hpu_graphs": lazy}
    return {}


# --- compile-only warmup and the compile caches (Gaudi) ---------------------------

COMPILE_ONLY_SETTING = "PT_COMPILE_ONLY_MODE"
RECIPE_CACHE_ENV = "PT_HPU_RECIPE_CACHE_CONFIG"
MULTI_THREADED_FUSER_ENV = "FUSER_ENABLE_MULTI_THREADED_INVOCATIONS"
# The recipe cache's size limit, in MB (the third field of its setting).
RECIPE_CACHE_MB = 8192


def _compile_only_setting() -> Callable[[], AbstractContextManager[Any]] | None:
    """The bridge's ``env_setting("PT_COMPILE_ONLY_MODE", True)`` context, or
    None where the bridge does not know the setting (older Gaudi software
    raises KeyError when it is entered; the official plugin probes it so)."""
    try:
        bc = importlib.import_module("habana_frameworks.torch.internal.bridge_config")
        setting = functools.partial(bc.env_setting, COMPILE_ONLY_SETTING, True)
        with setting():
            pass
    except (ImportError, AttributeError, KeyError):
        return None
    return setting


@contextlib.contextmanager
def compile_only_mode() -> Iterator[bool]:
    """Gaudi: run the body in the bridge's compile-only mode, where graphs and
    ops are compiled into recipes but not executed, so warmup costs the
    compilations alone. Tensor values are then never computed: nothing inside
    may read a device tensor back to the host (``.item()``, ``.tolist()``,
    ``bool(t)``, a host copy) or depend on one. Yields whether the mode is
    on: False on the CPU and CUDA (a no-op) and where the bridge lacks it
    (warmup then executes every graph once, slower but correct)."""
    if device_kind() != "hpu":
        yield False
        return
    setting = _compile_only_setting()
    if setting is None:
        logger.warning(
            "Habana's bridge has no %s: warmup runs every graph instead of only "
            "compiling it (slower start-up); update the Gaudi software",
            COMPILE_ONLY_SETTING,
        )
        yield False
        return
    with setting():
        yield True


def gaudi_compile_env(
    environ: Mapping[str, str], cache_dir: str | None
) -> dict[str, str]:
    """The variables to add to ``environ`` for Gaudi's graph compiler (a value
    the operator set is kept):

    - ``PT_HPU_RECIPE_CACHE_CONFIG=<cache_dir>/hpu-recipes,False,<MB>``: the
      recipe cache, the only on-disk cache of compiled graphs ``hpu_backend``
      reads (Inductor's ``TORCHINDUCTOR_CACHE_DIR`` does nothing for it);
      ``False``: keep what an earlier start wrote. Only with a configured
      ``hpu_mm.warmup.compile_cache_dir``.
    - ``FUSER_ENABLE_MULTI_THREADED_INVOCATIONS=1``: the graph compiler's
      parallel compilation, which the official Gaudi plugin turns on.

    The bridge reads both when ``habana_frameworks.torch`` initialises, which
    in this plugin happens at device selection in every process; so they must
    be in the environment before the engine and worker processes start (set
    them where the config is checked, in the parent process: spawned children
    inherit them)."""
    out: dict[str, str] = {}
    if cache_dir and RECIPE_CACHE_ENV not in environ:
        path = os.path.join(
            os.path.abspath(os.path.expanduser(cache_dir)), "hpu-recipes"
        )
        out[RECIPE_CACHE_ENV] = f"{path},False,{RECIPE_CACHE_MB}"
    if MULTI_THREADED_FUSER_ENV not in environ:
        out[MULTI_THREADED_FUSER_ENV] = "1"
    return out
