"""How fast can this machine run the throughput workload at all? A roofline.

Measures what the CPU achieves on the benchmark Llama's own matmuls
(``F.linear`` with ``[out, in]`` weights as the model holds them, bfloat16 and
float32, a prefill step of ``--step-tokens`` rows and a decode step of
``--max-num-seqs`` rows) and its memory bandwidth (a large bfloat16 copy), counts
the FLOPs of the workload (``--num-prompts`` x (``--input-len`` prompt +
``--output-len`` output tokens), dense layers, LM head and attention), and
prints the shortest time the workload can take: every FLOP at the best measured
rate (the prefill shapes'), and a decode step no faster than one read of the
weights at the measured bandwidth. The decode shapes' own rate is printed too:
it is what the library reaches there, not a limit of the hardware. Given
measured requests/s (``--engine NAME=REQ_S``, e.g. ``--engine hf=6.01
--engine ours=5.49``) it prints the fraction of that
bound each engine reaches and the most any engine could gain over it:

    .venv/bin/python benchmarks/roofline.py --engine hf=6.01 --engine ours=5.49

If an engine already reaches more than 1/3 of the bound, no engine can run 3x
faster than it on this hardware. Figures on a shared machine vary with the load
(printed with ``os.getloadavg``): read them on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The benchmark Llama of benchmarks/vs_vllm_cpu.py (BENCH_MODEL_CONFIG), vocab
# of the project's tokenizer.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 768, 12, 12, 4, 64, 2048, 640


@dataclass(frozen=True, slots=True)
class Model:
    hidden: int = HIDDEN
    layers: int = LAYERS
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    mlp: int = MLP
    vocab: int = VOCAB

    def matmuls(self) -> list[tuple[str, int, int, int]]:
        """(name, in, out, count per token) of every dense matmul."""
        q, kv = self.heads * self.head_dim, 2 * self.kv_heads * self.head_dim
        return [
            ("qkv", self.hidden, q + kv, self.layers),
            ("o", q, self.hidden, self.layers),
            ("gate_up", self.hidden, 2 * self.mlp, self.layers),
            ("down", self.mlp, self.hidden, self.layers),
        ]

    @property
    def dense_params(self) -> int:
        return sum(i * o * n for _, i, o, n in self.matmuls())

    def token_flops(self, context: float, logits: bool) -> float:
        """FLOPs of one token row attending to ``context`` keys (QK and PV:
        2 matmuls of heads x head_dim x context, 2 FLOPs a multiply-add)."""
        dense = 2 * self.dense_params
        attn = self.layers * 4 * self.heads * self.head_dim * context
        return dense + attn + (2 * self.hidden * self.vocab if logits else 0)

    @property
    def weight_bytes_bf16(self) -> int:
        return 2 * (self.dense_params + self.hidden * self.vocab)


def _best_seconds(fn: Callable[[], object], repeats: int, min_s: float) -> float:
    """The fastest single call seen in ``repeats`` windows of ``min_s``: on a
    shared machine a call that lost the CPU is slower, never faster."""
    fn()  # warm up (oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        window = time.perf_counter()
        while time.perf_counter() - window < min_s:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best


def step_flop_rate(
    model: Model, rows: int, dtype: torch.dtype, repeats: int, min_s: float
) -> float:
    """FLOP/s of one token row block through every dense matmul of the model
    (each shape timed alone, best of ``repeats``), weighted by its FLOPs."""
    seconds = 0.0
    flops = 0.0
    for _, i, o, n in model.matmuls():
        a = torch.randn(rows, i).to(dtype)
        w = torch.randn(o, i).to(dtype)  # nn.Linear's layout
        seconds += n * _best_seconds(lambda a=a, w=w: F.linear(a, w), repeats, min_s)
        flops += n * 2 * rows * i * o
    return flops / seconds


def copy_bandwidth(nbytes: int, repeats: int, min_s: float) -> float:
    """Bytes/s of a bfloat16 copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats, min_s)


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    max_num_seqs: int

    def prefill_flops(self, model: Model) -> float:
        # The prompt's rows attend causally (on average to half of it); the
        # last row's logits give the first output token.
        rows = self.num_prompts * self.input_len
        per_row = model.token_flops((self.input_len + 1) / 2, logits=False)
        return rows * per_row + self.num_prompts * 2 * model.hidden * model.vocab

    def decode_rows(self) -> int:
        return self.num_prompts * (self.output_len - 1)

    def decode_flops(self, model: Model) -> float:
        mean_context = self.input_len + self.output_len / 2
        return self.decode_rows() * model.token_flops(mean_context, logits=True)

    def decode_steps(self) -> int:
        # Full batches of max_num_seqs rows, one output token each.
        waves = -(-self.num_prompts // self.max_num_seqs)
        return waves * (self.output_len - 1)


def _engine(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=REQ_PER_S, got {text!r}")
    return name, float(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument(
        "--step-tokens", type=int, default=2048, help="rows of a prefill step"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=0.2, help="per timing")
    p.add_argument(
        "--engine",
        type=_engine,
        action="append",
        default=[],
        metavar="NAME=REQ_S",
        help="an engine's measured requests/s on this workload (repeatable)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = Model()
    w = Workload(args.num_prompts, args.input_len, args.output_len, args.max_num_seqs)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (args.step_tokens, args.max_num_seqs):
            rate = step_flop_rate(model, rows, dtype, args.repeats, args.min_seconds)
            rates[(dtype, rows)] = rate
            print(
                f"torch.mm {str(dtype).removeprefix('torch.'):>8} at the model's "
                f"shapes, {rows:>5} rows: {rate / 1e9:8.1f} GFLOP/s"
            )
    bw = copy_bandwidth(256 * 2**20, args.repeats, args.min_seconds)
    print(f"bfloat16 copy of 256 MiB: {bw / 1e9:.1f} GB/s (read + write)")

    prefill, decode = w.prefill_flops(model), w.decode_flops(model)
    peak = max(rates.values())
    decode_rate = rates[(torch.bfloat16, args.max_num_seqs)]
    t_prefill = prefill / peak
    step_compute = decode / w.decode_steps() / peak
    step_memory = model.weight_bytes_bf16 / bw
    t_decode = w.decode_steps() * max(step_compute, step_memory)
    bound = t_prefill + t_decode
    print(
        f"\nWorkload: {w.num_prompts} requests x ({w.input_len} prompt + "
        f"{w.output_len} output), {model.dense_params / 1e6:.1f}M dense parameters"
    )
    print(
        f"  prefill {prefill / 1e12:.3f} TFLOP -> {t_prefill:.2f} s at "
        f"{peak / 1e9:.0f} GFLOP/s (the best measured rate)"
    )
    print(
        f"  decode  {decode / 1e12:.3f} TFLOP in {w.decode_steps()} steps -> "
        f"{t_decode:.2f} s (per step: compute {step_compute * 1e3:.1f} ms, one "
        f"read of {model.weight_bytes_bf16 / 2**20:.0f} MiB weights "
        f"{step_memory * 1e3:.1f} ms; at the decode shapes' measured "
        f"{decode_rate / 1e9:.0f} GFLOP/s a step would take "
        f"{decode / w.decode_steps() / decode_rate * 1e3:.1f} ms)"
    )
    best = w.num_prompts / bound
    print(
        f"  bound: {bound:.2f} s = {best:.2f} requests/s "
        f"({(prefill + decode) / bound / 1e9:.0f} GFLOP/s overall)"
    )
    for name, req_s in args.engine:
        seconds = w.num_prompts / req_s
        print(
            f"{name}: {req_s:.2f} requests/s = {(prefill + decode) / seconds / 1e9:.0f}"
            f" GFLOP/s, {req_s / best:.0%} of the bound; the bound is "
            f"{best / req_s:.2f}x it"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
