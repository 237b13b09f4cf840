"""Mllama's vision encoder: tuple+stack against the preallocated buffer, eager
against graph mode, four variants side by side in one run.

    .venv/bin/python benchmarks/mllama_encoder.py [--layers 5 --global-layers 1
        --images 1 --tiles 1 --reps 3 --dtype float32 --output-json F]
    .venv/bin/python benchmarks/mllama_encoder.py --quick   # tiny shapes, seconds

Shapes are Llama-3.2-11B-Vision's (hidden 1280, 16 heads, MLP 5120, 560 px tiles
of 14 px patches: 1601 rows per tile, padded to 1608) with fewer layers; the
intermediate layers [3, 7, 15, 23, 30] of 32 are scaled to the layer count
(floor(i * L / 32), duplicates dropped). Weights are random and seeded.

The variants are ``forward_stacked`` (HF's tuple of layer outputs, then
``stack`` + ``cat``) and ``forward`` (each kept layer written into a buffer
allocated once, outside the forward, as the runner does at warmup), each run
eagerly and through torch.compile(dynamic=False) with the plugin's backend
(``vllm_hpu_mm.device.compile_backend()``). Per variant:

- time: median of ``--reps`` forwards after a warm-up call; for graph mode the
  first call (compilation plus one run) is reported on its own;
- allocated / peak MB: the torch allocator's events during the warm-up forward
  (torch.profiler with profile_memory): every byte allocated, and the highest
  live total above the start. This sees the compiled code's buffers too;
- copy ops: eager, counted by aten op name under a TorchDispatchMode; graph
  mode, counted in the FX graph the backend receives (a counting wrapper in
  front of the real backend). "copied MB" is what those ops write;
- max abs diff of the output against the eager tuple+stack output.

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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Llama-3.2-11B-Vision keeps the outputs of these of its 32 local layers.
FULL_LAYERS = 32
FULL_INTERMEDIATE = (3, 7, 15, 23, 30)

# Ops that copy data: the first group allocates the tensor it writes, the second
# writes into an existing one. Names are aten's (eager) or torch's (graph mode),
# mapped to one spelling by ``_GRAPH_NAMES``.
ALLOCATING_COPIES = frozenset(
    {"stack", "cat", "clone", "_to_copy", "constant_pad_nd", "contiguous"}
)
IN_PLACE_COPIES = frozenset({"copy_", "index_copy_", "index_copy"})
COPY_OPS = ALLOCATING_COPIES | IN_PLACE_COPIES
_GRAPH_NAMES = {"pad": "constant_pad_nd", "to": "_to_copy"}

MB = 1024**2


@dataclass(frozen=True)
class Shapes:
    hidden: int = 1280
    heads: int = 16
    intermediate: int = 5120
    image_size: int = 560
    patch: int = 14
    tiles: int = 1
    layers: int = 5
    global_layers: int = 1
    images: int = 1


QUICK = Shapes(
    hidden=32, heads=2, intermediate=64, image_size=28, patch=14, tiles=4, layers=5
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
    model = MllamaVisionEncoder(config)
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


# ---- counting ------------------------------------------------------------------


@dataclass
class CopyCount:
    ops: Counter[str] = field(default_factory=Counter)
    copied_bytes: int = 0

    def add(self, name: str, nbytes: int) -> None:
        self.ops[name] += 1
        self.copied_bytes += nbytes

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def allocating(self) -> int:
        return sum(n for op, n in self.ops.items() if op in ALLOCATING_COPIES)


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def eager_counter() -> Any:
    """A TorchDispatchMode counting copy ops (aten names) and the bytes of every
    tensor an op allocates (outputs whose schema says they alias nothing)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class EagerCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies = CopyCount()
            self.allocated_bytes = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for ret, t in zip(func._schema.returns, outs, strict=False):
                if isinstance(t, torch.Tensor) and ret.alias_info is None:
                    self.allocated_bytes += _nbytes(t)
            name = func.overloadpacket.__name__
            if name in COPY_OPS:
                # index_copy_(self, dim, index, source) writes ``source``'s size.
                written = args[3] if name.startswith("index_copy") else outs[0]
                self.copies.add(name, _nbytes(written))
            return out

    return EagerCounter()


