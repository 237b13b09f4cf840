"""Where graph mode keeps torch.compile's on-disk caches
(``hpu_mm.warmup.compile_cache_dir``): under the chosen directory, in a
subdirectory named by the CPU kernels in use (``device.cpu_kernel_tag``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from vllm_hpu_mm.device import cpu_kernel_tag
from vllm_hpu_mm.worker.graphs import default_compile_cache_dir, use_compile_cache


def test_configured_directory_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    got = use_compile_cache(str(tmp_path / "mine"))
    assert got == str(tmp_path / "mine" / cpu_kernel_tag()) and Path(got).is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == got
    # A second engine in the same process keeps the directory chosen.
    assert use_compile_cache(None) == got


def test_users_environment_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert use_compile_cache(None) == str(tmp_path / "env" / cpu_kernel_tag())


@pytest.mark.parametrize("torch_wrote_its_default", [False, True])
def test_default_is_the_users_cache_not_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_wrote_its_default: bool
) -> None:
    # Torch puts its /tmp default into the environment when it first resolves
    # the directory: that value is not a choice of the user's.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if torch_wrote_its_default:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    else:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    got = use_compile_cache(None)
    root = tmp_path / "xdg" / "vllm-hpu-mm" / "torch-compile"
    assert root == Path(default_compile_cache_dir())
    assert got == str(root / cpu_kernel_tag())


_TAG_OF_A_START = (
    "from vllm_hpu_mm.device import cpu_kernel_tag; print(cpu_kernel_tag())"
)
# What a CPU without AMX runs, imitated here: PyTorch's AVX2 kernels (an AMD
# Zen 2/3 or an older Xeon), oneDNN kept to AVX-512 with bfloat16 or to AVX2.
LOWERED = [
    {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
]


def _start_tag(**env: str) -> str:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
    }
    out = subprocess.run(
        [sys.executable, "-c", _TAG_OF_A_START],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("lowered", LOWERED, ids=lambda e: "+".join(e.values()))
def test_other_instruction_set_limits_get_their_own_graphs(
    lowered: dict[str, str],
) -> None:
    # Inductor's cache does not key on the kernels in use: a bfloat16 Mllama
    # vision encoder compiled with the full instruction set and loaded by a
    # start with PyTorch's AVX2 kernels returned NaN (issue 34). Each setting
    # (read at process start, hence a process each) gets its own directory,
    # named by the tag (the tests above).
    full, limited = _start_tag(), _start_tag(**lowered)
    assert full.startswith("cpu-") and limited.startswith("cpu-")
    assert full != limited
