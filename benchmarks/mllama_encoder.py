"""Mllama's image encoding (vision encoder + projector): tuple+stack against the
``encoder_states`` buffer, eager against graph mode, side by side in one run.

    .venv/bin/python benchmarks/mllama_encoder.py [--layers 2 --global-layers 1
        --images 1 --tiles 4 --reps 1 --dtype float32 --output-json F]
    .venv/bin/python benchmarks/mllama_encoder.py --quick   # tiny shapes, seconds

Shapes are Llama-3.2-11B-Vision's (vision hidden 1280, 16 heads, MLP 5120, 560 px
tiles of 14 px patches: 1601 rows per tile, padded to 1608; 4 tiles; projector to
the text model's 4096) with fewer layers: the intermediate layers [3, 7, 15, 23,
30] of 32 are scaled to the layer count (floor(i * L / 32), repeats dropped).
Weights are random and seeded. What is measured is what the runner runs per
images batch: the encoder and the projector, whose output the cross-attention
K/V projections read.

Variants:

- tuple+stack: ``forward_stacked`` (HF's tuple of layer outputs, ``stack`` of
  the kept ones, ``cat`` after the final state, padding rows cut off) and the
  projector in HF's column order;
- buffer: ``forward``, layer-major with padding rows, read by the projector as
  is; eager it fills a buffer allocated once outside the call (as the runner
  does), in graph mode the compiled graph makes it with one ``cat``.

each eagerly and through torch.compile(dynamic=False) with the device's backend
(``vllm_hpu_mm.device.compile_backend()``). A count-only row shows the seed's
graph-mode form (the buffer passed into the compiled call and written there).

Per variant:

- ms / image: median of ``--reps`` calls after the measured call, per image
  (``--reps 0``: the measured call's own time); for graph mode the first call
  (compilation plus one run) comes before and is reported on its own;
- allocated / peak MB: the torch allocator's events during the measured call
  (torch.profiler, profile_memory); this sees the compiled code's buffers too;
- op-level counts where the ops run: eager, every aten op under a
  TorchDispatchMode; graph mode, the functionalized ATen graph that
  aot_autograd makes of the same call (``aot_export_module``: the graph every
  aot-based backend, Inductor and hpu_backend alike, receives; traced with fake
  tensors, so it costs no compute), plus the copy back of a mutated input that
  aot_autograd's epilogue runs. Counted: allocating ops and their bytes, copy
  ops (data movement without arithmetic) and the bytes they write, and
  *whole-buffer copies*: copy ops that read a tensor holding more than one
  layer's states (a stack, the buffer or a slice of it), e.g. the projector's
  copy of a non-contiguous slice or a functionalized ``slice_scatter``;
- max abs diff of the projector output (real rows) against eager tuple+stack.

Figures, never pass/fail: the machine may be shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

FULL_LAYERS = 32
FULL_INTERMEDIATE = (3, 7, 15, 23, 30)

MB = 1024**2

# Ops that move data without arithmetic. Functional scatters copy their whole
# ``self`` into a new tensor; in-place ones write only their source.
COPY_OPS = frozenset(
    {
        "copy", "copy_", "clone", "_to_copy", "cat", "stack", "constant_pad_nd",
        "slice_scatter", "select_scatter", "as_strided_scatter", "index_put",
        "index_put_", "index_copy", "index_copy_", "_unsafe_index_put",
        "expand_copy",
    }
)  # fmt: skip
# In-place copies: the argument holding what is written (the rest is read).
IN_PLACE_SOURCE = {"copy_": 1, "index_copy_": 2, "index_put_": -1}


@dataclass(frozen=True)
class Shapes:
    hidden: int = 1280
    heads: int = 16
    intermediate: int = 5120
    image_size: int = 560
    patch: int = 14
    tiles: int = 4
    layers: int = 2
    global_layers: int = 1
    images: int = 1
    text_hidden: int = 4096


QUICK = Shapes(
    hidden=32,
    heads=2,
    intermediate=64,
    image_size=28,
    patch=14,
    tiles=4,
    layers=5,
    text_hidden=48,
)


def scaled_intermediate(layers: int) -> list[int]:
    """[3, 7, 15, 23, 30] of 32 scaled to ``layers``, in order, without repeats."""
    return list(dict.fromkeys(i * layers // FULL_LAYERS for i in FULL_INTERMEDIATE))


def aspect_ratios(tiles: int) -> list[list[int]]:
    """Every (w, h) with w * h <= tiles, in transformers' order (its default
    list for 4 tiles)."""
    return [
        [w, h]
        for w in range(1, tiles + 1)
        for h in range(1, tiles + 1)
        if w * h <= tiles
    ]


def vision_config(s: Shapes) -> Any:
    from transformers import MllamaVisionConfig

    kept = scaled_intermediate(s.layers)
    return MllamaVisionConfig(
        hidden_size=s.hidden,
        attention_heads=s.heads,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_global_layers=s.global_layers,
        image_size=s.image_size,
        patch_size=s.patch,
        max_num_tiles=s.tiles,
        supported_aspect_ratios=aspect_ratios(s.tiles),
        intermediate_layers_indices=kept,
        vision_output_dim=s.hidden * (1 + len(kept)),
        norm_eps=1e-5,
    )


def build(s: Shapes, dtype: Any, device: Any, seed: int) -> tuple[Any, tuple[Any, ...]]:
    """The encoder with random seeded weights, and its inputs (every image uses
    all tiles: the largest aspect ratio with w * h == tiles, all tiles valid)."""
    import torch

    from vllm_hpu_mm.models.mllama.vision import MllamaVisionEncoder

    config = vision_config(s)
    gen = torch.Generator().manual_seed(seed)
    model = MllamaVisionEncoder(config).requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "gate" in name:  # tanh gates: non-zero, else a branch vanishes
                p.copy_(0.5 + 0.1 * noise)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.02 * noise)
            else:
                p.copy_(0.02 * noise)
    model = model.to(device=device, dtype=dtype).eval()
    ratios = aspect_ratios(s.tiles)
    full = max(i for i, (w, h) in enumerate(ratios) if w * h == s.tiles) + 1
    pixels = torch.randn(
        s.images, s.tiles, 3, s.image_size, s.image_size, generator=gen
    )
    ids = torch.full((s.images,), full, dtype=torch.int64)
    mask = torch.ones(s.images, s.tiles, dtype=torch.int64)
    inputs = (pixels.to(device, dtype), ids.to(device), mask.to(device))
    return model, inputs


def build_projectors(
    s: Shapes, vision: Any, dtype: Any, device: Any, seed: int
) -> tuple[Any, Any]:
    """(HF-order projector, the plugin's one loaded from the same weight)."""
    import torch

    from vllm_hpu_mm.models.mllama.vision import MllamaProjector

    gen = torch.Generator().manual_seed(seed + 1)
    hf = torch.nn.Linear(vision.output_dim, s.text_hidden).requires_grad_(False)
    hf.weight.copy_(0.02 * torch.randn(hf.weight.shape, generator=gen))
    hf.bias.copy_(0.02 * torch.randn(hf.bias.shape, generator=gen))
    ours = MllamaProjector(vision.output_dim, s.text_hidden, vision.hidden)
    ours.requires_grad_(False)
    ours.weight.weight_loader(ours.weight, hf.weight)  # permutes the columns
    ours.bias.copy_(hf.bias)
    return hf.to(device, dtype), ours.to(device, dtype)


def encode_module(layout: str, vision: Any, hf_proj: Any, proj: Any) -> Any:
    """What the runner calls per images batch, for one layout: pixels ->
    [N, tiles * rows, text hidden] (rows: patches for tuple+stack, padded rows
    for the buffer)."""
    import torch

    class Encode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision, self.proj = vision, (hf_proj if layout == "stack" else proj)

        def forward(self, pixels: Any, ids: Any, mask: Any, *states: Any) -> Any:
            if layout == "stack":
                feats = self.vision.forward_stacked(pixels, ids, mask)
            else:
                feats = self.vision(pixels, ids, mask, *states)
            out = self.proj(feats)  # [N, tiles, rows, text hidden]
            return out.view(out.shape[0], -1, out.shape[-1])

    return Encode()


# ---- op-level counting ---------------------------------------------------------


@dataclass(frozen=True)
class StatesGeometry:
    """Tells a tensor holding more than one layer's encoder states apart."""

    hidden: int
    kept: int
    layer_numel: int  # one layer's output for the batch, real rows only

    def holds_states(self, shape: tuple[int, ...]) -> bool:
        numel = 1
        for d in shape:
            numel *= d
        if numel <= 1.5 * self.layer_numel or len(shape) < 2:
            return False
        h, k = self.hidden, self.kept
        return shape[-1] in (h * (1 + k), h * k) or tuple(shape[-2:]) == (h, k)


@dataclass
class OpCount:
    allocating_ops: int = 0
    allocated_bytes: int = 0
    copy_ops: Counter[str] = field(default_factory=Counter)
    copied_bytes: int = 0
    whole_buffer_copies: list[str] = field(default_factory=list)

    def add(
        self,
        name: str,
        view: bool,
        inputs: list[tuple[tuple[int, ...], int]],  # (shape, bytes) per tensor arg
        outputs: list[tuple[tuple[int, ...], int]],
        geometry: StatesGeometry,
    ) -> None:
        """One op: its tensor arguments in order (``self`` first) and the
        tensors it returns (new ones unless the op is a view or in place)."""
        if view:
            return
        in_place = name in IN_PLACE_SOURCE or name.endswith("_")
        if not in_place:
            self.allocating_ops += 1
            self.allocated_bytes += sum(b for _, b in outputs)
        if name not in COPY_OPS:
            return
        self.copy_ops[name] += 1
        if in_place:
            # Tensor arguments in order: ``self`` (written), indices, source.
            self.copied_bytes += inputs[IN_PLACE_SOURCE.get(name, 1)][1]
            read = inputs[1:]
        else:
            self.copied_bytes += sum(b for _, b in outputs)
            read = inputs
        big = [shape for shape, _ in read if geometry.holds_states(shape)]
        if big:
            self.whole_buffer_copies.append(f"{name} of {list(big[0])}")

    @property
    def total_copies(self) -> int:
        return sum(self.copy_ops.values())


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _tensors(values: Iterable[Any]) -> list[tuple[tuple[int, ...], int]]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [
        (tuple(t.shape), _nbytes(t))
        for t in tree_leaves(list(values))
        if isinstance(t, torch.Tensor)
    ]


def eager_counter(geometry: StatesGeometry) -> Any:
    """A TorchDispatchMode counting, per aten op as it runs: allocations,
    copies and whole-buffer copies (views skipped: they move nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class EagerCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = OpCount()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            self.count.add(
                name,
                func.is_view or name in ("_unsafe_view", "alias"),
                _tensors([*args, *(kwargs or {}).values()]),
                _tensors([out]),
                geometry,
            )
            return out

    return EagerCounter()


def graph_count(
    module: Any, args: tuple[Any, ...], geometry: StatesGeometry
) -> OpCount:
    """Counts in the functionalized ATen graph aot_autograd makes of the call
    (fake tensors: nothing runs), plus the copy back of each mutated input."""
    import torch
    from torch._functorch.aot_autograd import aot_export_module

    class AsTuple(torch.nn.Module):  # aot_export_module's output convention
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *a: Any) -> tuple[Any]:
            return (self.inner(*a),)

    with torch.no_grad():
        gm, signature = aot_export_module(AsTuple(), list(args), trace_joint=False)
    count = OpCount()
    placeholders = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders[node.name] = node
        if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
            continue
        name = node.target.overloadpacket.__name__
        vals = [a.meta.get("val") for a in _nodes(node.args)]
        count.add(
            name,
            node.target.is_view or name in ("_unsafe_view", "alias"),
            _tensors(vals),
            _tensors([node.meta.get("val")]),
            geometry,
        )
    for _, inp in signature.user_inputs_to_mutate.items():
        val = placeholders[inp].meta["val"]
        shape = (tuple(val.shape), _nbytes(val))
        count.add("copy_", False, [shape, shape], [shape], geometry)
    return count


def _nodes(args: Any) -> list[Any]:
    import torch.fx
    from torch.utils._pytree import tree_leaves

    return [a for a in tree_leaves(list(args)) if isinstance(a, torch.fx.Node)]


# ---- one variant ---------------------------------------------------------------


@dataclass
class Result:
    variant: str
    layout: str  # "stack" | "buffer" | "buffer-input" (count only)
    mode: str  # "eager" | "graph"
    ms_per_image: float | None
    times_ms: list[float]
    first_call_s: float  # graph mode: compilation plus one run
    allocated_bytes: int  # torch allocator, during the warm-up call
    peak_bytes: int  # highest live bytes above the start of that call
    allocating_ops: int  # op level (dispatch mode / ATen graph)
    op_allocated_bytes: int
    copy_ops: int
    copied_bytes: int
    whole_buffer_copies: list[str]
    copy_breakdown: dict[str, int]
    graphs: int
    max_abs_diff: float = 0.0


VARIANT_NAMES = {
    "stack": "tuple+stack",
    "buffer": "buffer",
    "buffer-input": "buffer as graph input (seed)",
}


def allocator_figures(events: list[Any], device_type: str) -> tuple[int, int]:
    """(bytes allocated, peak live bytes above the start) from the profiler's
    memory events on one device type ("cpu", "cuda", "hpu"), in time order."""
    live = peak = allocated = 0
    for ev in sorted(events, key=lambda e: e.start_ns()):
        if ev.device_type().name.lower() != device_type:
            continue
        n = int(ev.nbytes())
        allocated += max(n, 0)
        live += n
        peak = max(peak, live)
    return allocated, peak


def measured_call(
    call: Callable[[], tuple[Any, float]], eager: Any | None, device_type: str
) -> tuple[Any, int, int, float]:
    """The warm-up call, measured: its output (cloned), the bytes the allocator
    gave out, the peak live bytes and its time; ``eager`` (a dispatch-mode counter) also
    counts the aten ops. Eager runs under no_grad rather than inference_mode:
    the same kernels, but inference_mode hands composite ops (reshape, pad, to)
    to the dispatch mode whole, hiding the copies they make."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with (
        torch.inference_mode(eager is None),
        torch.no_grad(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        if eager is not None:
            with eager:
                out, took = call()
        else:
            out, took = call()
    events = prof.profiler.kineto_results.events()
    memory = [e for e in events if e.name() == "[memory]"]
    allocated, peak = allocator_figures(memory, device_type)
    return out.detach().clone(), allocated, peak, took


class CountingBackend:
    """Counts the graphs torch.compile hands the real backend (one expected)."""

    def __init__(self, inner: str) -> None:
        self.inner, self.graphs = inner, 0

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Any:
        from torch._dynamo import lookup_backend

        self.graphs += 1
        return lookup_backend(self.inner)(gm, example_inputs)


def variant_args(
    layout: str, mode: str, vision: Any, inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The call's arguments: the buffer goes in eagerly (allocated once, here,
    outside the measured call) and in the seed's graph-mode form."""
    pixels = inputs[0]
    if layout == "buffer-input" or (layout == "buffer" and mode == "eager"):
        states = vision.new_states(pixels.shape[0], pixels.device, pixels.dtype)
        return (*inputs, states)
    return inputs


def _result(layout: str, mode: str, count: OpCount, **kw: Any) -> Result:
    defaults: dict[str, Any] = {
        "ms_per_image": None, "times_ms": [], "first_call_s": 0.0,
        "allocated_bytes": 0, "peak_bytes": 0, "graphs": 0,
    }  # fmt: skip
    return Result(
        variant=f"{VARIANT_NAMES[layout]}, {mode}",
        layout=layout,
        mode=mode,
        allocating_ops=count.allocating_ops,
        op_allocated_bytes=count.allocated_bytes,
        copy_ops=count.total_copies,
        copied_bytes=count.copied_bytes,
        whole_buffer_copies=count.whole_buffer_copies,
        copy_breakdown=dict(sorted(count.copy_ops.items())),
        **{**defaults, **kw},
    )


def run_variant(
    layout: str,
    mode: str,
    module: Any,
    args: tuple[Any, ...],
    geometry: StatesGeometry,
    reps: int,
) -> tuple[Result, Any]:
    import torch

    from vllm_hpu_mm import device as dev

    forward: Callable[..., Any] = module
    backend: CountingBackend | None = None
    count = graph_count(module, args, geometry) if mode == "graph" else None
    if mode == "graph":
        backend = CountingBackend(dev.compile_backend())
        forward = torch.compile(module, backend=backend, dynamic=False)

    def call() -> Any:
        dev.synchronize()
        start = time.perf_counter()
        out = forward(*args)
        dev.synchronize()
        return out, time.perf_counter() - start

    eager = eager_counter(geometry) if mode == "eager" else None
    with torch.inference_mode():
        first_s = call()[1] if mode == "graph" else 0.0
    output, allocated, peak, measured_s = measured_call(
        call, eager, args[0].device.type
    )
    with torch.inference_mode():
        times = [call()[1] for _ in range(reps)] or [measured_s]
    if eager is not None:
        count = eager.count
    assert count is not None
    images = args[0].shape[0]
    result = _result(
        layout,
        mode,
        count,
        ms_per_image=round(1000 * statistics.median(times) / images, 1),
        times_ms=[round(1000 * t, 1) for t in times],
        first_call_s=round(first_s, 2),
        allocated_bytes=allocated,
        peak_bytes=peak,
        graphs=backend.graphs if backend is not None else 0,
    )
    return result, output


# ---- report --------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    head = (
        "| variant | ms / image | first call s | allocated MB | peak MB "
        "| allocating ops (MB) | copy ops | copied MB | whole-buffer copies "
        "| max abs diff |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        timed = r.ms_per_image is not None
        ms = f"{r.ms_per_image:.1f}" if timed else "-"
        first = f"{r.first_call_s:.1f}" if r.mode == "graph" and timed else "-"
        alloc = f"{r.allocated_bytes / MB:.1f}" if timed else "-"
        peak = f"{r.peak_bytes / MB:.1f}" if timed else "-"
        diff = f"{r.max_abs_diff:.2e}" if timed else "-"
        lines.append(
            f"| {r.variant} | {ms} | {first} | {alloc} | {peak} "
            f"| {r.allocating_ops} ({r.op_allocated_bytes / MB:.1f}) "
            f"| {r.copy_ops} | {r.copied_bytes / MB:.1f} "
            f"| {len(r.whole_buffer_copies)} | {diff} |"
        )
    return "\n".join(lines)


def ratios(results: list[Result]) -> dict[str, float]:
    by = {(r.layout, r.mode): r for r in results if r.ms_per_image is not None}
    out: dict[str, float] = {}
    for mode in ("eager", "graph"):
        if ("stack", mode) in by and ("buffer", mode) in by:
            b, s = by["buffer", mode], by["stack", mode]
            assert b.ms_per_image is not None and s.ms_per_image is not None
            out[f"buffer/stack time, {mode}"] = b.ms_per_image / s.ms_per_image
            out[f"buffer/stack copied bytes, {mode}"] = b.copied_bytes / max(
                s.copied_bytes, 1
            )
            out[f"buffer/stack allocated bytes, {mode}"] = b.allocated_bytes / max(
                s.allocated_bytes, 1
            )
    for layout in ("stack", "buffer"):
        if (layout, "eager") in by and (layout, "graph") in by:
            g, e = by[layout, "graph"], by[layout, "eager"]
            assert g.ms_per_image is not None and e.ms_per_image is not None
            out[f"graph/eager time, {layout}"] = g.ms_per_image / e.ms_per_image
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Shapes()
    p.add_argument("--layers", type=int, default=d.layers, help="local layers")
    p.add_argument("--global-layers", type=int, default=d.global_layers)
    p.add_argument("--images", type=int, default=d.images)
    p.add_argument("--tiles", type=int, default=d.tiles, help="tiles per image")
    p.add_argument(
        "--reps",
        type=int,
        default=1,
        help="timed calls per variant after the measured one (0: time the "
        "measured call itself, under the profiler and, eager, the op counter)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="default: float32 on the CPU, bfloat16 elsewhere",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="eager,graph", help="eager, graph or both")
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes (hidden 32), for tests"
    )
    p.add_argument(
        "--reuse-compile-cache",
        action="store_true",
        help="keep torch's inductor cache (default: a fresh one, so the first "
        "graph-mode call times a real compilation)",
    )
    p.add_argument("--output-json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.reuse_compile_cache:
        return run(args)
    # A fresh inductor cache: the first graph-mode call is a real compilation.
    with tempfile.TemporaryDirectory(prefix="mllama-encoder-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        return run(args)


def run(args: argparse.Namespace) -> int:
    import torch

    from vllm_hpu_mm import device as dev

    sizes = ("layers", "global_layers", "images", "tiles")
    shapes = (
        QUICK
        if args.quick
        else replace(Shapes(), **{k: getattr(args, k) for k in sizes})
    )
    device = dev.torch_device()
    dtype_name = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    vision, inputs = build(shapes, dtype, device, args.seed)
    hf_proj, proj = build_projectors(shapes, vision, dtype, device, args.seed)
    kept = scaled_intermediate(shapes.layers)
    rows = vision.num_patches
    geometry = StatesGeometry(
        vision.hidden, len(kept), shapes.images * shapes.tiles * rows * vision.hidden
    )
    buffer_mb = _nbytes(vision.new_states(shapes.images, torch.device("meta"), dtype))
    print(
        f"Mllama image encoding on {device.type} ({dtype_name}, "
        f"{torch.get_num_threads()} threads): hidden {shapes.hidden}, "
        f"{shapes.heads} heads, MLP {shapes.intermediate}, {shapes.layers} local + "
        f"{shapes.global_layers} global layers, intermediate layers {kept}, "
        f"{shapes.images} image(s) x {shapes.tiles} tile(s) x {rows} rows "
        f"(padded {vision.padded}), output dim {vision.output_dim}, projector to "
        f"{shapes.text_hidden}; encoder_states {buffer_mb / MB:.1f} MB",
        flush=True,
    )

    results: list[Result] = []
    reference = None
    modules = {
        layout: encode_module(layout, vision, hf_proj, proj)
        for layout in ("stack", "buffer")
    }
    for mode in args.modes.split(","):
        for layout in ("stack", "buffer"):
            call_args = variant_args(layout, mode, vision, inputs)
            result, output = run_variant(
                layout, mode, modules[layout], call_args, geometry, args.reps
            )
            real = _real_rows(output, layout, shapes.tiles, vision)
            if reference is None:
                reference = real
            result.max_abs_diff = float((real - reference).abs().max())
            results.append(result)
            print(f"  {result.variant}: {result.times_ms} ms", flush=True)
            del output, real
            gc.collect()
            torch._dynamo.reset()
            dev.empty_cache()
    if "graph" in args.modes.split(","):
        seed_args = variant_args("buffer-input", "graph", vision, inputs)
        count = graph_count(modules["buffer"], seed_args, geometry)
        results.append(_result("buffer-input", "graph", count))

    print()
    print(format_table(results))
    print()
    for name, value in ratios(results).items():
        print(f"{name}: {value:.2f}x")
    for r in results:
        ops = ", ".join(f"{k} {v}" for k, v in r.copy_breakdown.items())
        whole = "; ".join(r.whole_buffer_copies) or "none"
        print(f"copy ops, {r.variant}: {ops}; whole-buffer copies: {whole}")
    if args.output_json:
        report = {
            "device": device.type,
            "dtype": dtype_name,
            "threads": torch.get_num_threads(),
            "shapes": asdict(shapes),
            "intermediate_layers": kept,
            "rows_per_tile": rows,
            "padded_rows_per_tile": vision.padded,
            "output_dim": vision.output_dim,
            "buffer_mb": round(buffer_mb / MB, 2),
            "reps": args.reps,
            "ratios": ratios(results),
            "results": [asdict(r) for r in results],
        }
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _real_rows(out: Any, layout: str, tiles: int, vision: Any) -> Any:
    """[N, tiles * patches, text hidden]: the buffer layout's padding rows cut."""
    if layout == "stack":
        return out
    n, _, width = out.shape
    real = out.view(n, tiles, vision.padded, width)[:, :, : vision.num_patches]
    return real.reshape(n, -1, width)


if __name__ == "__main__":
    raise SystemExit(main())