class GraphCounter:
    """A torch.compile backend that counts copy ops in the FX graphs it is
    given, then hands them to the real backend."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.copies = CopyCount()
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Any:
        from torch._dynamo import lookup_backend

        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            raw = node.target if node.op == "call_method" else node.target.__name__
            name = _GRAPH_NAMES.get(raw, raw)
            if name not in COPY_OPS or not self._copies(node, name):
                continue
            src = node.args[3] if name.startswith("index_copy") else node
            value = src.meta.get("example_value")
            self.copies.add(name, _nbytes(value) if value is not None else 0)
        return lookup_backend(self.inner)(gm, example_inputs)

    @staticmethod
    def _copies(node: Any, name: str) -> bool:
        """``x.to(dtype)`` copies only when the dtype changes."""
        if name != "_to_copy":
            return True
        src, out = (
            node.args[0].meta.get("example_value"),
            node.meta.get("example_value"),
        )
        return src is None or out is None or src.dtype != out.dtype


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


# ---- one variant ---------------------------------------------------------------


@dataclass
class Result:
    variant: str
    layout: str  # "stack" | "prealloc"
    mode: str  # "eager" | "graph"
    median_ms: float
    times_ms: list[float]
    first_call_s: float  # graph mode: compilation plus one run
    allocated_bytes: int  # torch allocator, during the warm-up forward
    peak_bytes: int  # highest live bytes above the start of that forward
    dispatch_allocated_bytes: int | None  # eager only: fresh outputs of aten ops
    copy_ops: int
    allocating_copy_ops: int
    copied_bytes: int
    copy_breakdown: dict[str, int]
    graphs: int
    max_abs_diff: float = 0.0


def measured_forward(
    call: Callable[[], tuple[Any, float]], eager: Any | None, device_type: str
) -> tuple[Any, int, int]:
    """The warm-up forward, measured: its output (cloned), the bytes the
    allocator gave out and the peak live bytes; ``eager`` (a dispatch-mode
    counter) also counts the aten ops. Eager runs under no_grad rather than
    inference_mode: the same kernels, but inference_mode hands composite ops
    (reshape, pad, to) to the dispatch mode whole, hiding the copies they make."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with (
        torch.inference_mode(eager is None),
        torch.no_grad(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        if eager is not None:
            with eager:
                out, _ = call()
        else:
            out, _ = call()
    events = prof.profiler.kineto_results.events()
    memory = [e for e in events if e.name() == "[memory]"]
    allocated, peak = allocator_figures(memory, device_type)
    return out.detach().clone(), allocated, peak


def run_variant(
    layout: str,
    mode: str,
    model: Any,
    inputs: tuple[Any, ...],
    reps: int,
) -> tuple[Result, Any]:
    import torch

    from vllm_hpu_mm import device as dev

    pixels, ids, mask = inputs
    forward: Callable[..., Any]
    if layout == "prealloc":
        states = model.new_states(pixels.shape[0], pixels.device, pixels.dtype)
        forward = model.forward
        args: tuple[Any, ...] = (pixels, ids, mask, states)
    else:
        forward = model.forward_stacked
        args = (pixels, ids, mask)
    counter: GraphCounter | None = None
    if mode == "graph":
        counter = GraphCounter(dev.compile_backend())
        forward = torch.compile(forward, backend=counter, dynamic=False)

    def call() -> Any:
        dev.synchronize()
        start = time.perf_counter()
        out = forward(*args)
        dev.synchronize()
        return out, time.perf_counter() - start

    eager = eager_counter() if mode == "eager" else None
    with torch.inference_mode():
        first_s = call()[1] if mode == "graph" else 0.0
    output, allocated, peak = measured_forward(call, eager, pixels.device.type)
    with torch.inference_mode():
        times = [call()[1] for _ in range(reps)]
    source = counter if counter is not None else eager
    assert source is not None
    copies: CopyCount = source.copies
    result = Result(
        variant=f"{'tuple+stack' if layout == 'stack' else 'prealloc buffer'}, {mode}",
        layout=layout,
        mode=mode,
        median_ms=round(1000 * statistics.median(times), 1),
        times_ms=[round(1000 * t, 1) for t in times],
        first_call_s=round(first_s, 2),
        allocated_bytes=allocated,
        peak_bytes=peak,
        dispatch_allocated_bytes=eager.allocated_bytes if eager is not None else None,
        copy_ops=copies.total,
        allocating_copy_ops=copies.allocating,
        copied_bytes=copies.copied_bytes,
        copy_breakdown=dict(sorted(copies.ops.items())),
        graphs=counter.graphs if counter is not None else 0,
    )
    return result, output


# ---- report --------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    head = (
        "| variant | ms / forward | first call s | allocated MB | peak MB "
        "| copy ops (allocating) | copied MB | max abs diff |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        first = f"{r.first_call_s:.1f}" if r.mode == "graph" else "-"
        lines.append(
            f"| {r.variant} | {r.median_ms:.1f} | {first} "
            f"| {r.allocated_bytes / MB:.1f} | {r.peak_bytes / MB:.1f} "
            f"| {r.copy_ops} ({r.allocating_copy_ops}) "
            f"| {r.copied_bytes / MB:.1f} | {r.max_abs_diff:.2e} |"
        )
    return "\n".join(lines)


def ratios(results: list[Result]) -> dict[str, float]:
    by = {(r.layout, r.mode): r.median_ms for r in results}
    out = {}
    for mode in ("eager", "graph"):
        if ("stack", mode) in by and ("prealloc", mode) in by:
            out[f"prealloc/stack time, {mode}"] = (
                by["prealloc", mode] / by["stack", mode]
            )
    for layout in ("stack", "prealloc"):
        if (layout, "eager") in by and (layout, "graph") in by:
            out[f"graph/eager time, {layout}"] = (
                by[layout, "graph"] / by[layout, "eager"]
            )
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Shapes()
    p.add_argument("--layers", type=int, default=d.layers, help="local layers")
    p.add_argument("--global-layers", type=int, default=d.global_layers)
    p.add_argument("--images", type=int, default=d.images)
    p.add_argument(
        "--tiles",
        type=int,
        default=d.tiles,
        help="tiles per image (the model uses 4; one layer at 4 tiles takes "
        "about a minute on a 2-core CPU)",
    )
    p.add_argument("--reps", type=int, default=3, help="timed forwards per variant")
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

    shapes = replace(
        QUICK if args.quick else Shapes(),
        **(
            {}
            if args.quick
            else {
                "layers": args.layers,
                "global_layers": args.global_layers,
                "images": args.images,
                "tiles": args.tiles,
            }
        ),
    )
    device = dev.torch_device()
    dtype_name = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    model, inputs = build(shapes, dtype, device, args.seed)
    kept = scaled_intermediate(shapes.layers)
    rows = model.num_patches
    buffer_mb = _nbytes(model.new_states(shapes.images, torch.device("meta"), dtype))
    print(
        f"Mllama vision encoder on {device.type} ({dtype_name}, "
        f"{torch.get_num_threads()} threads): hidden {shapes.hidden}, "
        f"{shapes.heads} heads, MLP {shapes.intermediate}, {shapes.layers} local + "
        f"{shapes.global_layers} global layers, intermediate layers {kept}, "
        f"{shapes.images} image(s) x {shapes.tiles} tile(s) x {rows} rows "
        f"(padded {model.padded}), output dim {model.output_dim}; "
        f"encoder_states buffer {buffer_mb / MB:.1f} MB (allocated once, outside "
        f"the forward)",
        flush=True,
    )

    results: list[Result] = []
    reference = None
    for mode in args.modes.split(","):
        for layout in ("stack", "prealloc"):
            result, output = run_variant(layout, mode, model, inputs, args.reps)
            if reference is None:
                reference = output
            result.max_abs_diff = float((output - reference).abs().max())
            results.append(result)
            print(
                f"  {result.variant}: {result.median_ms:.1f} ms {result.times_ms}",
                flush=True,
            )
            del output
            gc.collect()
            torch._dynamo.reset()
            dev.empty_cache()

    print()
    print(format_table(results))
    print()
    for name, value in ratios(results).items():
        print(f"{name}: {value:.2f}x")
    for r in results:
        ops = ", ".join(f"{k} {v}" for k, v in r.copy_breakdown.items())
        print(f"copy ops, {r.variant}: {ops}")
    if args.output_json:
        report = {
            "device": device.type,
            "dtype": dtype_name,
            "threads": torch.get_num_threads(),
            "shapes": asdict(shapes),
            "intermediate_layers": kept,
            "rows_per_tile": rows,
            "padded_rows_per_tile": model.padded,
            "output_dim": model.output_dim,
            "buffer_mb": round(buffer_mb / MB, 2),
            "reps": args.reps,
            "ratios": ratios(results),
            "results": [asdict(r) for r in results],
        }
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
